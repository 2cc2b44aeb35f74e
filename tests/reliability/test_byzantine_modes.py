"""One hostile peer among four in every mode and wire codec (simulator, virtual time).

The defences of an open run (verified rounds, CenteredClip with a derived radius) hold
whatever crosses the wire: a lying reducer (it claims the largest link, so the LP gives it a
share, and returns -1000 x the aggregate of its share) is banned within two rounds with the
int8, fp16, bf16 and adaptive codecs, in either phase of a PowerSGD round, and in DiLoCo's
outer rounds (the library's transform, int8); a sender of -1000 x its update counts for
nothing in PowerSGD's phases and in DiLoCo's outer rounds. TopK's all-gather has no reducers:
a hostile payload is rejected (malformed) or bounded (huge, flipped), and the honest peers
keep one lineage.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
import optax
import pytest
import trio

from dedloc_jax import PowerSGD, TopK
from dedloc_jax.averaging.reducer import Reducer
from dedloc_jax.config import CollaborationConfig
from dedloc_jax.diloco import diloco
from dedloc_jax.powersgd import initial_q, reference_round
from dedloc_jax.topk import Payload, pack, unpack
from dedloc_jax.validators import MAX_BPS
from p2p.testing import SimNetwork, run_sim
from tests.dedloc_jax.simcollab import open_sim_collaboration
from tests.dedloc_jax.test_diloco_sim import CONFIG, MICRO, TARGET, Peer, _assert_one_lineage
from tests.dedloc_jax.test_diloco_topk_sim import TopKPeer

PEERS, LIAR = 4, 3
HONEST = [i for i in range(PEERS) if i != LIAR]


@pytest.fixture
def liars(monkeypatch):
    """``liars[peer_id] = phases``: that peer's reducers return -1000 x their aggregate in
    the all-reduces whose round ID is the group's digest ("P", also every DeDLOC round) or
    another one ("Q": PowerSGD's second phase)."""
    who: dict[str, set[str]] = {}
    original = Reducer._aggregate

    def lying(self, k, avg):
        original(self, k, avg)
        phases = who.get(self.plan.name(self.plan.me), set())
        if ("P" if self.plan.round_id == self.plan.spec.digest else "Q") in phases:
            avg *= np.float32(-1000.0)

    monkeypatch.setattr(Reducer, "_aggregate", lying)
    return who


def _claim_a_huge_link(core: Any) -> None:
    """The largest link the schema takes: the LP gives the peer a share to reduce."""
    core.meter.upload_override = core.meter.download_override = MAX_BPS


async def _wait_for_target(core: Any, epoch: int, pace: float = 0.1) -> int:
    samples = 0
    while True:
        await trio.sleep(pace)
        samples += 8
        if core.report(epoch, samples, 8):
            return samples


def _first_ban(banned: list[list[bool]]) -> int | None:
    """The first round (0-based) after which every honest peer had banned the liar."""
    rounds = range(len(banned[HONEST[0]]))
    return min((e for e in rounds if all(banned[i][e] for i in HONEST)), default=None)


# --- DeDLOC, every codec ---------------------------------------------------------------------
@pytest.mark.parametrize("codec", ["int8", "fp16", "bf16", "adaptive"])
def test_a_lying_reducer_is_banned_with_every_codec(liars, codec: str) -> None:
    dim = 600
    base = CollaborationConfig.local_demo(PEERS * 8)
    config = base.replace(rounds=base.rounds.replace(codec=codec))
    assert config.robust_on and config.verify_on  # an open run
    rng = np.random.default_rng(1)
    truth = rng.standard_normal(dim).astype(np.float32)
    sent = [
        [truth + 0.01 * rng.standard_normal(dim).astype(np.float32) for _ in range(PEERS)]
        for _ in range(3)
    ]
    got: list[list[np.ndarray]] = [[] for _ in range(PEERS)]
    sizes: list[list[int]] = [[] for _ in range(PEERS)]
    banned: list[list[bool]] = [[] for _ in range(PEERS)]

    async def main() -> None:
        async with open_sim_collaboration(
            SimNetwork(seed=5), PEERS, config=config, latency=0.01
        ) as cores:
            liar = str(cores[LIAR].node.peer_id)
            liars[liar] = {"P"}
            _claim_a_huge_link(cores[LIAR])

            async def peer(i: int) -> None:
                for epoch in range(3):
                    samples = await _wait_for_target(cores[i], epoch)
                    out = await cores[i].average(epoch, [sent[epoch][i]], samples)
                    got[i].append(np.asarray(out.average[0]))
                    sizes[i].append(out.group_size)
                    banned[i].append(cores[i].bans.is_banned(liar))

            async with trio.open_nursery() as nursery:
                for i in range(PEERS):
                    nursery.start_soon(peer, i)

    run_sim(main, seed=5)
    first = _first_ban(banned)
    assert first is not None and first <= 1, banned  # within two rounds
    for e in range(3):
        mine = got[HONEST[0]][e]
        assert all(got[i][e].tobytes() == mine.tobytes() for i in HONEST)  # in step
        assert np.isfinite(mine).all()
        # the poison (-1000 x, about 1000 per value) reached nobody: within the codec's
        # rounding of the group's aggregate
        want = np.mean([sent[e][i] for i in range(PEERS)], axis=0)
        assert np.abs(mine - want).max() < 0.05 * np.abs(want).max(), e
        if e > first:
            assert all(sizes[i][e] == 3 for i in HONEST)  # the liar is out


# --- PowerSGD, both phases -------------------------------------------------------------------
SHAPES = [(16, 12), (12,), (6, 5, 4)]
LOW_RANK = PowerSGD(rank=2, seed=4, codec="none")


def _powersgd_rounds(epochs: int, setup: Any, scale: float = 1.0) -> tuple[list, list]:
    """``epochs`` PowerSGD rounds of four peers with the open-run defences; peer LIAR's
    ``M`` is multiplied by ``scale``; ``setup(cores)`` runs first. Per epoch: (peer, M sent,
    samples, outcome, liar banned by it)."""
    rng = np.random.default_rng(0)
    common = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    grads = [
        [[c + 0.2 * rng.normal(size=c.shape).astype(np.float32) for c in common] for _ in "abcd"]
        for _ in range(epochs)
    ]
    plan = LOW_RANK.plan(SHAPES)
    got: list[list] = [[] for _ in range(epochs)]

    async def main() -> None:
        async with open_sim_collaboration(
            SimNetwork(seed=11), PEERS, config=CONFIG, latency=0.01
        ) as cores:
            assert cores[0].config.robust_on and cores[0].config.verify_on
            liar = setup(cores)

            async def peer(i: int) -> None:
                q = initial_q(LOW_RANK, SHAPES)
                errors = [np.zeros(SHAPES[j], np.float32) for j in plan.compressed]
                for epoch in range(epochs):
                    samples = await _wait_for_target(cores[i], epoch, pace=0.05)
                    ms = [g * np.float32(scale if i == LIAR else 1.0) for g in grads[epoch][i]]
                    for k, j in enumerate(plan.compressed):
                        ms[j] = ms[j] + errors[k]
                    out = await cores[i].average(
                        epoch, [*ms, *q, np.int32(len(ms))], samples, codec=LOW_RANK
                    )
                    banned = liar is not None and cores[i].bans.is_banned(liar)
                    got[epoch].append((i, [m.copy() for m in ms], samples, out, banned))
                    n, c = len(SHAPES), len(q)
                    q, errors = list(out.average[n : n + c]), list(out.average[n + c :])

            async with trio.open_nursery() as nursery:
                for i in range(PEERS):
                    nursery.start_soon(peer, i)

    run_sim(main, seed=11, timeout=600.0)
    return grads, [sorted(rows, key=lambda r: r[0]) for rows in got]


def _assert_honest_in_step_and_finite(rows: list) -> list[np.ndarray]:
    honest = [r for r in rows if r[0] != LIAR]
    first = [np.asarray(a) for a in honest[0][3].average[: len(SHAPES)]]
    for r in honest[1:]:
        for a, b in zip(r[3].average[: len(SHAPES)], first, strict=True):
            assert np.asarray(a).tobytes() == b.tobytes()
    assert all(np.isfinite(a).all() for a in first)
    return first


@pytest.mark.parametrize("phases", [{"P"}, {"Q"}, {"P", "Q"}])
def test_a_lying_reducer_in_either_powersgd_phase_is_banned_within_two_rounds(
    liars, phases: set[str]
) -> None:
    def setup(cores: list) -> str:
        liar = str(cores[LIAR].node.peer_id)
        liars[liar] = phases
        _claim_a_huge_link(cores[LIAR])
        return liar

    grads, got = _powersgd_rounds(3, setup)
    banned = [[False] * 3 for _ in range(PEERS)]
    for e, rows in enumerate(got):
        for i, _, _, _, b in rows:
            banned[i][e] = b
    first = _first_ban(banned)
    assert first is not None and first <= 1, banned
    bound = max(float(np.abs(g).max()) for gs in grads for row in gs for g in row)
    for e, rows in enumerate(got):
        mean = _assert_honest_in_step_and_finite(rows)
        # a low-rank mean of honest gradients: never the -1000 x poison
        assert max(float(np.abs(a).max()) for a in mean) < 3 * bound, e
        if e > first:
            assert all(r[3].group_size == 3 and r[3].complete for r in rows if r[0] != LIAR)


def test_a_sign_flipping_sender_counts_for_nothing_in_both_powersgd_phases() -> None:
    """The flipper sends -1000 x its ``M``: its ``P`` and ``Q`` parts are each far outside
    the derived radius and weigh nothing, so every round is the reference round of the three
    honest peers (their weights, error feedback and ``Q``), to float32 rounding."""
    grads, got = _powersgd_rounds(3, lambda cores: None, scale=-1000.0)
    plan = LOW_RANK.plan(SHAPES)
    q_ref = [a.astype(np.float64) for a in initial_q(LOW_RANK, SHAPES)]
    errors_ref = [[np.zeros(SHAPES[j]) for j in plan.compressed] for _ in HONEST]
    for e, rows in enumerate(got):
        mean = _assert_honest_in_step_and_finite(rows)
        honest = [r for r in rows if r[0] != LIAR]
        weights = [r[2] for r in honest]
        want, errors_ref, q_ref = reference_round(
            LOW_RANK, [grads[e][i] for i in HONEST], errors_ref, q_ref, weights
        )
        for a, b in zip(mean, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
        assert all(r[3].group_size == 4 for r in honest)


# --- DiLoCo's outer rounds (the library's transform, int8) ----------------------------------
class _Logged(Peer):
    """A DiLoCo peer whose rounds are logged: (epoch, pseudo-gradient sent, samples, mean)
    and whether it had banned ``liar`` after the round; ``scale`` multiplies what it sends."""

    def __init__(self, core: Any, seed: int, log: list, scale: float = 1.0) -> None:
        super().__init__(core, seed)
        self.log, self.scale, self.liar = log, scale, ""
        average = core.average

        async def logged(epoch: int, arrays: list, samples: int, *, codec: Any = None) -> Any:
            arrays = [np.asarray(a) * np.float32(self.scale) for a in arrays]
            out = await average(epoch, arrays, samples, codec=codec)
            banned = bool(self.liar) and core.bans.is_banned(self.liar)
            self.log.append((epoch, arrays, samples, out, banned))
            return out

        self.core = _CoreView(core, logged)


class _CoreView:
    """``core`` with its ``average`` replaced (a peer's own view, nobody else's)."""

    def __init__(self, core: Any, average: Any) -> None:
        self._core, self.average = core, average

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)


def _diloco(outer_steps: int, *, flip: bool, lie: Any = None) -> tuple[list[_Logged], list]:
    logs: list[list] = [[] for _ in range(PEERS)]

    async def main() -> list[_Logged]:
        async with open_sim_collaboration(
            SimNetwork(seed=3), PEERS, config=CONFIG, latency=0.01
        ) as cores:
            assert cores[0].config.robust_on and cores[0].config.verify_on
            peers = [
                _Logged(c, i, logs[i], -1000.0 if flip and i == LIAR else 1.0)
                for i, c in enumerate(cores)
            ]
            if lie is not None:
                liar = str(cores[LIAR].node.peer_id)
                lie[liar] = {"P"}
                _claim_a_huge_link(cores[LIAR])
                for p in peers:
                    p.liar = liar
            async with trio.open_nursery() as nursery:
                for p in peers:
                    nursery.start_soon(p.train, outer_steps, peers)
            return peers

    peers = run_sim(main, seed=0, timeout=900.0)
    return peers, logs


def test_a_lying_reducer_in_diloco_outer_rounds_is_banned_and_honest_peers_keep_one_lineage(
    liars,
) -> None:
    assert TARGET == 16 * MICRO
    peers, logs = _diloco(3, flip=False, lie=liars)
    honest = [peers[i] for i in HONEST]
    _assert_one_lineage(honest, 3)
    for p in honest:
        outer = [np.asarray(x) for x in jax.tree.leaves(p.state.outer_params)]
        assert all(np.isfinite(x).all() and np.abs(x).max() < 10 for x in outer)
    first = [next((k for k, r in enumerate(logs[i]) if r[4]), None) for i in HONEST]
    assert all(f is not None and f <= 1 for f in first), first  # within two outer rounds
    for i in HONEST:
        for _, sent, _, out, _ in logs[i]:
            # the poison (-1000 x the aggregate) reached nobody: within int8's rounding of
            # the pseudo-gradients' scale
            scale = max(float(np.abs(s).max()) for s in sent)
            assert max(float(np.abs(np.asarray(a)).max()) for a in out.average) < 5 * scale


def test_a_sign_flipping_sender_counts_for_nothing_in_diloco_outer_rounds() -> None:
    """The flipper sends -1000 x its pseudo-gradient at every outer step: each round's mean is
    the honest peers' weighted mean, to int8's rounding (with the flipped part in, each value
    would be about -250 x it)."""
    peers, logs = _diloco(3, flip=True)
    _assert_one_lineage([peers[i] for i in HONEST], 3)
    for epoch in range(3):
        rows = [next(r for r in logs[i] if r[0] == epoch) for i in HONEST]
        w = np.array([r[2] for r in rows], np.float64)
        for k in range(len(rows[0][1])):
            want = (
                sum(wi * np.asarray(r[1][k], np.float64) for wi, r in zip(w, rows, strict=True))
                / w.sum()
            )
            got = np.asarray(rows[0][3].average[k], np.float64)
            assert np.abs(got - want).max() <= 0.02 * np.abs(want).max() + 1e-7, (epoch, k)
        assert all(r[3].group_size == 4 for r in rows)


# --- TopK's all-gather (DiLoCo, no reducers) -------------------------------------------------
SPARSE = TopK(density=0.5, bits=2, error_feedback=0.95, chunk=4)  # 7 values: 2 chunks, 2 each


class _SparsePeer(TopKPeer):
    def __init__(self, core: Any, seed: int) -> None:
        Peer.__init__(self, core, seed)
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
        self.tx = diloco(
            optax.adam(0.05), self.host, target_batch_size=TARGET, outer=outer, compression=SPARSE
        )
        self.state = self.tx.init(self.params)


def _duplicate(p: Payload) -> Payload:
    offsets = p.offsets.copy()
    offsets[:, 1] = offsets[:, 0]
    return Payload(offsets, p.codes, p.scales)


def _out_of_range(p: Payload) -> Payload:
    offsets = p.offsets.copy()
    offsets[-1] = [1, 3]  # the last chunk holds 3 values: offset 3 is past its end
    return Payload(offsets, p.codes, p.scales)


def _huge(p: Payload) -> Payload:
    return Payload(p.offsets, p.codes, np.full_like(p.scales, 1e30))  # finite, in order


def _flipped(p: Payload) -> Payload:  # -1000 x what it would have sent
    sign = np.uint8(1 << (SPARSE.bits - 1))
    return Payload(p.offsets, p.codes ^ sign, p.scales * np.float32(1000.0))


def _wrong_indices(p: Payload) -> Payload:  # well formed, not its top values
    return Payload(np.tile(np.arange(2, dtype=np.int32), (len(p.offsets), 1)), p.codes, p.scales)


FORGERIES = {
    "duplicate": _duplicate,
    "out_of_range": _out_of_range,
    "huge": _huge,
    "flipped": _flipped,
    "wrong_indices": _wrong_indices,
}


def _sparse_run(forgery: str | None, *, free_ride: bool = False) -> list[_SparsePeer]:
    """Two outer steps of four TopK peers; peer LIAR signs and sends its payload as
    ``forgery`` rewrites it, or (``free_ride``) its own with a weight of 0."""

    def forge(peers: list[_SparsePeer]) -> None:
        gather = peers[LIAR].core.rounds.gather
        honest = gather.gather

        async def forged(spec, cfg, data, n, weight, **kw):
            if forgery is not None:
                data = pack(cfg, FORGERIES[forgery](unpack(cfg, data, n)), n)
            return await honest(spec, cfg, data, n, 0.0 if free_ride else weight, **kw)

        gather.gather = forged

    async def main() -> list[_SparsePeer]:
        async with open_sim_collaboration(
            SimNetwork(seed=3), PEERS, config=CONFIG, latency=0.01
        ) as cores:
            assert cores[0].config.robust_on  # an open run
            peers = [_SparsePeer(core, seed=i) for i, core in enumerate(cores)]
            forge(peers)
            async with trio.open_nursery() as nursery:
                for p in peers:
                    nursery.start_soon(p.train, 2, peers)
            return peers

    return run_sim(main, seed=0, timeout=600.0)


def _outer(peers: list[_SparsePeer]) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(peers[HONEST[0]].state.outer_params)]


@pytest.mark.parametrize("forgery", ["duplicate", "out_of_range"])
def test_a_malformed_sparse_payload_is_rejected_and_its_signer_excluded(
    forgery: str, caplog
) -> None:
    with caplog.at_level(logging.WARNING, logger="dedloc_jax.rounds.gather"):
        peers = _sparse_run(forgery)
    rejected = [r.getMessage() for r in caplog.records if "payload rejected" in r.getMessage()]
    assert rejected and all("excluded from the round" in m for m in rejected)
    honest = [peers[i] for i in HONEST]
    _assert_one_lineage(honest, 2)
    assert all(np.isfinite(x).all() for x in _outer(peers))
    # the first round: the three honest payloads (an incomplete round makes keep_in_step
    # check the lineage, and a peer that loads the state may miss the next round)
    assert all(p.core.history[0].group_size == 3 for p in honest)


@pytest.mark.parametrize("forgery", ["huge", "flipped"])
def test_a_huge_or_flipped_sparse_payload_counts_for_nothing(forgery: str) -> None:
    """Its chunks lie far outside the others' (OUTLIER derived radii): the honest peers end
    where they end when the same peer sends its payload with a weight of 0. (Capped only, a
    flipped payload pulled every value it held by SCALE_CAP x the others' magnitudes the wrong
    way.)"""
    attacked = _sparse_run(forgery)
    _assert_one_lineage([attacked[i] for i in HONEST], 2)
    reference = _sparse_run(None, free_ride=True)
    for got, want in zip(_outer(attacked), _outer(reference), strict=True):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_well_formed_payload_of_other_indices_is_taken_and_bounded() -> None:
    """Offsets that are not the sender's top values are indistinguishable from an honest
    payload's: taken, with its magnitudes bounded like everyone's (SCALE_CAP)."""
    peers = _sparse_run("wrong_indices")
    _assert_one_lineage([peers[i] for i in HONEST], 2)
    assert all(h.group_size == 4 for i in HONEST for h in peers[i].core.history)
    assert all(np.isfinite(x).all() and np.abs(x).max() < 10 for x in _outer(peers))
