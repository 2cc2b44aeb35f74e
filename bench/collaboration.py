"""A sahajBERT-shaped collaboration in the simulator: how much of their time peers compute.

40 peers (by default) train a model of 18M parameters toward a 4096-sample target, on the
simulated network in virtual time: sahajBERT's figures (REFERENCE.md: 18M parameters, target
4096, micro-batches of 4, fp16 on the wire, and a mean of 3.95 samples/s per device, its 19,519
steps over 234 device-days), GPU throughputs spread like volunteers' (lognormal, 1-10
samples/s), home links (asymmetric, 10-100 Mbit/s up, 5x that down: REFERENCE.md gives no
link rates), a quarter of the peers client-only (behind NAT: they accept no connections), and
a few peers leaving and others joining per hour. Everything above the simulated sockets is
the real stack: secure channel, mux, DHT, progress tracker, matchmaking and butterfly
all-reduce of real vectors. (Peers do not serve or load states: a peer that fell behind moves
to the run's epoch without a download.)

By default peers use DeDLOC's delayed parameter update (``--mode overlap``): the round of
epoch t runs in the background while the peer computes toward t + 1, and its result is applied
one step late; ``--mode blocking`` stops computing while matchmaking and averaging, and
``--mode both`` runs both on the same peers, links and churn, one after the other. Blocking
peers average mid-micro-step, as :func:`dedloc_jax.collaborative` does (its hand-over,
:mod:`dedloc_jax.handover`): once half the ETA falls inside a micro-step they check every
0.25 s whether to average (``RoundConfig.poll``, the default; ``CollaborationPeer.due``),
deciding on whole micro-steps, and announce it in their progress records, so that their rounds
matchmake eagerly; when due, they average what they hold, and the micro-step in flight goes on
through the round and counts toward the next epoch. ``--no-mid-step``: they average only at
the end of a micro-step (``collaborative(..., mid_step=False)``).

``--mode diloco`` compares traffic with low-communication training (:func:`dedloc_jax.diloco`):
the same peers, links and churn run DeDLOC mode (overlap, fp16), then DiLoCo mode: an outer
step every ``--inner-steps H`` target batches (H x target samples, the samples of H DeDLOC
steps), int8 pseudo-gradients of the model's size, averaged blocking (``diloco``'s default).
On the network DiLoCo is DeDLOC with that target: peers report per micro-step and average one
vector per outer step. Reported: ``bytes_per_sample`` (every byte the simulated network
carried, DHT and matchmaking included, over the samples the peers computed) for both and
``bytes_ratio`` (DeDLOC's over DiLoCo's); ``bytes_per_complete_sample`` and
``complete_bytes_ratio`` count only the samples of rounds that completed
(``left_out_peer_epochs`` and ``left_out_samples``: work toward an epoch whose round went on
without its peer, which noticed the target after the others had moved on). With
``--payload-scale S`` the averaged vector's bytes count 1/S and the DHT's do not, so the
ratio is then understated.

Payload scale (``--payload-scale S``): the simulator moves, encrypts and reduces real bytes,
which costs CPU in proportion to the vector. With S > 1 the peers average ``params / S``
values over links S times slower, so every transfer of the averaging takes the time it would
take with the full vector; the all-reduce's chunks, the socket buffers, the link probe and the
rate an unmeasured link counts as are S times smaller too, so that each takes the time it
would at full scale. What is not faithful is that the (small) DHT, matchmaking and connection
set-up messages also travel S times slower. The JSON says ``simulated_params`` (the model the times
stand for) and ``actual_params`` (the vector moved).

Reported (last line, JSON), per run: ``complete_fraction`` (epochs whose averaging gave every
peer that took part the mean of all it expected), ``averaged_fraction`` (peer-epochs whose step
averaged with at least one other peer), ``compute_fraction`` (mean over peers of time computing
toward epochs that averaged / time in the run; ``raw_compute_fraction`` counts all computing),
``compute_ceiling`` (the most a peer can compute when every round takes the LP's bound:
computing / (computing + bound) blocking, computing / max(computing, bound) with overlap),
``bandwidth_error`` (median relative error of the links the LP got against the true ones;
peers probe their links on joining, ``LinkKeeper.keep_measured``) and ``epoch_time_ratio`` (mean
epoch time / ideal, where ideal = target / summed throughput + the averaging time that is not
hidden: the LP's bound when blocking, what of it exceeds an epoch's computing with overlap).

``--compression NAME``: what the averaged vectors travel in (default fp16; in ``--mode
diloco`` it names the DiLoCo run's, default int8, and the DeDLOC run stays fp16). A per-leaf
policy (``adaptive``) averages leaves shaped like sahajBERT's 32 (first dimensions scaled to
the vector's size), a codec one vector; ``compute_ceiling`` and ``lp_bound_seconds`` count the
encoded bytes (``wire_bytes_per_value``).

    python -m bench.collaboration [--peers 40] [--params 18000000] [--epochs 3]
        [--payload-scale S] [--mode overlap|blocking|both|diloco] [--inner-steps H]
        [--dedloc-epochs N] [--compression none|fp16|bf16|int8|adaptive]
        [--no-defences] [--match-early] [--no-mid-step] [--log-level WARNING] [--timeline]

``--timeline`` prints, per epoch, when peers stopped to average (first, median, last), when
their group formed (the round's "group of" log line) and when their round ended: where the
time that is not computing goes.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import logging
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import trio

from dedloc_jax.averaging import AllReduceConfig, Member, solve_shares
from dedloc_jax.averaging.bandwidth import UNMEASURED_DOWNLOAD_BPS, UNMEASURED_UPLOAD_BPS
from dedloc_jax.averaging.leaf_codecs import COMPRESSIONS, POLICIES, LeafCodecs
from dedloc_jax.config import (
    MID_STEP_POLL,
    CollaborationConfig,
    LinkConfig,
    ProgressConfig,
    RoundConfig,
)
from dedloc_jax.opening import open_collaboration
from dedloc_jax.peer import CollaborationPeer
from dedloc_jax.powersgd import PowerSGD, initial_q
from dedloc_jax.rounds.lowrank import wire_bytes as lowrank_wire_bytes
from dedloc_jax.topk import TopK, encode
from p2p.dht import DHTClock, DHTConfig
from p2p.dht.traffic import Traffic
from p2p.node import Node, NodeConfig, open_node
from p2p.testing import SimNetwork, run_sim, sim_identity

MBIT = 1e6 / 8  # bytes per second
PAYLOAD_SCALE = 1

_H, _E, _V, _I = 1024, 128, 32_000, 4096
SAHAJBERT_SHAPES = (
    [(_V, _E), (512, _E), (2, _E), (_E,), (_E,), (_E, _H), (_H,)]  # embeddings, mapping in
    + [(_H, _H), (_H,)] * 4 + [(_H,), (_H,)]  # attention q, k, v, dense; its LayerNorm
    + [(_H, _I), (_I,), (_I, _H), (_H,), (_H,), (_H,)]  # FFN and its LayerNorm
    + [(_H, _H), (_H,)]  # pooler
    + [(_V,), (_H, _E), (_E,), (_E,), (_E,), (_H, 2), (2,)]  # MLM head (tied decoder), SOP
)  # fmt: skip
"""sahajBERT's 32 parameter leaves (18,105,474 values; REFERENCE.md's ALBERT-large)."""


def model_leaves(params: int, seed: int) -> list[np.ndarray]:
    """Random leaves shaped like sahajBERT's, each scaled to ``params`` values in all (first
    dimensions times ``params / 18.1M``, at least 1): what a per-leaf policy sees."""
    full = sum(int(np.prod(s)) for s in SAHAJBERT_SHAPES)
    rng = np.random.default_rng(seed)
    leaves = []
    for shape in SAHAJBERT_SHAPES:
        scaled = (max(1, round(shape[0] * params / full)), *shape[1:])
        leaves.append(rng.normal(size=scaled).astype(np.float32))
    return leaves


@dataclass
class PeerStats:
    name: str
    mode: str
    rate: float  # samples per second
    up: float
    down: float
    joined: float = 0.0
    started: trio.Event = field(default_factory=trio.Event)
    left: float | None = None
    compute: float = 0.0
    processed: int = 0  # samples computed, in every epoch
    epochs: list[EpochOutcome] = field(default_factory=list)
    links: tuple[float, float] | None = None  # what the LP got from this peer, at its end
    cut_off: float = 0.0  # seconds computed toward an epoch the run's end (or leaving) cut off
    in_round: float = 0.0  # seconds computed toward epochs whose round has not ended yet
    finished: bool = False  # its round of the last epoch ended (or it moved past that epoch)
    # (epoch, samples) it computed toward an epoch that the others averaged without it (it
    # noticed the target after they had moved on): it then moves on, with no outcome
    left_out: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class EpochOutcome:
    """One peer's averaging step: what it brought and what it got back."""

    epoch: int
    ended: float  # virtual time its round ended here
    samples: int
    compute: float  # seconds this peer computed toward the epoch
    group_size: int
    complete: bool  # it holds the mean of every member its round expected
    began: float = 0.0  # virtual time it stopped computing to average (blocking) or began


# sahajBERT's run (/work/shared/REFERENCE.md): 19,519 steps of 4,096 samples in 234
# device-days, i.e. 3.95 samples/s per device, averaging and idle time included (so a lower
# bound on what a device computes). Volunteers' throughputs are drawn lognormal around it.
SAHAJBERT_SAMPLES_PER_DEVICE_SECOND = 19_519 * 4096 / (234 * 86_400)
RATE_SIGMA = 0.6  # lognormal spread: the 1st and 99th percentiles about 4x apart


def _draw_peers(n: int, rng: random.Random, scale: int = 1) -> list[PeerStats]:
    """Volunteers: GPU throughputs lognormal with sahajBERT's mean per device, within 1-10
    samples/s; home uplinks 10-100 Mbit/s with 5x that down (divided by the payload scale);
    every fourth peer a client."""
    median = SAHAJBERT_SAMPLES_PER_DEVICE_SECOND / np.exp(RATE_SIGMA**2 / 2)
    peers = []
    for i in range(n):
        rate = min(10.0, max(1.0, rng.lognormvariate(np.log(median), RATE_SIGMA)))
        up = rng.uniform(10, 100) * MBIT / scale
        mode = "client" if i % 4 == 3 else "node"
        peers.append(PeerStats(f"p{i}", mode, rate, up, 5 * up))
    return peers


async def _peer(
    net: SimNetwork,
    stats: PeerStats,
    index: int,
    first: list[str],
    config: CollaborationConfig,
    vector: tuple[list[np.ndarray], TopK | PowerSGD | None],
    micro: int,
    epochs: int,
    done: trio.Event,
    ending: trio.Event,
    overlap: bool,
    poll: float | None,
    scale: int,
    nodes: list[tuple[Node, Traffic]],
) -> None:
    _PEER.set(stats.name)  # (the --timeline's log lines name the peer they come from)
    host = net.add_host(
        stats.name,
        upload_bps=stats.up,
        download_bps=stats.down,
        latency=0.02,
        reachable=stats.mode != "client",
    )
    listen = [] if stats.mode == "client" else [host.listen_addr]
    async with (
        open_node(
            sim_identity(net, index),
            transport=host.transport,
            listen=listen,
            config=NodeConfig.bulk(),
        ) as node,
        open_collaboration(
            node,
            "sahajbert-sim",
            initial_peers=first if index else [],
            config=config.replace(mode=stats.mode),
            dht_config=DHTConfig.fast(),
            dht_clock=DHTClock(trio.current_time),
            allreduce_config=_scaled_averaging(scale),
        ) as core,
    ):
        # its bytes_sent and its DHT's requests are read once the run is over
        nodes.append((node, core.dht.protocol.traffic))
        if index == 0:
            first.append(str(node.addrs[0]))
        stats.joined = trio.current_time()
        stats.started.set()
        try:
            # The collaboration probes its links itself (config.links.measure), with the
            # config's scaled probe_bytes: a second prober here sent unscaled 4 MB probes
            # beside it, which took 20-50 s on the slowed links and kept partners busy.
            await _train(core, stats, vector, micro, epochs, done, ending, overlap, poll)
        finally:
            stats.links = core.link_keeper.bandwidth()


def _scaled_averaging(scale: int) -> AllReduceConfig:
    """The all-reduce's chunks ``scale`` times smaller, like the vector: each chunk then takes
    the time it would take at full size over the full-speed links, so that stall detection
    (``AllReduceConfig.stall_timeout``, per chunk) sees what a real run would. (Unscaled, a
    12-peer run's parts were single chunks of 30 KB that took 26 s on a 100x slower 10 Mbit/s
    uplink shared by 11 streams, and reducers excluded their senders as stalled.)"""
    base = AllReduceConfig.internet()
    return base.replace(chunk_elems=max(16, base.chunk_elems // scale))


async def _train(
    core: CollaborationPeer,
    stats: PeerStats,
    vector: tuple[list[np.ndarray], TopK | PowerSGD | None],
    micro: int,
    epochs: int,
    done: trio.Event,
    ending: trio.Event,
    overlap: bool,
    poll: float | None,
) -> None:
    """Accumulate micro-batches until the collaboration reaches the target, then average.

    With ``overlap`` (DeDLOC's delayed parameter update) the round of epoch t runs as a
    background task while this peer goes on computing toward t + 1; its result would be
    applied one step late. Without it the peer stops computing while it matchmakes and
    averages. (While the round of t runs, ``core.report`` counts toward t + 1 and answers
    False; a round longer than an epoch of computing would overshoot the next target.)
    """
    epoch = core.estimate.epoch
    samples = 0
    computed = 0.0  # seconds computed toward ``epoch``
    stats.cut_off = 0.0
    in_flight: list[trio.Event] = []  # the round of the previous epoch, while it runs
    # ``poll``: a blocking peer checks this often inside a micro-step whether to average

    async def average(at: int, contributed: int, computed: float, finished: trio.Event) -> None:
        began = trio.current_time()
        try:
            # Until its round ends the epoch's computing is cut off if the run ends first.
            stats.in_round += computed
            stats.cut_off = 0.0
            arrays, sparse = vector  # what each peer sends, and its TopK or PowerSGD
            out = await core.average(at, arrays, contributed, codec=sparse)
            stats.in_round -= computed
            stats.epochs.append(
                EpochOutcome(
                    at,
                    trio.current_time(),
                    contributed,
                    computed,
                    out.group_size,
                    out.complete,
                    began,
                )
            )
            if at + 1 >= epochs:
                stats.finished = True
                ending.set()
        finally:
            finished.set()

    async with trio.open_nursery() as nursery:
        while not done.is_set():
            step = micro / stats.rate
            end = trio.current_time() + step
            if poll and samples and await _due_before(core, epoch, end, poll):
                # Blocking, the target landed while this micro-step computes: average what we
                # hold; the micro-step in flight counts toward the next epoch.
                await average(epoch, samples, computed, trio.Event())
                epoch, samples, computed = epoch + 1, 0, 0.0
            await trio.sleep_until(end)  # (at once when the round outlasted the micro-step)
            stats.compute += step
            stats.processed += micro
            computed += step
            stats.cut_off = computed  # until its step: cut off if the run ends first
            samples += micro
            if in_flight and in_flight[0].is_set():
                in_flight.clear()
            # (blocking peers also average mid-step: they decide on whole micro-steps)
            if core.report(epoch, samples, micro, whole_steps=bool(poll)):
                finished = trio.Event()
                if overlap:
                    in_flight.append(finished)
                    nursery.start_soon(average, epoch, samples, computed, finished)
                else:
                    await average(epoch, samples, computed, finished)
                epoch, samples, computed = epoch + 1, 0, 0.0
            elif (
                not in_flight and core.estimate.epoch > epoch
            ):  # we fell behind (joined late): move on; what it computed is lost
                if samples:
                    stats.left_out.append((epoch, samples))
                epoch, samples, computed = core.estimate.epoch, 0, 0.0
                # past the last epoch it has no round left to wait for
                stats.finished = stats.finished or epoch >= epochs
        nursery.cancel_scope.cancel()


POLL = MID_STEP_POLL
"""Seconds between a blocking peer's checks, inside one micro-step, whether to average now:
the library's default (``RoundConfig.poll``: ``mid_step_poll`` is left unset, as a default
:func:`dedloc_jax.collaborative` peer leaves it)."""


async def _due_before(core: CollaborationPeer, epoch: int, end: float, poll: float) -> bool:
    """Whether this peer should average toward ``epoch`` before ``end``, the end of its micro-step
    in flight (then at once): asked when half the ETA falls before then, every ``poll``
    seconds at most. A 1 sample/s peer saw the target only at the end of its 4 s
    micro-step, and every other peer waited for it (2.7-3.4 s of a 40-peer epoch). The
    micro-step goes on through the round (the device keeps computing it) and its gradient
    counts toward the next epoch: its time is training time, none of it is thrown away."""
    while True:
        now = trio.current_time()
        # (at half the ETA: frozen records below the extrapolation stretch it as it runs out)
        wake = now + max(core.estimate.eta / 2, poll)
        if wake >= end:
            return False
        await trio.sleep_until(wake)
        if core.due(epoch):
            return True


def _round_codec(codec: str | TopK | PowerSGD) -> str:
    """The run's codec: the named one, PowerSGD's factors', int8 beside TopK (aux peers')."""
    if isinstance(codec, PowerSGD):
        return codec.codec
    return codec if isinstance(codec, str) else "int8"


def simulate(
    args: argparse.Namespace,
    *,
    overlap: bool,
    config: CollaborationConfig | None = None,
    target: int | None = None,
    codec: str | TopK | PowerSGD = "fp16",
) -> dict[str, float | None]:
    """One run of the collaboration (same peers, links and churn for a given seed); ``target``
    and ``codec``: samples per averaging and the wire codec (DeDLOC's by default)."""
    rng = random.Random(args.seed)
    peers = _draw_peers(args.peers, rng, args.payload_scale)
    # DeDLOC's blocking peers average mid-step when the target lands, as collaborative does
    # (--no-mid-step: not; DiLoCo's outer steps, hours apart, and a config given keep theirs)
    mid_step = bool(getattr(args, "mid_step", True)) and not overlap
    mid_step = mid_step and target is None and config is None
    target = target or args.target
    # An unmeasured link counts as a slow home link, slowed like every link by the scale.
    config = config or CollaborationConfig(
        target_batch_size=target,
        rounds=RoundConfig(codec=_round_codec(codec)),
        progress=ProgressConfig(max_refresh=5.0),
        links=LinkConfig(
            unmeasured_upload_bps=UNMEASURED_UPLOAD_BPS / args.payload_scale,
            unmeasured_download_bps=UNMEASURED_DOWNLOAD_BPS / args.payload_scale,
        ),
    )
    if isinstance(codec, TopK):  # sparse payloads are all-gathered: no LP split to size
        config = config.replace(links=config.links.replace(measure=False))
    elif not isinstance(codec, PowerSGD):
        codec = config.rounds.codec  # a config given names its own
    if getattr(args, "no_defences", False):  # a public run has them on: CenteredClip, checks
        config = config.replace(defence=config.defence.replace(robust=False, verify=False))
    match_early = getattr(args, "match_early", None)  # None: the config's (off)
    if match_early is not None:  # whether the group is planned ahead of the target
        config = config.replace(rounds=config.rounds.replace(match_early=match_early))
    # (mid-step peers poll at the library's default, RoundConfig.mid_step_poll unset, as a
    # default collaborative(mid_step=True) peer does; their records announce it)
    # A probe as many seconds of a link as at full scale (4 MB), within a 64 KB floor.
    probe_bytes = max(64 << 10, (4 << 20) // args.payload_scale)
    config = config.replace(links=config.links.replace(probe_bytes=probe_bytes))
    sent: list[int] = []
    traffic: Counter[str] = Counter()  # bytes every node wrote, per protocol
    dht_bytes: Counter[str] = Counter()  # the DHT requests' bytes, per message and purpose
    nodes: list[tuple[Node, Traffic]] = []
    actual = max(1, args.params // args.payload_scale)
    if isinstance(codec, PowerSGD) or codec in POLICIES:  # per leaf: the model's leaves
        arrays = model_leaves(actual, args.seed)
        actual = sum(a.size for a in arrays)
    else:  # one codec for everything: one vector (a view, not a copy, in every round)
        arrays = [np.random.default_rng(args.seed).normal(size=actual).astype(np.float32)]
    for a in arrays:
        a.setflags(write=False)
    sent_arrays: tuple[list[np.ndarray], TopK | PowerSGD | None] = (arrays, None)
    if isinstance(codec, TopK):  # every peer sends the payload of the same vector
        sent_arrays = ([*encode(codec, arrays[0]), np.int32(actual)], codec)
    if isinstance(codec, PowerSGD):  # the leaves (M) and the first Q: collaborative's form
        first_q = initial_q(codec, [a.shape for a in arrays])
        sent_arrays = ([*arrays, *first_q, np.int32(len(arrays))], codec)

    async def run() -> list[PeerStats]:
        # Socket buffers hold as many seconds of a link as at full scale: unscaled, 512 KB
        # queued ahead of a new stream's first frame took 5-40 s on the 100x slower links,
        # and reducers excluded senders whose streams were still opening.
        net = SimNetwork(seed=args.seed, buffer_bytes=max(4096, (512 << 10) // args.payload_scale))
        first: list[str] = []
        done = trio.Event()
        ending = trio.Event()  # a peer's round of the last epoch ended
        everyone = list(peers)
        async with trio.open_nursery() as nursery:
            scopes: dict[str, trio.CancelScope] = {}

            async def start(stats: PeerStats, index: int) -> None:
                with trio.CancelScope() as scope:
                    scopes[stats.name] = scope
                    await _peer(
                        net,
                        stats,
                        index,
                        first,
                        config,
                        sent_arrays,
                        args.micro,
                        args.epochs,
                        done,
                        ending,
                        overlap,
                        config.rounds.poll if mid_step else None,
                        args.payload_scale,
                        nodes,
                    )

            await nursery.start(_started, start, peers[0], 0)
            for i, stats in enumerate(peers[1:], start=1):
                nursery.start_soon(start, stats, i)

            async def churn() -> None:
                index = len(peers)
                while args.churn_per_hour > 0:
                    await trio.sleep(rng.expovariate(args.churn_per_hour / 3600))
                    alive = [p for p in everyone[1:] if p.left is None and p.name in scopes]
                    if not alive:
                        continue
                    victim = rng.choice(alive)
                    victim.left = trio.current_time()
                    scopes[victim.name].cancel()
                    net.kill(victim.name)
                    newcomer = _draw_peers(index + 1, rng, args.payload_scale)[-1]
                    newcomer.name = f"p{index}"
                    everyone.append(newcomer)
                    nursery.start_soon(start, newcomer, index)
                    index += 1

            nursery.start_soon(churn)
            # The run ends once every peer in it has its last epoch's outcome (bounded):
            # cutting the others' rounds off would count them as failures.
            await ending.wait()
            with trio.move_on_after(600):
                while any(
                    p.left is None and p.started.is_set() and not p.finished for p in everyone
                ):
                    await trio.sleep(1.0)
            done.set()
            end = trio.current_time()
            for p in everyone:
                if p.left is None:
                    p.left = end
            nursery.cancel_scope.cancel()
        sent.append(net.stats.bytes)
        for node, dht in nodes:
            traffic.update(node.bytes_sent)
            dht_bytes.update(dht.bytes)
        return everyone

    times = GroupTimes()
    timeline = getattr(args, "timeline", False)
    if timeline:
        for name in GROUP_LOGGERS:
            logging.getLogger(name).setLevel(logging.INFO)
            logging.getLogger(name).addHandler(times)
    wall = time.perf_counter()
    try:
        everyone = run_sim(run, seed=args.seed)
    finally:
        for name in GROUP_LOGGERS if timeline else ():
            logging.getLogger(name).removeHandler(times)
    wall = time.perf_counter() - wall

    for p in everyone:  # epochs past the last, which peers that finished early went on to
        p.cut_off += sum(o.compute for o in p.epochs if o.epoch >= args.epochs)
        p.epochs = [o for o in p.epochs if o.epoch < args.epochs]
    # the LP bound of the vector's encoded bytes (in one share: chunked as a round cuts it)
    chunk = max(16, AllReduceConfig.internet().chunk_elems // args.payload_scale)
    if isinstance(codec, TopK):  # one payload per peer (all-gathered)
        encoded, name = codec.payload_bytes(actual), "topk"
    elif isinstance(codec, PowerSGD):  # both phases' vectors
        plan = codec.plan([a.shape for a in arrays])
        encoded, name = lowrank_wire_bytes(plan, (1,), chunk), f"powersgd-r{codec.rank}"
    else:
        plan = LeafCodecs.of_shapes(codec, [a.shape for a in arrays])
        encoded, name = plan.wire_bytes((0, plan.size), chunk), codec
    figures = outcome_figures(everyone, peers, target, encoded, overlap=overlap)
    figures["compression"] = name
    figures["vector_values"] = actual
    figures["wire_bytes_per_value"] = round(encoded / actual, 4)
    processed = sum(p.processed for p in everyone)
    figures["bytes_sent"] = sent[0]
    figures["samples_processed"] = processed
    figures["bytes_per_sample"] = round(sent[0] / processed, 2) if processed else None
    useful = _complete_samples(everyone)  # samples of the rounds that completed
    figures["bytes_per_complete_sample"] = round(sent[0] / useful, 2) if useful else None
    # peer-epochs computed toward but averaged without them (no outcome: not counted above)
    left_out = [(e, n) for p in everyone for e, n in p.left_out if e < args.epochs]
    figures["left_out_peer_epochs"] = len(left_out)
    figures["left_out_samples"] = sum(n for _, n in left_out)
    figures["bytes_by_kind"] = bytes_by_kind(traffic, sent[0])
    figures["dht_bytes_by_purpose"] = dict(dht_bytes.most_common())
    mode = "overlapped (delayed update)" if overlap else "blocking"
    print(f"--- {mode}: {figures['epochs']} epochs in {wall:.0f} s of wall time")
    print(
        f"complete rounds {figures['complete_fraction']}, averaged peer-epochs "
        f"{figures['averaged_fraction']}, compute fraction {figures['compute_fraction']} "
        f"(raw {figures['raw_compute_fraction']}, time-weighted "
        f"{figures['weighted_compute_fraction']}; at most {figures['compute_ceiling']} with "
        f"every round at the LP bound), bandwidth error {figures['bandwidth_error']}"
    )
    print(
        f"{sent[0]:,} bytes sent for {processed:,} samples: {figures['bytes_per_sample']} B/sample"
    )
    print("bytes by kind:", ", ".join(f"{k} {v:,}" for k, v in figures["bytes_by_kind"].items()))
    print(
        "DHT requests' bytes by message/purpose:",
        ", ".join(f"{k} {v:,}" for k, v in figures["dht_bytes_by_purpose"].items()),
    )
    print(
        f"epoch {figures['epoch_seconds']} s against an ideal {figures['ideal_epoch_seconds']} s"
        f" (LP bound {figures['lp_bound_seconds']} s)"
    )
    for e in sorted({o.epoch for p in everyone for o in p.epochs}):
        got = [o for p in everyone for o in p.epochs if o.epoch == e]
        sizes = statistics.multimode(o.group_size for o in got)
        alone = [
            f"{p.name} ({p.mode}, joined {p.joined:.0f} s, round ended {o.ended:.0f} s)"
            for p in everyone
            for o in p.epochs
            if o.epoch == e and o.group_size == 1
        ]
        out = [(p.name, n) for p in everyone for x, n in p.left_out if x == e]
        print(
            f"epoch {e}: {len(got)} peers, {sum(o.complete for o in got)} complete, "
            f"{len(alone)} alone {alone}, commonest group size {sizes}, "
            f"{len(out)} left out (peer, samples) {out}"
        )
    if timeline:
        print_timeline(everyone, times.formed)
    figures["wall_seconds"] = round(wall, 1)
    return figures


_PEER: contextvars.ContextVar[str | None] = contextvars.ContextVar("peer", default=None)
"""The simulated peer a task belongs to (its tasks inherit it): names ``--timeline``'s lines."""

GROUP_LOGGERS = ("dedloc_jax.rounds.average", "dedloc_jax.rounds.lowrank")
"""Where a round logs that its group formed ("epoch %d: [PowerSGD ]group of %d ...")."""


class GroupTimes(logging.Handler):
    """``--timeline``: when each peer's group formed, per epoch, from the rounds' log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.formed: dict[tuple[str, int], float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        peer, msg = _PEER.get(), str(record.msg)
        if peer is not None and "group of" in msg and record.args:
            self.formed.setdefault((peer, int(record.args[0])), trio.current_time())


def print_timeline(everyone: list[PeerStats], formed: dict[tuple[str, int], float]) -> None:
    """Per epoch (virtual seconds): peers stopping to average (first, median, last), their
    groups forming and their rounds ending (median, last), and the median peer's wait from
    stopping to its group and from its group to the round's end."""
    by_epoch: dict[int, list[tuple[str, EpochOutcome]]] = {}
    for p in everyone:
        for o in p.epochs:
            by_epoch.setdefault(o.epoch, []).append((p.name, o))
    who = {p.name: p for p in everyone}
    for e in sorted(by_epoch):
        rows = by_epoch[e]
        began = sorted(o.began for _, o in rows)
        last = max(rows, key=lambda row: row[1].began)[0]  # who stopped last
        ended = sorted(o.ended for _, o in rows)
        grouped = sorted(formed[(n, e)] for n, _ in rows if (n, e) in formed)
        waits = [formed[(n, e)] - o.began for n, o in rows if (n, e) in formed]
        rounds = [o.ended - formed[(n, e)] for n, o in rows if (n, e) in formed]
        med = statistics.median
        line = (
            f"timeline epoch {e}: stopped {began[0]:.1f} / {med(began):.1f} / {began[-1]:.1f} s"
            f" (last {last}: {who[last].rate:.1f} samples/s, joined {who[last].joined:.0f} s)"
        )
        if grouped:
            line += f", grouped {med(grouped):.1f} / {grouped[-1]:.1f} s"
        line += f", ended {med(ended):.1f} / {ended[-1]:.1f} s"
        if waits:
            line += f"; median wait for the group {med(waits):.2f} s, round {med(rounds):.2f} s"
        print(line)


def bytes_by_kind(traffic: Counter[str], wire: int) -> dict[str, int]:
    """What the nodes wrote per protocol (``Node.bytes_sent``), largest first, and
    ``unattributed``: what the network carried beyond that, the secure handshakes (a relayed
    connection's bytes count twice above: once as its own protocols, once as the relay's)."""
    kinds = dict(traffic.most_common())
    kinds["unattributed"] = wire - sum(traffic.values())
    return kinds


def outcome_figures(
    everyone: list[PeerStats],
    initial: list[PeerStats],
    target: int,
    vector_bytes: int,
    *,
    overlap: bool,
) -> dict[str, float | None]:
    """The run's figures from what each peer computed and got back from each round.

    * ``complete_fraction``: epochs whose averaging reached every peer that took part with
      the mean (each of them complete: a group of more than one, nothing missing);
    * ``averaged_fraction``: peer-epochs whose step averaged with at least one other peer;
    * ``compute_fraction``: per peer, time computing toward epochs whose step averaged over
      its time in the run, mean over peers (the epoch the run's end or the peer's leaving cut
      off counts on neither side; ``raw_compute_fraction`` counts all computing);
    * ``compute_ceiling``: the compute fraction when every round takes the LP's bound (the
      most any run can reach on these links);
    * ``bandwidth_error``: median relative error of the links the LP got against the true ones;
    * ``epoch_time_ratio``: mean epoch time over an ideal of computing the target at the
      summed throughput plus the averaging time that is not hidden (all of the LP bound when
      blocking; what exceeds the epoch's computing with overlap).
    """
    trainers = [p for p in everyone if p.left is not None and p.left > p.joined]
    raw = [p.compute / (p.left - p.joined) for p in trainers]
    useful = [
        sum(o.compute for o in p.epochs if o.group_size > 1)
        / (p.left - p.joined - p.cut_off - p.in_round)
        for p in trainers
    ]
    useful_s = [sum(o.compute for o in p.epochs if o.group_size > 1) for p in trainers]
    spans = [p.left - p.joined - p.cut_off - p.in_round for p in trainers]
    outcomes = [o for p in everyone for o in p.epochs]
    by_epoch: dict[int, list[EpochOutcome]] = {}
    for o in outcomes:
        by_epoch.setdefault(o.epoch, []).append(o)
    complete = [all(o.complete and o.group_size > 1 for o in os) for os in by_epoch.values()]
    averaged = [o.group_size > 1 for o in outcomes]
    errors = [
        abs(measured / true - 1.0)
        for p in everyone
        if p.links is not None
        for measured, true in zip(p.links, (p.up, p.down), strict=True)
    ]
    # An epoch ends when its peers' rounds end: the median, which one straggler (a round
    # that timed out, a newcomer) cannot move.
    per_epoch = {e: statistics.median(o.ended for o in os) for e, os in by_epoch.items()}
    times = [per_epoch[e] for e in sorted(per_epoch)]
    epoch_times = [b - a for a, b in zip(times, times[1:], strict=False)]
    total_rate = sum(p.rate for p in initial)
    # The LP bound in real units: the scaled links carry the scaled vector in the same time.
    members = [Member(p.name, p.mode, p.up, p.down, 1.0) for p in initial]
    lp_bound = solve_shares(members).lower_bound(vector_bytes)
    computing = target / total_rate
    ideal = computing + (max(0.0, lp_bound - computing) if overlap else lp_bound)
    # The most of its time a peer can compute when every round takes the LP's bound: blocking
    # stops computing for all of it; with overlap only what exceeds an epoch's computing.
    ceiling = (
        computing / (computing + lp_bound) if not overlap else computing / max(computing, lp_bound)
    )
    mean_epoch = statistics.mean(epoch_times) if epoch_times else float("nan")
    contributed: dict[int, int] = {}
    for o in outcomes:
        contributed[o.epoch] = contributed.get(o.epoch, 0) + o.samples
    ends = [o.ended for o in outcomes]

    def share(flags: list[bool]) -> float | None:
        return round(sum(flags) / len(flags), 4) if flags else None

    return {
        "complete_fraction": share(complete),
        "averaged_fraction": share(averaged),
        "compute_fraction": round(statistics.mean(useful), 4) if useful else None,
        "compute_ceiling": round(ceiling, 4),
        "min_compute_fraction": round(min(useful), 4) if useful else None,
        # the same over all peers' time together: a peer that left before its first round
        # ended (common when rounds take an hour, as DiLoCo's do) counts a zero above over
        # its seconds of joining, and here only for those seconds
        "weighted_compute_fraction": round(sum(useful_s) / sum(spans), 4) if useful_s else None,
        "raw_compute_fraction": round(statistics.mean(raw), 4) if raw else None,
        "bandwidth_error": round(statistics.median(errors), 4) if errors else None,
        "epoch_time_ratio": round(mean_epoch / ideal, 4),
        # samples averaged per epoch / target (> 1: computed past the target), over all but
        # the last epoch, whose rounds the end of the run cuts off
        "samples_per_target": round(
            statistics.mean(n for e, n in contributed.items() if e < max(contributed)) / target,
            4,
        )
        if len(contributed) > 1
        else None,
        "epoch_seconds": round(mean_epoch, 3),
        "ideal_epoch_seconds": round(ideal, 3),
        "lp_bound_seconds": round(lp_bound, 3),
        "epochs": len(per_epoch),
        "rounds": len(by_epoch),
        "churned": len(everyone) - len(initial),
        "virtual_seconds": round(max(ends), 1) if ends else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=40)
    parser.add_argument("--params", type=int, default=18_000_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--target", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=4, help="samples per micro-batch")
    parser.add_argument("--churn-per-hour", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--payload-scale",
        type=int,
        default=PAYLOAD_SCALE,
        help="average params/S values over links S times slower (same transfer times)",
    )
    parser.add_argument(
        "--mode",
        choices=("overlap", "blocking", "both", "diloco"),
        default="overlap",
        help="delayed parameter update (default), peers that stop to average, or both; "
        "diloco: DeDLOC (overlap) against DiLoCo's traffic",
    )
    parser.add_argument(
        "--inner-steps",
        type=int,
        default=500,
        help="diloco: target batches between outer steps (DiLoCo's H)",
    )
    parser.add_argument(
        "--dedloc-epochs",
        type=int,
        default=None,
        help="diloco: epochs of the DeDLOC run it is compared with (default: --epochs)",
    )
    parser.add_argument(
        "--compression",
        choices=(*COMPRESSIONS, "topk", "powersgd"),
        default=None,
        help="what the averaged vectors travel in (adaptive: sahajBERT-shaped leaves, 1-D and "
        "small ones fp16, matrices int8; topk: diloco only, sparse 2-bit payloads all-gathered); "
        "unset: fp16, and int8 for diloco's DiLoCo run (its DeDLOC run stays fp16)",
    )
    parser.add_argument("--topk-density", type=float, default=1 / 64, help="diloco, topk")
    parser.add_argument("--powersgd-rank", type=int, default=4, help="powersgd: the rank")
    parser.add_argument(
        "--no-defences",
        action="store_true",
        help="without an open run's defences (CenteredClip, verified rounds), on by default",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="print when peers stopped to average, grouped and ended, per epoch",
    )
    parser.add_argument(
        "--mid-step",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="blocking peers average mid-micro-step when the target lands, as "
        "dedloc_jax.collaborative does (its default poll, announced; on by default)",
    )
    parser.add_argument(
        "--match-early",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="begin matchmaking ahead of the target (RoundConfig.match_early; off by default)",
    )
    parser.add_argument(
        "--log-level",
        default="ERROR",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the stack's logging (WARNING shows every round's audit findings)",
    )
    args = parser.parse_args()
    if args.payload_scale < 1:
        parser.error("--payload-scale must be at least 1")
    logging.basicConfig(level=args.log_level)
    for handler in logging.getLogger().handlers:  # (--timeline reads INFO lines, not shown)
        handler.setLevel(args.log_level)
    print(
        f"{args.peers} peers ({sum(i % 4 == 3 for i in range(args.peers))} clients), "
        f"{args.params:,} params simulated as {max(1, args.params // args.payload_scale):,} "
        f"over links {args.payload_scale}x slower, target {args.target}"
    )
    if args.mode == "diloco":
        if args.inner_steps < 1:
            parser.error("--inner-steps must be at least 1")
        _compare_diloco(args)
        return
    modes = ["overlap", "blocking"] if args.mode == "both" else [args.mode]
    codec: str | PowerSGD = args.compression or "fp16"
    if codec == "powersgd":  # the factors and the 1-D leaves in fp16
        codec = PowerSGD(rank=args.powersgd_rank)
    results = {m: simulate(args, overlap=m == "overlap", codec=codec) for m in modes}
    out: dict[str, object] = dict(results[modes[0]])
    out.update(
        mode=modes[0],
        peers=args.peers,
        simulated_params=args.params,
        actual_params=max(1, args.params // args.payload_scale),
        payload_scale=args.payload_scale,
    )
    if len(modes) == 2:
        out["blocking"] = results["blocking"]
    print(json.dumps(out))


def _compare_diloco(args: argparse.Namespace) -> None:
    """DeDLOC mode, then DiLoCo mode on the same peers, links and churn; the last line (JSON)
    holds both runs' figures and the bytes ratio."""
    # DeDLOC's epochs are short: with --dedloc-epochs its run lasts long enough that joining
    # (bootstrap, link probes) does not dominate its bytes, as it does not DiLoCo's long run.
    dedloc_epochs = args.dedloc_epochs or args.epochs
    dedloc = simulate(argparse.Namespace(**{**vars(args), "epochs": dedloc_epochs}), overlap=True)
    outer_target = args.target * args.inner_steps
    codec: str | TopK = args.compression or "int8"
    if args.compression == "topk":
        codec = TopK(density=args.topk_density)
    print(f"--- diloco: an outer step every {outer_target} samples, {codec} pseudo-gradients")
    diloco = simulate(args, overlap=False, target=outer_target, codec=codec)
    ratio = None
    if dedloc["bytes_per_sample"] and diloco["bytes_per_sample"]:
        ratio = round(dedloc["bytes_per_sample"] / diloco["bytes_per_sample"], 1)
    print(f"bytes per sample: DeDLOC {dedloc['bytes_per_sample']}, DiLoCo "
          f"{diloco['bytes_per_sample']}: {ratio}x less")  # fmt: skip
    # The headline counts only samples of rounds that completed with every expected member.
    complete_ratio = None
    if dedloc["bytes_per_complete_sample"] and diloco["bytes_per_complete_sample"]:
        complete_ratio = round(
            dedloc["bytes_per_complete_sample"] / diloco["bytes_per_complete_sample"], 1
        )
    print(f"bytes per sample of complete rounds: DeDLOC {dedloc['bytes_per_complete_sample']}, "
          f"DiLoCo {diloco['bytes_per_complete_sample']}: {complete_ratio}x less")  # fmt: skip
    out: dict[str, object] = dict(diloco)
    out.update(
        mode="diloco",
        inner_steps=args.inner_steps,
        outer_target=outer_target,
        peers=args.peers,
        simulated_params=args.params,
        actual_params=max(1, args.params // args.payload_scale),
        payload_scale=args.payload_scale,
        dedloc=dedloc,
        dedloc_epochs=dedloc_epochs,
        bytes_ratio=ratio,
        complete_bytes_ratio=complete_ratio,
    )
    print(json.dumps(out))


def _complete_samples(everyone: list[PeerStats]) -> int:
    """Samples contributed to epochs whose round completed for every peer in it (as
    ``complete_fraction`` counts them)."""
    by_epoch: dict[int, list[EpochOutcome]] = {}
    for o in (o for p in everyone for o in p.epochs):
        by_epoch.setdefault(o.epoch, []).append(o)
    return sum(
        sum(o.samples for o in os)
        for os in by_epoch.values()
        if all(o.complete and o.group_size > 1 for o in os)
    )


async def _started(start, stats: PeerStats, index: int, *, task_status=trio.TASK_STATUS_IGNORED):
    """Start the first peer and report once its address is known (others bootstrap from it)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(start, stats, index)
        await stats.started.wait()
        task_status.started()


if __name__ == "__main__":
    main()
