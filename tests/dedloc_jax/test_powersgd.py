"""PowerSGD (:mod:`dedloc_jax.powersgd`): the host's phases against a NumPy reference of the
round, and ``collaborative(compression=PowerSGD(...))`` against a replay of the reference."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dedloc_jax
from dedloc_jax.host import AveragingOutcome
from dedloc_jax.powersgd import PowerSGD, initial_q, orthogonalise, reference_round

SHAPES = [(12, 9), (9,), (3, 2), (4, 5, 6)]  # compressed, 1-D, too small, 3-D (4 x 30)


def _weighted_mean(arrays: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    total = np.float32(sum(weights))
    out = np.zeros_like(np.asarray(arrays[0], np.float32))
    for a, w in zip(arrays, weights, strict=True):
        out += np.asarray(a, np.float32) * np.float32(w)
    return out / total


def _simulated_round(cfg, plan, ms, qs, weights):
    """The host's two phases for several peers, averaging exactly in between."""
    c = len(plan.compressed)
    sent_p = [plan.phase_p(m, qs) for m in ms]
    mean_p = [_weighted_mean([s[j] for s in sent_p], weights) for j in range(len(sent_p[0]))]
    phases = [plan.phase_q(m, mean_p[:c]) for m in ms]
    mean_q = [_weighted_mean([ph[1][j] for ph in phases], weights) for j in range(c)]
    finished = [plan.finish(m, ph[0], mean_q, mean_p[c:]) for m, ph in zip(ms, phases, strict=True)]
    return finished, mean_q


def test_plan_compresses_matrices_that_gain_only() -> None:
    plan = PowerSGD(rank=2).plan(SHAPES)
    assert plan.compressed == (0, 3)  # (3, 2): 2 x (3 + 2) = 10 >= 6 values: sent whole
    assert plan.plain == (1, 2)
    assert plan.q_shapes() == [(9, 2), (30, 2)]
    assert plan.phase_p_shapes() == [(12, 2), (4, 2), (9,), (3, 2)]
    assert plan.values_sent() == 24 + 8 + 9 + 6 + 18 + 60
    assert PowerSGD(rank=4).plan([(4, 4)]).compressed == ()  # 4 x 8 >= 16


def test_orthogonalise_gives_orthonormal_columns_like_qr() -> None:
    p = np.random.default_rng(1).normal(size=(50, 4)).astype(np.float32)
    got = orthogonalise(p)
    np.testing.assert_allclose(got.T @ got, np.eye(4), atol=1e-5)
    q, r = np.linalg.qr(p.astype(np.float64))
    np.testing.assert_allclose(got, q * np.sign(np.diag(r)), atol=1e-5)
    assert not orthogonalise(np.zeros((5, 2), np.float32)).any()  # zero stays zero


@pytest.mark.parametrize("peers", [1, 3])
def test_host_phases_match_the_reference_with_error_feedback(peers: int) -> None:
    cfg = PowerSGD(rank=2, seed=3)
    plan = cfg.plan(SHAPES)
    rng = np.random.default_rng(0)
    weights = [float(w) for w in rng.integers(1, 9, size=peers)]
    q = initial_q(cfg, SHAPES)
    q_ref = [x.astype(np.float64) for x in q]
    errors = [[np.zeros(SHAPES[i], np.float32) for i in plan.compressed] for _ in range(peers)]
    errors_ref = [[e.astype(np.float64) for e in es] for es in errors]
    for _ in range(3):  # warm-started Q and the errors carry over
        grads = [[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(peers)]
        ms = []
        for g, e in zip(grads, errors, strict=True):
            m = list(g)
            for j, i in enumerate(plan.compressed):
                m[i] = m[i] + e[j]
            ms.append(m)
        finished, q = _simulated_round(cfg, plan, ms, q, weights)
        mean_ref, errors_ref, q_ref = reference_round(cfg, grads, errors_ref, q_ref, weights)
        errors = [f[1] for f in finished]
        for k in range(peers):  # every peer holds the same mean
            for a, b in zip(finished[k][0], finished[0][0], strict=True):
                assert a.tobytes() == b.tobytes()
        for got, want in zip(finished[0][0], mean_ref, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        for k in range(peers):
            for got, want in zip(errors[k], errors_ref[k], strict=True):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        for got, want in zip(q, q_ref, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # the low-rank mean differs from the exact one, and the error is what it left out
    exact = _weighted_mean([m[0] for m in ms], weights)
    assert not np.allclose(finished[0][0][0], exact, atol=1e-3)
    if peers == 1:
        np.testing.assert_allclose(finished[0][0][0] + errors[0][0], ms[0][0], atol=1e-5)


def test_full_rank_recovers_the_exact_mean() -> None:
    """Rank >= min(n, m) would not gain (sent whole); rank n - 1 of an n x m rank-1 gradient
    is exact: the projection keeps the gradient's only direction."""
    rng = np.random.default_rng(2)
    u, v = rng.normal(size=(20, 1)), rng.normal(size=(1, 30))
    g = (u @ v).astype(np.float32)
    cfg = PowerSGD(rank=2)
    plan = cfg.plan([g.shape])
    finished, _ = _simulated_round(cfg, plan, [[g]], initial_q(cfg, [g.shape]), [1.0])
    np.testing.assert_allclose(finished[0][0][0], g, rtol=1e-4, atol=1e-4)


# --- the transform: lockstep peers in threads ---------------------------------------------
IN, OUT = 8, 6


class LockstepPowerSGD:
    """In-process hosts for K peers in threads: each averaging runs the host's two phases
    with exact weighted means in a fixed order (as :mod:`tests.dedloc_jax.lockstep`)."""

    def __init__(self, size: int, target: int) -> None:
        self.size, self.target = size, target
        self.barrier = threading.Barrier(size)
        self.samples = [0] * size
        self.slots: list = [None] * size
        self.epoch = 0

    def _mean(self, index: int, arrays: list[np.ndarray], weight: float) -> list[np.ndarray]:
        self.slots[index] = (arrays, weight)
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        weights = [w for _, w in got]
        return [_weighted_mean([a[j] for a, _ in got], weights) for j in range(len(arrays))]

    def host(self, index: int) -> Host:
        return Host(self, index)


class Host:
    def __init__(self, group: LockstepPowerSGD, index: int) -> None:
        self.group, self.index = group, index
        self.job: AveragingOutcome | None = None

    def report_progress(self, epoch: int, samples: int, batch_size: int) -> bool:
        g = self.group
        g.samples[self.index] = samples
        g.barrier.wait()
        ready = sum(g.samples) >= g.target
        g.barrier.wait()
        return ready

    def average_gradients(self, epoch, gradients, samples, *, codec=None) -> AveragingOutcome:
        assert isinstance(codec, PowerSGD)
        count = int(gradients[-1])
        plan = codec.plan([np.shape(a) for a in gradients[:count]])
        ms, qs = plan.unpack_sent(gradients)
        c = len(plan.compressed)
        mean_p = self.group._mean(self.index, plan.phase_p(ms, qs), float(samples))
        ps, local_q = plan.phase_q(ms, mean_p[:c])
        mean_q = self.group._mean(self.index, local_q, float(samples))
        mean, errors = plan.finish(ms, ps, mean_q, mean_p[c:])
        return AveragingOutcome([*mean, *plan.next_q(mean_q), *errors], epoch + 1, self.group.size)

    def start_averaging(self, epoch, gradients, samples, *, codec=None) -> None:
        self.job = self.average_gradients(epoch, gradients, samples, codec=codec)

    def poll_averaging(self) -> AveragingOutcome | None:
        job, self.job = self.job, None
        return job


def _data(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, IN)).astype(np.float32)
    y = (x @ rng.normal(size=(IN, OUT))).astype(np.float32)
    return x, y


def _loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _params() -> dict:
    return {"w": jnp.full((IN, OUT), 0.1, jnp.float32), "b": jnp.zeros((OUT,), jnp.float32)}


def _train(peers: int, epochs: int, per_peer: int, micro: int, cfg: PowerSGD, overlap: bool):
    x, y = _data(peers * per_peer * epochs)
    group = LockstepPowerSGD(peers, peers * per_peer)
    results: list = [None] * peers
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            tx = dedloc_jax.collaborative(
                optax.sgd(0.05),
                group.host(index),
                target_batch_size=peers * per_peer,
                overlap=overlap,
                compression=cfg,
            )
            params = _params()
            state = tx.init(params)

            @jax.jit
            def step(params, state, xb, yb):
                grads = jax.grad(_loss)(params, xb, yb)
                updates, state = tx.update(grads, state, params, batch_size=xb.shape[0])
                return optax.apply_updates(params, updates), state

            for e in range(epochs):
                base = e * peers * per_peer + index * per_peer
                for s in range(0, per_peer, micro):
                    params, state = step(
                        params,
                        state,
                        x[base + s : base + s + micro],
                        y[base + s : base + s + micro],
                    )
            if overlap:  # the last averaging is applied at the next micro-step
                params, state = step(params, state, x[:micro] * 0, y[:micro] * 0)
            results[index] = (jax.device_get(params), jax.device_get(state), step._cache_size())
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(peers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results, (x, y)


def _replay(peers: int, epochs: int, per_peer: int, cfg: PowerSGD, data) -> dict:
    """The reference: each epoch's per-peer mean gradients through :func:`reference_round`,
    then plain SGD on the mean."""
    x, y = data
    params = jax.device_get(_params())
    shapes = [np.shape(p) for p in jax.tree.leaves(params)]
    treedef = jax.tree.structure(params)
    plan = cfg.plan(shapes)
    q = [a.astype(np.float64) for a in initial_q(cfg, shapes)]
    errors = [[np.zeros(shapes[i]) for i in plan.compressed] for _ in range(peers)]
    for e in range(epochs):
        grads = []
        for k in range(peers):
            lo = e * peers * per_peer + k * per_peer
            g = jax.grad(_loss)(params, x[lo : lo + per_peer], y[lo : lo + per_peer])
            grads.append([np.asarray(a) for a in jax.tree.leaves(g)])
        mean, errors, q = reference_round(cfg, grads, errors, q, [per_peer] * peers)
        mean_tree = jax.tree.unflatten(treedef, mean)
        params = jax.tree.map(lambda p, g: np.asarray(p - 0.05 * g, np.float32), params, mean_tree)
    return params


@pytest.mark.parametrize(("peers", "overlap"), [(1, False), (2, False), (3, True)])
def test_collaborative_powersgd_matches_the_reference_replay(peers: int, overlap: bool) -> None:
    epochs, per_peer, micro = 3, 8, 4
    cfg = PowerSGD(rank=1, seed=5)
    results, data = _train(peers, epochs, per_peer, micro, cfg, overlap)
    for params, _, _ in results[1:]:  # bit-identical peers
        for key in params:
            assert params[key].tobytes() == results[0][0][key].tobytes()
    params, state, cache = results[0]
    assert cache == 1  # one compilation: the state's shapes are fixed
    assert int(state.epoch) == epochs
    assert state.powersgd is not None and state.powersgd.q[0].shape == (OUT, 1)
    assert np.abs(state.powersgd.error[0]).max() > 0  # rank 1 of 8 x 6 leaves something out
    if not overlap:
        want = _replay(peers, epochs, per_peer, cfg, data)
        for key in want:
            np.testing.assert_allclose(params[key], want[key], rtol=1e-4, atol=1e-5)


def test_served_state_has_no_error_feedback() -> None:
    from dedloc_jax.state.training import _reset_accumulators

    cfg = PowerSGD(rank=1)
    tx = dedloc_jax.collaborative(
        optax.sgd(0.1), LockstepPowerSGD(1, 4).host(0), target_batch_size=4, compression=cfg
    )
    state = tx.init(_params())
    lowrank = state.powersgd._replace(error=(jnp.ones((IN, OUT)),))
    served = _reset_accumulators(state._replace(powersgd=lowrank))
    assert not np.asarray(served.powersgd.error[0]).any()
    assert served.powersgd.q[0].tobytes() == state.powersgd.q[0].tobytes()  # Q is shared


def test_compression_must_be_powersgd() -> None:
    with pytest.raises(TypeError, match="PowerSGD"):
        dedloc_jax.collaborative(
            optax.sgd(0.1), LockstepPowerSGD(1, 4).host(0), target_batch_size=4, compression="int8"
        )


def test_a_dead_factor_column_restarts_from_the_seed() -> None:
    """A zero mean Q column (zero gradients) would keep ``M Q`` at zero in every later round."""
    cfg = PowerSGD(rank=2)
    plan = cfg.plan([(10, 7)])
    q = np.ones((7, 2), np.float32)
    q[:, 1] = 0.0
    got = plan.next_q([q])[0]
    assert (got[:, 0] == 1.0).all()
    assert got[:, 1].tobytes() == initial_q(cfg, [(10, 7)])[0][:, 1].tobytes()
