"""``diloco(..., compression=TopK(...))``: SparseLoCo-style sparse, low-bit pseudo-gradients.

In-process peers (``tests.dedloc_jax.lockstep``) exchange the packed payloads as bytes, check
them with :func:`dedloc_jax.topk.unpack` and sum them with :func:`dedloc_jax.topk.mean_of`,
as a :class:`dedloc_jax.Collaboration` does; a single-process NumPy replay of the compression
(error feedback included) must give the same bits.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest

from dedloc_jax import TopK, diloco
from dedloc_jax.host import AveragingOutcome
from dedloc_jax.state.training import share_state, sync_state
from dedloc_jax.topk import (
    Payload,
    PayloadError,
    decode,
    encode,
    encode_jax,
    mean_of,
    pack,
    unpack,
)
from tests.dedloc_jax.lockstep import LockstepGroup, LockstepPeer
from tests.dedloc_jax.test_diloco import (
    MICRO,
    _data,
    _loss,
    _params,
    _run_peers,
    _step_fn,
    _train_peer,
)

# 5 + 1 parameters in chunks of 4: two chunks, one value sent from each (the last is short)
CFG = TopK(density=0.25, bits=2, error_feedback=0.95, chunk=4)
N = 6


class SparsePeer(LockstepPeer):
    """Swaps packed payloads through the lockstep group; every peer unpacks all of them and
    sums them in peer order."""

    def __init__(self, group: LockstepGroup, index: int) -> None:
        super().__init__(group, index)
        self.sent: list[bytes] = []

    def average_gradients(self, epoch, gradients, samples, *, codec=None) -> AveragingOutcome:
        assert codec == CFG
        assert int(gradients[3]) == N  # the dense size travels with the payload
        data = pack(CFG, Payload(*gradients[:3]), N)
        self.sent.append(data)
        g = self.group
        g._contrib[self.index] = (data, samples)
        g._barrier.wait()
        contrib = list(g._contrib)
        g._barrier.wait()
        payloads = [unpack(CFG, d, N) for d, _ in contrib]
        mean = mean_of(CFG, payloads, [w for _, w in contrib], N)
        return AveragingOutcome([mean], epoch + 1, g.size)


def _train(per_peer: list[int], epochs: int, *, jit: bool):
    k, target = len(per_peer), sum(per_peer)
    group = LockstepGroup(k, target_batch_size=target)
    x, y = _data(target * epochs)
    history: list[list[dict]] = [[] for _ in range(k)]
    fed: list[list[list]] = [[[] for _ in range(epochs)] for _ in range(k)]
    final: list = [None] * k
    peers = [SparsePeer(group, i) for i in range(k)]

    def run(i: int) -> None:
        tx = diloco(optax.sgd(0.05), peers[i], target_batch_size=target, compression=CFG)
        final[i] = _train_peer(tx, jit, per_peer, i, (x, y), fed[i], history[i])

    _run_peers([lambda i=i: run(i) for i in range(k)], group)
    return history, fed, final, peers


def _flat(tree: dict) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(v, np.float32)) for v in jax.tree.leaves(tree)])


def _replay(fed: list[list[list]], outer: optax.GradientTransformation):
    """One process, NumPy compression: each peer's pseudo-gradient plus its decayed error
    feedback, top-k and 2 bits per chunk, the sample-weighted mean of the decoded payloads
    summed in peer order, then the outer step."""
    inner = optax.sgd(0.05)
    outer_params = _params()
    outer_state = outer.init(outer_params)
    feedback = [np.zeros(N, np.float32) for _ in fed]
    history, sent = [], []
    treedef = jax.tree.structure(outer_params)
    shapes = [np.shape(v) for v in jax.tree.leaves(outer_params)]
    for e in range(len(fed[0])):
        decoded, weights, packed = [], [], []
        for i in range(len(fed)):
            local, st = outer_params, inner.init(outer_params)
            for xb, yb in fed[i][e]:
                updates, st = inner.update(jax.grad(_loss)(local, xb, yb), st, local)
                local = optax.apply_updates(local, updates)
            delta = _flat(outer_params) - _flat(local)
            acc = np.float32(CFG.error_feedback) * feedback[i] + delta
            payload = encode(CFG, acc)
            packed.append(pack(CFG, payload, N))
            decoded.append(decode(CFG, payload, N))
            feedback[i] = acc - decoded[-1]
            weights.append(np.float32(sum(len(xb) for xb, _ in fed[i][e])))
        total = np.float32(sum(weights))
        mean = np.zeros(N, np.float32)
        for d, w in zip(decoded, weights, strict=True):
            mean += (w / total) * d
        cuts = np.cumsum([int(np.prod(s)) for s in shapes])[:-1]
        avg = jax.tree.unflatten(
            treedef, [a.reshape(s) for a, s in zip(np.split(mean, cuts), shapes, strict=True)]
        )
        updates, outer_state = outer.update(avg, outer_state, outer_params)
        outer_params = optax.apply_updates(outer_params, updates)
        history.append(jax.device_get(outer_params))
        sent.append(packed)
    return history, feedback, sent


@pytest.mark.parametrize("jit", [False, True])
def test_topk_diloco_equals_a_single_process_numpy_replay(jit: bool) -> None:
    history, fed, final, peers = _train([12, 4], epochs=3, jit=jit)
    # the default outer step with TopK is SparseLoCo's plain SGD at rate 1 (no momentum)
    want, feedback, sent = _replay(fed, optax.sgd(1.0))
    for i, peer in enumerate(peers):  # the bytes each peer sent, every outer step
        assert peer.sent == [packed[i] for packed in sent]
    for got, ref in zip(history[0], want, strict=True):
        for key in ref:
            assert np.asarray(got[key]).tobytes() == np.asarray(ref[key]).tobytes()
    for state, ef in zip(final, feedback, strict=True):
        assert np.asarray(state.error_feedback).tobytes() == ef.tobytes()
    assert all(np.any(ef != 0) for ef in feedback)  # something was left unsent


def test_two_peers_end_bit_identical_on_the_outer_parameters() -> None:
    history, _, final, _ = _train([8, 8], epochs=2, jit=True)
    for mine, theirs in zip(history[1], history[0], strict=True):
        for key in mine:
            assert mine[key].tobytes() == theirs[key].tobytes()
    a, b = final
    for x, y in zip(jax.tree.leaves(a.outer_state), jax.tree.leaves(b.outer_state), strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    # the error feedback is each peer's own (they trained on different data)
    assert np.asarray(a.error_feedback).tobytes() != np.asarray(b.error_feedback).tobytes()


def test_error_feedback_is_not_served_and_a_newcomer_starts_at_zero() -> None:
    _, _, final, _ = _train([8, 8], epochs=1, jit=True)
    state = final[0]
    assert np.any(np.asarray(state.error_feedback) != 0)

    class Host:
        def share_state(self, arrays, epoch):
            self.got = (arrays, epoch)

    host = Host()
    share_state(host, state.outer_params, state)
    arrays, epoch = host.got
    tx = diloco(optax.sgd(0.05), SparsePeer(LockstepGroup(1, 16), 0), target_batch_size=16,
                compression=CFG)  # fmt: skip
    fresh = tx.init(_params())  # a restart: zero error feedback
    assert np.asarray(fresh.error_feedback).tobytes() == np.zeros(N, np.float32).tobytes()

    class Donor:
        def load_state(self, *, timeout):
            return epoch, arrays

    params, loaded, got_epoch = sync_state(Donor(), _params(), fresh)
    assert got_epoch == 1 and int(loaded.epoch) == 1
    assert np.asarray(loaded.error_feedback).tobytes() == np.zeros(N, np.float32).tobytes()
    assert _flat(params).tobytes() == _flat(state.outer_params).tobytes()


def _honest() -> tuple[Payload, bytes]:
    x = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    cfg = TopK(chunk=256)
    payload = encode(cfg, x)
    return payload, pack(cfg, payload, 1000)


def _forge(payload: Payload, **change) -> bytes:
    return pack(TopK(chunk=256), payload._replace(**change), 1000)


def test_garbage_payloads_are_rejected() -> None:
    cfg = TopK(chunk=256)
    payload, data = _honest()
    unpack(cfg, data, 1000)  # the honest one passes
    bad_scales = payload.scales.copy()
    bad_scales[1, 1] = np.nan
    reversed_scales = payload.scales[:, ::-1].copy()
    repeated = payload.offsets.copy()
    repeated[0, 1] = repeated[0, 0]
    beyond = payload.offsets.copy()
    beyond[-1, -1] = 1000 - 3 * 256  # the last chunk holds 232 values: offset 232 is out
    cases = {
        "bytes": data[:-1],
        "expected": data + b"\0",
        "non-finite": _forge(payload, scales=bad_scales),
        "order": _forge(payload, scales=reversed_scales),
        "ascending": _forge(payload, offsets=repeated),
        "range": _forge(payload, offsets=beyond),
    }
    for reason, bad in cases.items():
        with pytest.raises(PayloadError, match=reason):
            unpack(cfg, bad, 1000)


def test_offsets_travel_elias_fano_coded_in_8_bits_at_sparselocos_density() -> None:
    """At 1/64 of chunks of 4096 an offset costs 8 bits (6 low, 2 of unary high part), not
    12: a payload of a million values is 21,560 bytes (29,400 with 12-bit offsets)."""
    cfg, n = TopK(density=1 / 64), 1_000_000
    payload = encode(cfg, np.random.default_rng(2).normal(size=n).astype(np.float32))
    data = pack(cfg, payload, n)
    assert len(data) == cfg.payload_bytes(n) == 21_560
    back = unpack(cfg, data, n)
    for got, sent in zip(back, payload, strict=True):
        assert np.array_equal(got, sent)


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_a_sent_value_never_exceeds_what_it_stands_for(bits: int) -> None:
    """Each sent value keeps its sign and is at most its magnitude (within rounding), so the
    error feedback never grows, even in a chunk whose selected magnitudes span 50x (the
    middle of the 2-bit bin sent its smallest ones ~12x too large: docs/decisions.md)."""
    cfg = TopK(density=1 / 64, bits=bits)
    rng = np.random.default_rng(bits)
    x = rng.normal(size=3 * 4096 + 100).astype(np.float32)
    x *= np.where(rng.random(x.size) < 0.005, np.float32(50), np.float32(1))  # a few huge
    payload = encode(cfg, x)
    dense = decode(cfg, payload, x.size)
    _, jax_dense = jax.jit(lambda v: encode_jax(cfg, v))(x)
    assert np.array_equal(np.asarray(jax_dense), dense)
    held = np.take_along_axis(_chunked(x, 4096), payload.offsets, axis=1)
    sent = np.take_along_axis(_chunked(dense, 4096), payload.offsets, axis=1)
    assert np.all(np.sign(sent) == np.sign(held))
    assert np.all(np.abs(sent) <= np.abs(held) * np.float32(1 + 1e-6))
    assert np.all(np.abs(x - dense) <= np.abs(x) * np.float32(1 + 1e-6))  # e never grows


def _chunked(x: np.ndarray, size: int) -> np.ndarray:
    return np.concatenate([x, np.zeros(-x.size % size, np.float32)]).reshape(-1, size)


@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_any_ascending_offsets_round_trip(k: int) -> None:
    """Edges included: the first and last offset of a chunk, neighbours, one per chunk."""
    cfg = TopK(density=k / 16, chunk=16)
    rng = np.random.default_rng(k)
    for _ in range(50):
        offsets = np.sort(np.stack([rng.choice(16, k, replace=False) for _ in range(3)]))
        if k > 1:
            offsets[0, :2] = [0, 1]
            offsets[1, -2:] = [14, 15]
        codes = rng.integers(0, 4, size=(3, k)).astype(np.uint8)
        scales = np.tile(np.float32([0.5, 1.0]), (3, 1))
        payload = Payload(offsets.astype(np.int32), codes, scales)
        back = unpack(cfg, pack(cfg, payload, 48), 48)
        assert np.array_equal(back.offsets, payload.offsets)
        assert np.array_equal(back.codes, codes)


def test_a_chunk_whose_high_parts_do_not_count_k_is_rejected() -> None:
    cfg = TopK(chunk=256)
    _, data = _honest()
    chunks, size, k = cfg.layout(1000)
    low = 6  # log2(256 / 4); each chunk's row of high parts: 4 + 256 / 2**6 = 8 bits
    at = 8 * chunks + chunks * k * low // 8  # the first high-part byte: chunk 0's row
    forged = bytearray(data)
    forged[at] = 0xFF  # eight ones in chunk 0's row: more than its k = 4
    with pytest.raises(PayloadError, match="k offsets"):
        unpack(cfg, bytes(forged), 1000)


def test_one_peer_cannot_blow_up_the_mean_with_huge_scales() -> None:
    cfg = TopK(chunk=256)
    rng = np.random.default_rng(1)
    honest = [encode(cfg, rng.normal(size=1000).astype(np.float32)) for _ in range(3)]
    liar = honest[0]._replace(scales=honest[0].scales * np.float32(1e6))
    mean = mean_of(cfg, [*honest, liar], [1.0] * 4, 1000)
    his = np.stack([p.scales[:, 1] for p in honest])
    assert np.abs(mean).max() <= 4 * his.max()


def test_an_outlying_payload_counts_for_nothing_only_where_robust_and_far() -> None:
    """With ``outliers`` (open runs) a payload chunk far outside the others' (here a -1000 x
    flip of one of four) weighs nothing in that chunk: the mean is the other three's. Without
    it (private runs), or with nothing that far, the mean is the same bits as before the rule:
    the capped weighted mean."""
    cfg = TopK(chunk=256)
    rng = np.random.default_rng(2)
    honest = [encode(cfg, rng.normal(size=1000).astype(np.float32)) for _ in range(3)]
    weights = [3.0, 2.0, 4.0]
    sign = np.uint8(1 << (cfg.bits - 1))
    flipped = honest[0]._replace(
        codes=honest[0].codes ^ sign, scales=honest[0].scales * np.float32(1000)
    )
    got = mean_of(cfg, [*honest, flipped], [*weights, 3.0], 1000, outliers=True)
    want = mean_of(cfg, honest, weights, 1000)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    capped = mean_of(cfg, [*honest, flipped], [*weights, 3.0], 1000)
    assert np.abs(capped - want).max() > 0.5  # capped only: the flip pulls every value it holds
    # nothing far: the rule changes no bit
    fourth = encode(cfg, rng.normal(size=1000).astype(np.float32))
    both = [mean_of(cfg, [*honest, fourth], [*weights, 1.0], 1000, outliers=o) for o in (0, 1)]
    assert both[0].tobytes() == both[1].tobytes()


def test_a_sender_that_signs_two_payloads_for_one_round_is_excluded(caplog) -> None:
    import trio

    from dedloc_jax.averaging import GroupSpec, Member
    from dedloc_jax.rounds.gather import SparseGather, _Gather, _signed
    from p2p.identity import Identity

    cfg = TopK(chunk=256)
    liar, other = Identity.from_seed(b"liar"), Identity.from_seed(b"other")
    spec = GroupSpec(
        (Member(str(liar.peer_id), "node", 1e6, 1e6, 8.0),
         Member(str(other.peer_id), "node", 1e6, 1e6, 8.0))
    )  # fmt: skip
    round_id = spec.digest + b":sparse"

    def entry(seed: int) -> dict:
        x = np.random.default_rng(seed).normal(size=1000).astype(np.float32)
        data = pack(cfg, encode(cfg, x), 1000)
        sig = liar.sign(_signed(round_id, 8.0, data))
        return {"p": str(liar.peer_id), "k": liar.public_key, "s": sig, "d": data, "w": 8.0}

    async def main() -> _Gather:
        gather = SparseGather(node=SimpleNamespace(peer_id=Identity.from_seed(b"me").peer_id))
        g = _Gather(spec, cfg, 1000, frozenset({str(liar.peer_id), str(other.peer_id)}))
        gather._accept(g, round_id, entry(0))
        assert str(liar.peer_id) in g.held
        gather._accept(g, round_id, entry(0))  # the same entry again: no harm
        assert str(liar.peer_id) in g.held
        gather._accept(g, round_id, entry(1))  # another payload, validly signed
        gather._accept(g, round_id, entry(0))  # and never again counted
        return g

    with caplog.at_level(logging.WARNING, logger="dedloc_jax.rounds.gather"):
        g = trio.run(main)
    assert str(liar.peer_id) not in g.held and g.excluded == {str(liar.peer_id)}
    assert any("signed two different payloads" in r.getMessage() for r in caplog.records)


class SparseOverlapPeer(SparsePeer):
    """Averages in the background; the outcome shows two polls after the start."""

    def start_averaging(self, epoch, gradients, samples, *, codec=None) -> None:
        self._job = [2, self.average_gradients(epoch, gradients, samples, codec=codec)]

    def poll_averaging(self) -> AveragingOutcome | None:
        if self._job[0] > 0:
            self._job[0] -= 1
            return None
        outcome, self._job = self._job[1], None
        return outcome


def test_overlap_sends_the_payload_and_lands_one_outer_step_on_both_peers() -> None:
    group = LockstepGroup(2, target_batch_size=16)
    x, y = _data(64)
    results: list = [None, None]

    def run(i: int) -> None:
        peer = SparseOverlapPeer(group, i)
        tx = diloco(optax.sgd(0.05), peer, target_batch_size=16, overlap=True, compression=CFG)
        step = _step_fn(tx, jit=True)
        params, state = _params(), tx.init(_params())
        for s in range(0, 32, MICRO):
            lo = i * 32 + s
            params, state = step(params, state, x[lo : lo + MICRO], y[lo : lo + MICRO])
        results[i] = (state, peer.sent)

    _run_peers([lambda i=i: run(i) for i in range(2)], group)
    (a, sent_a), (b, sent_b) = results
    # one outer step landed, the second averaging is in flight at the end
    assert int(a.epoch) == int(b.epoch) == 1 and len(sent_a) == len(sent_b) == 2
    for u, v in zip(jax.tree.leaves(a.outer_params), jax.tree.leaves(b.outer_params), strict=True):
        assert np.asarray(u).tobytes() == np.asarray(v).tobytes()
    assert np.any(np.asarray(a.outer_params["w"]) != 0)  # the outer step moved them
    # the error feedback was updated when the payload left, and is each peer's own
    assert np.asarray(a.error_feedback).tobytes() != np.asarray(b.error_feedback).tobytes()


def test_a_request_naming_one_sender_many_times_gets_its_payload_once() -> None:
    import trio

    from dedloc_jax.averaging import GroupSpec, Member
    from dedloc_jax.rounds.gather import SparseGather, _Gather, _signed
    from p2p.identity import Identity

    cfg = TopK(chunk=256)
    ident = Identity.from_seed(b"sender")
    spec = GroupSpec((Member(str(ident.peer_id), "node", 1e6, 1e6, 8.0),))
    round_id = spec.digest + b":sparse"
    data = pack(cfg, encode(cfg, np.ones(1000, np.float32)), 1000)
    entry = {"p": str(ident.peer_id), "k": ident.public_key, "d": data, "w": 8.0}
    entry["s"] = ident.sign(_signed(round_id, 8.0, data))

    async def main() -> dict:
        gather = SparseGather(node=SimpleNamespace(peer_id=Identity.from_seed(b"me").peer_id))
        g = _Gather(spec, cfg, 1000, frozenset({str(ident.peer_id)}))
        gather._accept(g, round_id, entry)
        gather._rounds[round_id] = g
        gather._opened_event(round_id).set()
        asker = SimpleNamespace(remote_peer="asker")
        return await gather._handle(asker, {"r": round_id, "w": [str(ident.peer_id)] * 1000})

    answer = trio.run(main)
    assert len(answer["e"]) == 1  # not 1000 copies of the payload
