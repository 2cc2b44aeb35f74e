"""One hostile peer among four, in the simulator: is it caught, and what does the defence cost?

Four peers of one open run (the real stack on the simulated network: DHT, progress,
matchmaking, butterfly all-reduce, and, by default in open runs, CenteredClip with a derived
radius and verified rounds) train a least-squares model (``--dim`` weights, each peer drawing
its own batches) for ``--epochs`` epochs; peer 3 is hostile. Attacks:

* ``lying_reducer``: as a reducer, returns -1000 x the aggregate of its share;
* ``equivocating_reducer``: as a reducer, sends one member -1000 x its result and the others
  the result, each chunk signed (with the defences; :func:`equivocating_reducer`);
* ``sign_flip``: sends -1000 x its gradient;
* ``free_rider``: reports its samples to progress as usual but sends nothing when averaging
  (weight 0). The defences make a flipped gradient count for nothing (its part is far
  outside CenteredClip's derived radius, :data:`~dedloc_jax.averaging.verify.OUTLIER`), so
  ``sign_flip`` costs what this row costs, to float32 rounding (``loss_vs_free_rider``): the
  samples it claimed for the first epoch, after which a verified round has shown that its
  contribution weighs nothing and progress counts its claims as 0
  (:func:`dedloc_jax.rounds.claims.weightless`);
* the progress and claim attacks of :mod:`bench.attacks_progress`, mounted from the hostile
  peer's own DHT node (one without the run's schemas, :func:`~dedloc_jax.testing.
  open_sim_attacker`) while peer 3 trains honestly: ``hijack_epoch`` (one record at epoch
  2**53 - 1 for a week), ``keep_leading`` (one epoch ahead, claiming a state of it),
  ``claim_samples`` (2**53 samples at the current epoch, republished), ``junk_state_offer``
  (epoch 10**6, markup for addresses), ``lying_config`` (peer 3 states 1e15 B/s links in
  every registration; its reductions are honest), and ``leading_claimer`` (keep_leading
  claiming 2**53 samples at its epoch, mounted before the first round, when no peer has a
  history to tell it from a donor). These defences cannot be switched off: one row each,
  with them.
* the matchmaking attacks of :mod:`bench.hostile_leader` (``leader_takes_half``,
  ``leader_takes_one_holds``, ``leader_takes_all_but_one``, ``sybil_refusals``): their own
  five peers, matchmaking only; ``grouped_epochs`` counts the epochs with every honest peer
  in one group, ``clean_max_form_s`` the clean run's longest formation.

Each attack runs with the defences (the open-run defaults) and without them (``robust`` and
``verify`` off: the plain mean, unchecked). One row each: ``detected`` (an honest peer banned
the hostile one), ``rounds_to_detection`` (epochs until the first ban, 1 = the first round;
for the progress attacks, detected = a node refused the record or an honest reader logged it
as ignored or bounded, counted in peer 0's epochs from the attack's start),
``stall_s`` (virtual seconds beyond the clean run's for the same epochs), ``honest_loss`` and
``clean_loss`` (the honest peers' evaluation loss at the end, against the baseline each row
names in ``baseline``: ``honest3@epochs`` for the defended ``lying_reducer``,
``equivocating_reducer``, ``sign_flip`` and ``free_rider`` rows, a clean run of the three
honest peers alone (whose data is what is left once the defences take the hostile peer's out)
at the same epochs (for reference,
``loss_vs_clean_samples``: that run at the honest samples the attacked run fed, and
``loss_vs_clean4``: the clean run of four at those samples);
``clean4@samples`` for the progress attacks, where peer 3 trains honestly: the clean run of four
at equal honest samples; ``clean4@epochs`` for the undefended rows: the undefended clean run
of four at the same epochs; "at samples": interpolated between the clean run's steps around it),
``min_epoch_samples`` (the fewest honest samples one epoch closed with: an epoch hurried by
sample claims closes with fewer), ``complete_rounds`` (honest peer-epochs averaged with every
peer it expected: all four, or the three honest ones once the liar is banned). The clean rows
give the defences' overhead: ``time_ratio`` and ``bytes_ratio`` (defended / undefended; bytes
every node sent), and ``round_bytes_ratio``: the same without the link probes, whose few MB each
dominate a run this small and whose number depends on when a probe's poll finds its peer idle,
not on the defences (4 or 6 probes in one run: bytes_ratio 1.01 or 1.49).
The last line is one JSON object.

``--mode`` and ``--compression`` pick how the peers train and what crosses the wire (the
baseline rows are then the clean runs of that mode and compression):

* ``dedloc`` (the default): one averaged gradient per epoch, in ``none`` (the default),
  ``fp16``, ``bf16``, ``int8`` or ``adaptive`` (at ``--dim`` 256 every leaf is fp16: a
  1-D leaf), or ``powersgd`` (the weights seen as a matrix, :data:`POWERSGD`: two all-reduces
  a round, error feedback kept by each peer);
* ``diloco``: each peer takes an inner SGD step (``LR``) per micro-batch on its own copy and
  the epoch's round averages the pseudo-gradients ``outer - local`` (what
  :func:`dedloc_jax.diloco.diloco` sends, in NumPy here), applied by DiLoCo's outer step
  (SGD, Nesterov momentum 0.9, learning rate 0.7), in ``int8`` (the default), ``none``,
  ``fp16``, ``bf16``, ``adaptive``, or ``topk`` (:data:`TOPK` payloads with error feedback,
  all-gathered and signed, outer SGD at 1.0, as the transform's defaults). TopK rounds have
  no reducers: its reducer rows are skipped, and two attacks of its own run instead:
  ``huge_payload`` (the hostile payload's scales 1e30, finite) and ``malformed_payload``
  (duplicate offsets in every chunk); detected = an honest peer rejected a payload.

    python -m bench.byzantine [--epochs 12] [--dim 256] [--seed 0] [--batch 128]
        [--mode dedloc|diloco] [--compression none|fp16|bf16|int8|adaptive|powersgd|topk]

``--processes``: the same attacks against real processes (a tiny sahajBERT run each), one row
per attack; see :mod:`bench.byzantine_processes`.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import trio

from bench import attacks_progress as ap
from bench import hostile_leader
from dedloc_jax.averaging.bandwidth import PROBE_PROTOCOL
from dedloc_jax.averaging.reducer import Reducer
from dedloc_jax.averaging.verify import chunk_terms, result_claim, result_digest
from dedloc_jax.config import CollaborationConfig, DefenceConfig
from dedloc_jax.powersgd import PowerSGD, initial_q
from dedloc_jax.testing import open_sim_attacker, open_sim_collaboration
from dedloc_jax.topk import Payload, TopK, decode, encode, pack, unpack
from dedloc_jax.validators import MAX_BPS
from p2p.dht import DHT
from p2p.testing import SimNetwork, run_sim

PEERS = 4
HOSTILE = 3
BATCH = 128
"""Samples per micro-step (``--batch``). At 8 a peer's epoch gradient (32-40 samples of 256
dimensions) is mostly noise and the loss at epoch 12 follows the batches drawn: two clean runs
with different draws differ by about 8% (sd), so no defence can show a 10% criterion there,
and a step with a quarter of the samples missing costs 1.47-1.52 x (least squares offline, 6
draws x 3 seeds). At 128 the loss follows the steps (sd 4-7%; a missing quarter: 1.03-1.06
x): the defences' cost, not the draw's."""
MICRO_S = 0.1  # virtual seconds per micro-step
LR = 0.2  # E[x x^T] = I: stable, and the gradient noise stays below the signal at dim 256
ATTACKS = ("lying_reducer", "equivocating_reducer", "sign_flip", "free_rider")
SPARSE_ATTACKS = ("huge_payload", "malformed_payload")
"""Attacks on TopK's all-gather (``--compression topk`` only): its rounds have no reducers."""
# attacks also run without the defences
UNDEFENDED = ("lying_reducer", "equivocating_reducer", "sign_flip")
REDUCER_ATTACKS = {"lying_reducer", "equivocating_reducer"}
MODES = {
    "dedloc": ("none", "fp16", "bf16", "int8", "adaptive", "powersgd"),
    "diloco": ("int8", "none", "fp16", "bf16", "adaptive", "topk"),
}
"""What each ``--mode`` may send (``--compression``); the first is its default."""
POWERSGD = PowerSGD(rank=4)
"""``--compression powersgd``: rank 4, factors in fp16 (the library's defaults)."""
TOPK = TopK(density=0.25, chunk=64)
"""``--compression topk``: a quarter of each 64-value chunk, 2 bits a value, error feedback
0.95 (a vector of 256 values has no 4096-value chunk of the library's default)."""
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's outer Nesterov SGD (diloco's default)
PROGRESS_ATTACKS = (
    "hijack_epoch",
    "keep_leading",
    "claim_samples",
    "junk_state_offer",
    "lying_config",
    "leading_claimer",
)
LEADER_ATTACKS = tuple(a for a in hostile_leader.SCENARIOS if a != "clean")
"""A hostile matchmaking leader or Sybil refusal claims (:mod:`bench.hostile_leader`: five
peers, matchmaking only, at ``--seed``): epochs with every honest peer in one group."""
BASELINE_ALONE = "honest3@epochs"
"""A defended attack row's baseline: a clean run of the three honest peers alone (the same
batches and target), at the same epochs. Once the defences take the hostile peer's data out (a
ban, a clip, a weight of 0) the honest peers train as three: against the clean run of four
(the old baseline) the lying reducer banned in round 1 gave 1.10 x at seed 0, the three having
fed a quarter fewer samples per step. Equal epochs, not samples: here the loss follows the steps
(see BATCH), and the attacked run's first epoch closed with the hostile peer's samples counted,
so at equal samples the baseline is read part-way between its steps 11 and 12 (0.89 x at seed
0, the baseline's interpolation, not the defences; ``loss_vs_clean_samples``)."""
BASELINE_FOUR = "clean4@epochs"
"""An undefended row's baseline: the undefended clean run of four, at the same epochs."""
BASELINE_SAMPLES = "clean4@samples"
"""A progress attack's baseline (peer 3 trains honestly throughout): the clean run of four,
at equal honest samples."""
ATTACK_AT = 2.0  # virtual seconds into the run when a progress attack starts
# ... but leading_claimer at once: before the first round, no peer has averaged with anyone
# and a stranger that claims samples looks like a donor (issue 46; test_leading_claimer.py)
ATTACK_AT_START = ("leading_claimer",)
# What an honest peer logs when it ignores or bounds the attacker's word (detection).
DETECTED_BY = {
    "hijack_epoch": "ignoring peer",
    "keep_leading": "ignoring peer",
    "claim_samples": "ignoring peer",
    "leading_claimer": "ignoring peer",
    "junk_state_offer": "invalid record",
    "lying_config": "bounded by the group's medians",
    "malformed_payload": "sparse payload rejected",
}


async def mount(attack: str, dht: DHT, run_id: str, refused: list[bool]) -> None:
    """Run one of :mod:`bench.attacks_progress`'s attacks from ``dht`` (forever, for the
    republishing ones); ``refused`` gets True when a node refused one of its records."""
    if attack == "hijack_epoch":
        # (it answers its fallback store: a TTL below the week asked says nodes refused that)
        result, ttl = await ap.hijack_epoch(dht, run_id)
        refused.append(bool(result.refused) or ttl < ap.WEEK)
    elif attack == "keep_leading":  # detected when a reader leaves its claim out (the TTL
        # refused is hijack_epoch's lifetime, not this attack's claim)
        epoch = await ap.current_epoch(dht, run_id) + 1
        result, ttl = await ap.hijack_epoch(dht, run_id, epoch=epoch, state=True)
        refused.append(bool(result.refused))
        await ap.keep_leading(dht, run_id, ttl=ttl)  # the same lifetime: republishes land
    elif attack == "leading_claimer":  # keep_leading, claiming samples at its epoch too
        refused.append(False)
        await ap.keep_leading(dht, run_id, samples=ap.HUGE)
    elif attack == "claim_samples":
        epoch = await ap.current_epoch(dht, run_id)
        refused.append(bool((await ap.claim_samples(dht, run_id, epoch=epoch)).refused))
        await ap.keep_claiming_samples(dht, run_id, every=0.5)
    elif attack == "junk_state_offer":
        while True:  # republished, as a pest would
            refused.append(bool((await ap.junk_state_offer(dht, run_id)).refused))
            await trio.sleep(1.0)


class _Seen(logging.Handler):
    """Remembers the virtual time of the first record whose message holds ``needle``."""

    def __init__(self, needle: str) -> None:
        super().__init__(logging.INFO)
        self.needle = needle
        self.at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.at is None and self.needle in record.getMessage():
            self.at = trio.current_time()


@contextmanager
def _watch(needle: str | None) -> Iterator[_Seen | None]:
    """Collect the honest side's INFO records (kept from the console) while a run lasts."""
    if needle is None:
        yield None
        return
    seen = _Seen(needle)
    loggers = [logging.getLogger(n) for n in ("dedloc_jax", "p2p")]
    saved = [(lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.INFO)
        lg.propagate = False
        lg.addHandler(seen)
    try:
        yield seen
    finally:
        for lg, (level, propagate) in zip(loggers, saved, strict=True):
            lg.removeHandler(seen)
            lg.setLevel(level)
            lg.propagate = propagate


@contextmanager
def lying_reducer(peer_id: list[str]) -> Iterator[None]:
    """Every reducer run by ``peer_id[0]`` returns -1000 x its aggregate."""
    original = Reducer._aggregate

    def lying(self: Reducer, k: int, avg: np.ndarray) -> None:
        original(self, k, avg)
        if peer_id and self.plan.name(self.plan.me) == peer_id[0]:
            avg *= np.float32(-1000.0)

    Reducer._aggregate = lying  # type: ignore[method-assign]
    try:
        yield
    finally:
        Reducer._aggregate = original  # type: ignore[method-assign]


class _Twisted:
    """A reducer's result stream to one member, on which every result chunk is -1000 x the
    one every other member gets, signed like it when results are signed."""

    def __init__(self, ms: Any, red: Reducer) -> None:
        self.ms, self.red = ms, red

    async def send(self, msg: Any) -> None:
        if isinstance(msg, dict) and msg.get("t") == "res":
            r, k = self.red.plan, msg["k"]
            a, b = self.red.chunks[k]
            start, stop = self.red.start + a, self.red.start + b
            codec = r.codec.at(start, stop)
            data = bytes(codec.encode(np.float32(-1000.0) * codec.decode(msg["d"], stop - start)))
            msg = dict(msg, d=data)
            if "sg" in msg:
                cfg = r.config
                terms = chunk_terms(start, stop, codec.name, cfg.robust_mode, cfg.robust_tau)
                mask, tau = frozenset(msg["m"]), msg.get("u")
                rd = result_digest(r.round_id, r.spec.digest, r.me, k, data, mask, tau, terms)
                msg["sg"] = self.red.identity.sign(
                    result_claim(r.round_id, r.spec.digest, r.me, k, rd)
                )
        await self.ms.send(msg)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ms, name)


@contextmanager
def equivocating_reducer(peer_id: list[str]) -> Iterator[None]:
    """Every reducer run by ``peer_id[0]`` sends the lowest-indexed other sender of its group
    -1000 x its result (each chunk signed) and the others its result."""
    original = Reducer._send_results_to

    async def send_results_to(self: Reducer, s: int, ms: Any, gauge: Any) -> None:
        r = self.plan
        if peer_id and r.name(r.me) == peer_id[0] and s == min(set(r.senders) - {r.me}):
            ms = _Twisted(ms, self)
        await original(self, s, ms, gauge)

    Reducer._send_results_to = send_results_to  # type: ignore[method-assign]
    try:
        yield
    finally:
        Reducer._send_results_to = original  # type: ignore[method-assign]


class Task:
    """The least-squares problem: peers' batches, the evaluation set, loss and gradient."""

    def __init__(self, dim: int, seed: int, batch: int = BATCH) -> None:
        rng = np.random.default_rng(seed)
        self.dim = dim
        self.batch_size = batch
        self.truth = rng.standard_normal(dim).astype(np.float32) / np.sqrt(dim)
        self.eval_x = rng.standard_normal((256, dim)).astype(np.float32)
        self.eval_y = self.eval_x @ self.truth
        self.seed = seed

    def batch(self, peer: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        # The last entropy word is non-zero: SeedSequence drops trailing zeros, so
        # [seed, 0, 0] was the task's own stream and peer 0's first batch held 16 x the truth
        # and seven evaluation rows (every run's loss at seed 0 about half its typical figure).
        rng = np.random.default_rng([self.seed, peer, step, 1])
        x = rng.standard_normal((self.batch_size, self.dim)).astype(np.float32)
        y = x @ self.truth + 0.1 * rng.standard_normal(self.batch_size).astype(np.float32)
        return x, y

    @staticmethod
    def grad(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return (x.T @ (x @ w - y) / len(y)).astype(np.float32)

    def loss(self, w: np.ndarray) -> float:
        r = self.eval_x @ w.astype(np.float64) - self.eval_y
        return float(0.5 * np.mean(r * r))


def _matrix(dim: int) -> tuple[int, int]:
    """The weights as a matrix for PowerSGD: the most nearly square factorisation of ``dim``."""
    rows = max(d for d in range(1, int(np.sqrt(dim)) + 1) if dim % d == 0)
    return rows, dim // rows


class Learner:
    """One peer's training in ``--mode dedloc`` with a codec: the epoch's gradients
    accumulate, their mean is averaged and applied with ``LR``. ``weights``: what is evaluated
    and compared across peers."""

    def __init__(self, task: Task, compression: str) -> None:
        self.task, self.compression = task, compression
        self.weights = np.zeros(task.dim, np.float32)
        self.acc = np.zeros(task.dim, np.float32)

    def micro(self, x: np.ndarray, y: np.ndarray) -> None:
        self.acc += self.task.grad(self.weights, x, y) * len(y)

    def sent(self, samples: int, scale: float) -> tuple[list[np.ndarray], Any]:
        """What goes to the round (the update times ``scale``: -1000 for a sign flip) and
        the codec argument of ``average`` (None: the config's)."""
        g = self.acc / samples
        self.acc = np.zeros(self.task.dim, np.float32)
        return [g * np.float32(scale) if scale != 1 else g], None

    def land(self, average: list[np.ndarray]) -> None:
        self.weights = self.weights - LR * np.asarray(average[0], np.float32)


class PowerSGDLearner(Learner):
    """``--mode dedloc --compression powersgd``: the mean gradient of the epoch (a matrix,
    :func:`_matrix`) plus this peer's error feedback goes through both phases."""

    def __init__(self, task: Task, compression: str) -> None:
        super().__init__(task, compression)
        self.shape = _matrix(task.dim)
        self.q = initial_q(POWERSGD, [self.shape])
        self.errors = [np.zeros(self.shape, np.float32) for _ in self.q]

    def sent(self, samples: int, scale: float) -> tuple[list[np.ndarray], Any]:
        (g,), _ = super().sent(samples, scale)
        m = g.reshape(self.shape) + (self.errors[0] if self.errors else 0)
        return [m.astype(np.float32), *self.q, np.int32(1)], POWERSGD

    def land(self, average: list[np.ndarray]) -> None:
        c = len(self.q)
        self.q, self.errors = list(average[1 : 1 + c]), list(average[1 + c :])
        super().land([np.asarray(average[0], np.float32).reshape(-1)])


class DiLoCoLearner(Learner):
    """``--mode diloco``: an inner SGD step per micro-batch on this peer's local copy; the
    round averages ``outer - local`` (the transform's pseudo-gradient) and the outer
    Nesterov step lands on every peer alike; ``weights`` are the outer ones."""

    def __init__(self, task: Task, compression: str) -> None:
        super().__init__(task, compression)
        self.local = self.weights.copy()
        self.momentum = np.zeros(task.dim, np.float32)

    def micro(self, x: np.ndarray, y: np.ndarray) -> None:
        self.local = self.local - LR * self.task.grad(self.local, x, y)

    def sent(self, samples: int, scale: float) -> tuple[list[np.ndarray], Any]:
        delta = (self.weights - self.local).astype(np.float32)
        return [delta * np.float32(scale) if scale != 1 else delta], self.compression

    def land(self, average: list[np.ndarray]) -> None:
        g = np.asarray(average[0], np.float32)
        self.momentum = np.float32(OUTER_MOMENTUM) * self.momentum + g
        step = g + np.float32(OUTER_MOMENTUM) * self.momentum
        self.weights = self.weights - np.float32(OUTER_LR) * step
        self.local = self.weights.copy()


class TopKLearner(DiLoCoLearner):
    """``--mode diloco --compression topk``: the pseudo-gradient plus this peer's decayed
    error feedback goes as a :data:`TOPK` payload (offsets, codes, scales, size); what it
    leaves out stays in the feedback; outer SGD at 1.0. ``forge`` rewrites the payload (the
    hostile peer's ``huge_payload``)."""

    def __init__(self, task: Task, compression: str) -> None:
        super().__init__(task, compression)
        self.feedback = np.zeros(task.dim, np.float32)
        self.forge: Any = None

    def sent(self, samples: int, scale: float) -> tuple[list[np.ndarray], Any]:
        (delta,), _ = super().sent(samples, scale)
        acc = np.float32(TOPK.error_feedback) * self.feedback + delta
        payload = encode(TOPK, acc)
        self.feedback = acc - decode(TOPK, payload, acc.size)
        if self.forge is not None:
            payload = self.forge(payload)
        return [*payload, np.int32(acc.size)], TOPK

    def land(self, average: list[np.ndarray]) -> None:
        self.weights = self.weights - np.asarray(average[0], np.float32)
        self.local = self.weights.copy()


def learner(task: Task, mode: str, compression: str) -> Learner:
    if compression not in MODES[mode]:
        raise ValueError(f"--mode {mode} takes --compression {'|'.join(MODES[mode])}")
    if mode == "dedloc":
        return (PowerSGDLearner if compression == "powersgd" else Learner)(task, compression)
    return (TopKLearner if compression == "topk" else DiLoCoLearner)(task, compression)


def huge(payload: Payload) -> Payload:
    """``huge_payload``: every chunk's scales 1e30 (finite, in order: :func:`unpack` takes it)."""
    return Payload(payload.offsets, payload.codes, np.full_like(payload.scales, 1e30))


def malformed(data: bytes, n: int) -> bytes:
    """``malformed_payload``: ``data`` with each chunk's second offset equal to its first."""
    p = unpack(TOPK, data, n)
    offsets = p.offsets.copy()
    offsets[:, 1] = offsets[:, 0]
    return pack(TOPK, Payload(offsets, p.codes, p.scales), n)


def forge_gathers(core: Any) -> None:
    """Make ``core`` sign, send and serve :func:`malformed` payloads in its sparse gathers
    (its own checks would refuse to hold, so serve, its own: an attacker skips them)."""
    gather = core.rounds.gather
    honest, accept = gather.gather, gather._accept
    me = str(core.node.peer_id)
    own: list[Payload] = []  # what it really computed, for its own mean

    async def forged(spec: Any, cfg: TopK, data: Any, n: int, weight: float, **kw: Any) -> Any:
        if data is None:
            return await honest(spec, cfg, data, n, weight, **kw)
        own[:] = [unpack(cfg, data, n)]
        return await honest(spec, cfg, malformed(data, n), n, weight, **kw)

    def accept_own(g: Any, round_id: bytes, entry: Any) -> None:
        if isinstance(entry, dict) and entry.get("p") == me and own:
            g.held[me], g.weights[me], g.raw[me] = own[0], entry["w"], entry
            g.wake()
            return
        accept(g, round_id, entry)

    gather.gather = forged
    gather._accept = accept_own


def run(
    attack: str | None,
    defended: bool,
    epochs: int,
    task: Task,
    seed: int,
    peers: int = PEERS,
    mode: str = "dedloc",
    compression: str = "none",
) -> dict[str, Any]:
    """One run of ``peers`` peers (``peers`` = HOSTILE: the honest ones alone, the same
    batches, the same target: the run they would have had without the hostile peer), training
    in ``mode`` and sending in ``compression`` (see the module docstring)."""
    batch = task.batch_size
    target = PEERS * batch * 4
    config = CollaborationConfig.local_demo(target).replace(
        defence=DefenceConfig(robust=defended, verify=defended)
    )
    if compression in MODES["dedloc"][:-1]:  # a codec for every leaf, or adaptive
        config = config.replace(rounds=config.rounds.replace(codec=compression))
    configs = [config] * peers
    if attack == "lying_config":
        configs[HOSTILE] = ap.lying_config(config)
    liar: list[str] = []
    refused: list[bool] = []
    out: dict[str, Any] = {}

    async def main() -> None:
        net = SimNetwork(seed=seed)
        async with (
            open_sim_collaboration(
                net, peers, config=config, configs=configs, latency=0.01
            ) as cores,
            open_sim_attacker(net, cores[0].node) as attacker,
        ):
            if peers > HOSTILE:
                liar.append(str(cores[HOSTILE].node.peer_id))
            if seen is not None and seen.needle == "ignoring peer":  # the attacker's records,
                seen.needle = f"ignoring peer {attacker.peer_id}"  # not a mate's landing first
            if attack in REDUCER_ATTACKS:  # claims a huge link: the LP gives it shares
                cores[HOSTILE].meter.upload_override = MAX_BPS  # the most the schema takes
                cores[HOSTILE].meter.download_override = MAX_BPS
            learners = [learner(task, mode, compression) for _ in range(peers)]
            if peers > HOSTILE and attack == "huge_payload":
                assert isinstance(learners[HOSTILE], TopKLearner)
                learners[HOSTILE].forge = huge
            if peers > HOSTILE and attack == "malformed_payload":
                forge_gathers(cores[HOSTILE])
            groups: list[list[int]] = [[] for _ in range(peers)]
            curve: list[float] = []  # peer 0's evaluation loss after each step
            fed: list[int] = []  # the honest peers' samples in each step
            step_samples: list[list[int]] = [[] for _ in range(epochs)]
            banned_at: list[int | None] = [None] * peers
            t0 = trio.current_time()
            steps_at: list[float] = []  # peer 0's step times

            attack_at = 0.0 if attack in ATTACK_AT_START else ATTACK_AT

            async def hostile() -> None:
                await trio.sleep(attack_at)
                await mount(attack or "", attacker, "run", refused)

            async def peer(i: int) -> None:
                core, step = cores[i], 0
                me = learners[i]
                for epoch in range(epochs):
                    samples = 0
                    while True:
                        await trio.sleep(MICRO_S)
                        x, y = task.batch(i, step)
                        step += 1
                        me.micro(x, y)
                        samples += batch
                        if core.report(epoch, samples, batch):
                            break
                    if i != HOSTILE:
                        step_samples[epoch].append(samples)
                    flip = attack == "sign_flip" and i == HOSTILE
                    arrays, codec = me.sent(samples, -1000.0 if flip else 1.0)
                    free_ride = attack == "free_rider" and i == HOSTILE
                    weight = 0 if free_ride else samples
                    outcome = await core.average(epoch, arrays, weight, codec=codec)
                    groups[i].append(outcome.group_size)
                    me.land(list(outcome.average))
                    if i == 0:
                        steps_at.append(trio.current_time())
                        curve.append(task.loss(me.weights))
                        fed.append(sum(s for s in step_samples[epoch]))
                    if liar and banned_at[i] is None and core.bans.is_banned(liar[0]):
                        banned_at[i] = epoch + 1

            async with trio.open_nursery() as outer:
                if attack in PROGRESS_ATTACKS:
                    outer.start_soon(hostile)
                async with trio.open_nursery() as nursery:
                    for i in range(peers):
                        nursery.start_soon(peer, i)
                outer.cancel_scope.cancel()
            out["refused"] = any(refused)
            out["attack_at"] = t0 + attack_at
            out["steps_at"] = steps_at
            out["virtual_s"] = trio.current_time() - t0
            out["bytes"] = sum(sum(c.node.bytes_sent.values()) for c in cores)
            out["probe_bytes"] = sum(c.node.bytes_sent[PROBE_PROTOCOL] for c in cores)
            honest = [i for i in range(peers) if i != HOSTILE]
            w = [lr.weights for lr in learners]
            out["honest_loss"] = max(task.loss(w[i]) for i in honest)
            out["finite"] = all(bool(np.isfinite(w[i]).all()) for i in honest)
            out["in_step"] = all(w[i].tobytes() == w[honest[0]].tobytes() for i in honest)
            out["banned_at"] = [banned_at[i] for i in honest]
            complete = 0
            for i in honest:
                for e, size in enumerate(groups[i]):
                    banned = banned_at[i] is not None and e + 1 > banned_at[i]
                    complete += size >= (peers - 1 if banned else peers)
            out["complete_rounds"] = complete
            out["honest_rounds"] = len(honest) * epochs
            out["bans"] = cores[0].bans.listing()
            out["curve"] = curve
            out["loss0"] = task.loss(np.zeros(task.dim, np.float32))
            out["groups"] = groups[0]
            out["honest_samples"] = fed

    ctx = {"lying_reducer": lying_reducer, "equivocating_reducer": equivocating_reducer}.get(
        attack or "", lambda _: _nothing()
    )(liar)
    with ctx, _watch(DETECTED_BY.get(attack or "")) as seen:
        run_sim(main, seed=seed)
    if seen is not None:
        out["seen_at"] = seen.at
    return out


def _progress_row(attack: str, r: dict[str, Any], clean: dict[str, Any]) -> dict[str, Any]:
    """One progress attack's row: detection counted in peer 0's epochs since the attack."""
    at = r["attack_at"]
    detected_at = at if r["refused"] else r.get("seen_at")
    rounds = None
    if detected_at is not None:
        rounds = 1 + sum(at <= t < detected_at for t in r["steps_at"])
    return {
        "attack": attack,
        "defences": True,
        "detected": detected_at is not None,
        "refused_by_nodes": r["refused"],
        "rounds_to_detection": rounds,
        "stall_s": round(r["virtual_s"] - clean["virtual_s"], 2),
        "honest_loss": round(r["honest_loss"], 5),
        "baseline": BASELINE_SAMPLES,
        "clean_loss": round(_loss_at_samples(clean, sum(r["honest_samples"])), 5),
        "loss_vs_clean": round(
            r["honest_loss"] / _loss_at_samples(clean, sum(r["honest_samples"])), 4
        ),
        "min_epoch_samples": min(r["honest_samples"]),
        "complete_rounds": f"{r['complete_rounds']}/{r['honest_rounds']}",
        "in_step": r["in_step"],
    }


def _epochs_until(r: dict[str, Any], at: float | None) -> int | None:
    """Peer 0's epoch (1 = the first) in which virtual time ``at`` fell (None: never)."""
    if at is None:
        return None
    return 1 + sum(t < at for t in r["steps_at"])


def _loss_at_samples(clean: dict[str, Any], samples: int) -> float:
    """The clean run's loss when its honest peers had fed ``samples``: interpolated in log
    loss between the steps around it (its last loss if it never fed that many). Its first
    step at or past ``samples`` had fed up to an epoch more (one honest micro-step per peer
    more per epoch, 48 of 1344 samples, made claim_samples look 8% worse than clean at equal
    samples; its curve, rounded to 4 digits, another 1%)."""
    fed, before = 0, (0, clean["loss0"])
    for loss, n in zip(clean["curve"], clean["honest_samples"], strict=True):
        fed += n
        if fed >= samples:
            frac = (samples - before[0]) / (fed - before[0])
            return float(np.exp(np.log(before[1]) + frac * (np.log(loss) - np.log(before[1]))))
        before = (fed, loss)
    return clean["curve"][-1]


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=BATCH, help="samples per micro-step")
    parser.add_argument(
        "--attacks",
        nargs="*",
        default=None,
        help="(default: all that apply to the mode and compression; one named that does not "
        "apply gets a row saying why)",
    )
    parser.add_argument("--mode", choices=list(MODES), default="dedloc")
    parser.add_argument(
        "--compression",
        choices=sorted({c for cs in MODES.values() for c in cs}),
        help="what crosses the wire (default: dedloc none, diloco int8; see MODES)",
    )
    parser.add_argument(
        "--processes",
        action="store_true",
        help="real processes: a tiny sahajBERT run per scenario (bench.byzantine_processes)",
    )
    parser.add_argument("--scenarios", nargs="*", default=None, help="--processes: (default: all)")
    parser.add_argument(
        "--warm", type=int, default=3, help="--processes: clean epochs before the attack"
    )
    parser.add_argument(
        "--window", type=float, default=60.0, help="--processes: seconds watched after it"
    )
    parser.add_argument("--out", help="--processes: logs and event files (unset: /tmp/...)")
    parser.add_argument(
        "--recipe",
        choices=["bench", "readme"],
        default="bench",
        help="--processes: the trainers' run (bench: short epochs for the attack table; "
        "readme: the README's one-machine try, the shortest epochs a user runs)",
    )
    parser.add_argument(
        "--lockstep-epochs",
        type=int,
        default=150,
        help="--processes: epochs of bench.byzantine_lockstep's run after the scenarios "
        "(loss_ratio_equal_samples; 0: none)",
    )
    args = parser.parse_args()
    if args.processes:
        from bench import byzantine_processes

        args.scenarios = args.scenarios or list(byzantine_processes.SCENARIOS)
        byzantine_processes.main(args)
        return
    logging.basicConfig(level=logging.ERROR)
    compression = args.compression or MODES[args.mode][0]
    if compression not in MODES[args.mode]:
        parser.error(f"--mode {args.mode} takes --compression {'|'.join(MODES[args.mode])}")
    scheme = {"mode": args.mode, "compression": compression}
    sparse = compression == "topk"
    # TopK rounds have no reducers; the sparse attacks forge TopK payloads
    named = (
        args.attacks
        if args.attacks is not None
        else [*ATTACKS, *SPARSE_ATTACKS, *PROGRESS_ATTACKS, *LEADER_ATTACKS]
    )
    skipped = [
        a
        for a in named
        if (a in REDUCER_ATTACKS and sparse) or (a in SPARSE_ATTACKS and not sparse)
    ]
    attacks = [a for a in named if a not in skipped]
    if args.attacks is None:
        skipped = []
    task = Task(args.dim, args.seed, args.batch)
    wall = time.monotonic()

    def go(attack: str | None, defended: bool, peers: int = PEERS) -> dict[str, Any]:
        return run(attack, defended, args.epochs, task, args.seed, peers, **scheme)

    clean = {d: go(None, d) for d in (True, False)}
    rows = []
    for d in (True, False):
        c = clean[d]
        rows.append(
            {
                "attack": "none",
                "defences": d,
                "honest_loss": round(c["honest_loss"], 5),
                "virtual_s": round(c["virtual_s"], 2),
                "bytes": c["bytes"],
                "probe_bytes": c["probe_bytes"],
                "complete_rounds": f"{c['complete_rounds']}/{c['honest_rounds']}",
                "in_step": c["in_step"],
                "finite": c["finite"],
            }
        )
    for attack in skipped:
        rows.append(
            {
                "attack": attack,
                "skipped": "TopK rounds have no reducers"
                if sparse
                else "TopK payloads only (--mode diloco --compression topk)",
            }
        )
    overhead = {
        "time_ratio": round(clean[True]["virtual_s"] / clean[False]["virtual_s"], 4),
        "bytes_ratio": round(clean[True]["bytes"] / clean[False]["bytes"], 4),
        "round_bytes_ratio": round(
            (clean[True]["bytes"] - clean[True]["probe_bytes"])
            / (clean[False]["bytes"] - clean[False]["probe_bytes"]),
            4,
        ),
        "loss_ratio": round(clean[True]["honest_loss"] / clean[False]["honest_loss"], 4),
        # the same at equal honest samples: the runs' timings differ, and an epoch closing one
        # micro-step earlier in one of them made loss_ratio 1.056 at seed 0 (the aggregates
        # equal to 5e-8)
        "loss_ratio_equal_samples": round(
            clean[True]["honest_loss"]
            / _loss_at_samples(clean[False], sum(clean[True]["honest_samples"])),
            4,
        ),
    }
    losses: dict[str, float] = {}
    # The defended rows' baseline: the honest peers alone (the hostile peer's data is what the
    # defences take out), at equal honest samples; see the module docstring.
    alone = (
        go(None, True, peers=HOSTILE)
        if any(a in attacks for a in (*ATTACKS, *SPARSE_ATTACKS))
        else None
    )
    for attack in (a for a in (*ATTACKS, *SPARSE_ATTACKS) if a in attacks):
        for d in (True, False) if attack in UNDEFENDED else (True,):
            r = go(attack, d)
            if d:
                losses[attack] = r["honest_loss"]
            first = min((b for b in r["banned_at"] if b is not None), default=None)
            if attack in SPARSE_ATTACKS:  # no bans: detected = a payload rejected
                first = _epochs_until(r, r.get("seen_at"))
            row = {
                "attack": attack,
                "defences": d,
                "detected": first is not None,
                "rounds_to_detection": first,
                "stall_s": round(r["virtual_s"] - clean[d]["virtual_s"], 2),
                "honest_loss": r["honest_loss"],
            }
            if d and alone is not None:
                fed = sum(r["honest_samples"])
                row["baseline"] = BASELINE_ALONE
                row["clean_loss"] = round(alone["honest_loss"], 5)
                row["loss_vs_clean"] = round(r["honest_loss"] / alone["honest_loss"], 4)
                # for reference: the same run at equal honest samples, and the run of four
                row["loss_vs_clean_samples"] = round(
                    r["honest_loss"] / _loss_at_samples(alone, fed), 4
                )
                row["loss_vs_clean4"] = round(
                    r["honest_loss"] / _loss_at_samples(clean[True], fed), 4
                )
            else:
                row["baseline"] = BASELINE_FOUR
                row["clean_loss"] = round(clean[d]["honest_loss"], 5)
                row["loss_vs_clean"] = round(r["honest_loss"] / clean[d]["honest_loss"], 4)
            row["complete_rounds"] = f"{r['complete_rounds']}/{r['honest_rounds']}"
            row["in_step"] = r["in_step"]
            row["finite"] = r["finite"]
            row["bans"] = [(b["role"], b["reason"][:60]) for b in r["bans"]][:2]
            rows.append(row)
    for row in rows:  # the flip's cost against withheld data alone (1.0: nothing got through)
        if row["attack"] == "sign_flip" and row["defences"] and "free_rider" in losses:
            row["loss_vs_free_rider"] = round(row["honest_loss"] / losses["free_rider"], 4)
    for attack in (a for a in PROGRESS_ATTACKS if a in attacks):
        rows.append(_progress_row(attack, go(attack, True), clean[True]))
    leading = [a for a in LEADER_ATTACKS if a in attacks]  # (the scheme plays no part)
    clean_form = hostile_leader.row("clean", [args.seed], args.epochs) if leading else {}
    for attack in leading:
        row = hostile_leader.row(attack, [args.seed], args.epochs)
        rows.append({**row, "defences": True, "clean_max_form_s": clean_form["max_form_s"]})
    for row in rows:
        print(" ".join(f"{k}={v}" for k, v in row.items()))
    print(f"defences' overhead on a clean run: {overhead}")
    print(
        json.dumps(
            {
                **scheme,
                "epochs": args.epochs,
                "dim": args.dim,
                "batch": args.batch,
                "peers": PEERS,
                "rows": rows,
                "overhead": overhead,
                "wall_s": round(time.monotonic() - wall, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
