from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dedloc_jax.collaborative import CollaborativeState, collaborative
from dedloc_jax.history import RoundOutcome
from dedloc_jax.host import AveragingOutcome
from tests.dedloc_jax.lockstep import LockstepGroup, LockstepPeer

DIM = 6


def _data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    w = rng.normal(size=(DIM,)).astype(np.float32)
    y = x @ w + 0.1 * rng.normal(size=(n,)).astype(np.float32)
    return x, y


def _loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    pred = x @ params["w"] + params["b"]
    return jnp.mean((pred - y) ** 2)


def _init_params() -> dict:
    return {"w": jnp.zeros((DIM,), jnp.float32), "b": jnp.zeros((), jnp.float32)}


def _inner() -> optax.GradientTransformation:
    return optax.adam(0.05)


class OverlapPeer(LockstepPeer):
    """A lockstep peer whose background averaging finishes ``delay`` polls after it started."""

    def __init__(self, group: LockstepGroup, index: int, delay: int) -> None:
        super().__init__(group, index)
        self.delay = delay
        self._job: tuple[int, AveragingOutcome] | None = None

    def start_averaging(self, epoch: int, gradients: list, samples: int) -> None:
        assert self._job is None, "one averaging at a time"
        self._job = (self.delay, self.average_gradients(epoch, gradients, samples))

    def poll_averaging(self) -> AveragingOutcome | None:
        assert self._job is not None, "polled with no averaging in flight"
        polls_left, outcome = self._job
        if polls_left > 0:
            self._job = (polls_left - 1, outcome)
            return None
        self._job = None
        return outcome


def _train_collaborative(
    peers: int, epochs: int, micro: int, per_peer: int, *, delay: int | None = None
) -> tuple[list[dict], LockstepGroup, list[int]]:
    """Each peer feeds its shard of every epoch's global batch in micro-batches (with delayed
    updates when ``delay`` is given: the averaging finishes ``delay`` micro-steps late)."""
    x, y = _data(peers * per_peer * epochs)
    group = LockstepGroup(peers, target_batch_size=peers * per_peer)
    results: list[dict | None] = [None] * peers
    cache_sizes: list[int] = [0] * peers
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            host = group.peer(index) if delay is None else OverlapPeer(group, index, delay)
            tx = collaborative(
                _inner(), host, target_batch_size=peers * per_peer, overlap=delay is not None
            )
            params = _init_params()
            state = tx.init(params)

            @jax.jit
            def step(params, state, xb, yb):
                grads = jax.grad(_loss)(params, xb, yb)
                updates, state = tx.update(grads, state, params, batch_size=xb.shape[0])
                return optax.apply_updates(params, updates), state

            for e in range(epochs):
                base = e * peers * per_peer + index * per_peer
                for s in range(0, per_peer, micro):
                    sl = slice(base + s, base + s + micro)
                    params, state = step(params, state, x[sl], y[sl])
            results[index] = jax.device_get(params)
            cache_sizes[index] = step._cache_size()
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(e)
            group._barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(peers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, group, cache_sizes  # type: ignore[return-value]


def _train_single(epochs: int, batch: int) -> dict:
    x, y = _data(batch * epochs)
    tx = _inner()
    params = _init_params()
    state = tx.init(params)
    for e in range(epochs):
        sl = slice(e * batch, (e + 1) * batch)
        grads = jax.grad(_loss)(params, x[sl], y[sl])
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return jax.device_get(params)


@pytest.mark.parametrize("peers", [1, 2, 4])
def test_peers_match_single_process_training_and_each_other(peers: int) -> None:
    epochs, micro, per_peer = 4, 4, 8
    results, group, cache_sizes = _train_collaborative(peers, epochs, micro, per_peer)
    assert group.averagings == epochs
    for other in results[1:]:
        for k in results[0]:
            np.testing.assert_array_equal(other[k], results[0][k])  # bit-identical
    reference = _train_single(epochs, peers * per_peer)
    for k in reference:
        np.testing.assert_allclose(results[0][k], reference[k], rtol=1e-5, atol=1e-6)
    # One compilation for all micro-steps and epochs.
    assert cache_sizes == [1] * peers


def test_zero_updates_between_steps_and_state_is_fixed_shape() -> None:
    group = LockstepGroup(1, target_batch_size=12)
    tx = collaborative(_inner(), group.peer(0), target_batch_size=12)
    params = _init_params()
    state = tx.init(params)
    x, y = _data(12)
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), state)
    for i, expect_step in ((0, False), (4, False), (8, True)):
        grads = jax.grad(_loss)(params, x[i : i + 4], y[i : i + 4])
        updates, state = tx.update(grads, state, params, batch_size=4)
        moved = any(bool(jnp.any(u != 0)) for u in jax.tree.leaves(updates))
        assert moved == expect_step
        assert jax.tree.map(lambda a: (a.shape, a.dtype), state) == shapes
    assert isinstance(state, CollaborativeState)
    assert int(state.epoch) == 1 and int(state.samples) == 0
    # The inner optimizer's step count is the collaboration's epoch.
    assert int(optax.tree_utils.tree_get(state.inner_state, "count")) == 1


def test_composes_with_chain_and_inject_hyperparams() -> None:
    group = LockstepGroup(1, target_batch_size=8)
    schedule = optax.linear_schedule(0.1, 0.0, transition_steps=10)
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        collaborative(inner, group.peer(0), target_batch_size=8),
    )
    params = _init_params()
    state = tx.init(params)
    x, y = _data(32)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p, batch_size=4))
    for i in range(0, 32, 4):
        grads = jax.grad(_loss)(params, x[i : i + 4], y[i : i + 4])
        updates, state = step(grads, state, params)
        params = optax.apply_updates(params, updates)
    collab_state = state[1]
    assert int(collab_state.epoch) == 4
    hp = collab_state.inner_state.hyperparams
    np.testing.assert_allclose(float(hp["learning_rate"]), float(schedule(3)), rtol=1e-6)


def test_flax_nnx_optimizer() -> None:
    group = LockstepGroup(1, target_batch_size=8)
    model = nnx.Linear(DIM, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, collaborative(optax.sgd(0.1), group.peer(0), target_batch_size=8), wrt=nnx.Param
    )
    x, y = _data(16)

    @nnx.jit
    def train_step(model, optimizer, xb, yb):
        def loss_fn(m):
            return jnp.mean((m(xb)[:, 0] - yb) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads, batch_size=xb.shape[0])
        return loss

    kernel0 = np.array(model.kernel.value)
    train_step(model, optimizer, x[:4], y[:4])
    np.testing.assert_array_equal(np.array(model.kernel.value), kernel0)  # accumulating
    train_step(model, optimizer, x[4:8], y[4:8])
    assert not np.array_equal(np.array(model.kernel.value), kernel0)  # stepped
    assert group.averagings == 1


def test_rejects_bad_target() -> None:
    group = LockstepGroup(1, target_batch_size=8)
    with pytest.raises(ValueError, match="target_batch_size"):
        collaborative(optax.sgd(0.1), group.peer(0), target_batch_size=0)


def test_jitted_step_has_no_jax_effects_and_steps_like_the_eager_path() -> None:
    """No JAX effect in the step (an effect takes it off JAX's fast C++ dispatch path on every
    micro-step, see bench.optax_overhead), and the jitted and eager paths agree (to rounding)."""
    x, y = _data(48)

    def train(jitted: bool) -> tuple[dict, CollaborativeState, int]:
        group = LockstepGroup(1, target_batch_size=12)
        tx = collaborative(_inner(), group.peer(0), target_batch_size=12)
        params = _init_params()
        state = tx.init(params)

        def step(params, state, xb, yb):
            grads = jax.grad(_loss)(params, xb, yb)
            updates, state = tx.update(grads, state, params, batch_size=xb.shape[0])
            return optax.apply_updates(params, updates), state

        if jitted:
            assert not jax.make_jaxpr(step)(params, state, x[:4], y[:4]).effects
            step = jax.jit(step, donate_argnums=(0, 1))
        for i in range(0, 44, 4):  # 11 micro-steps: 3 averaging steps and 2 pending batches
            params, state = step(params, state, x[i : i + 4], y[i : i + 4])
        return jax.device_get(params), jax.device_get(state), group.averagings

    jit_params, jit_state, jit_avg = train(jitted=True)
    eager_params, eager_state, eager_avg = train(jitted=False)
    assert jit_avg == eager_avg == 3
    assert int(jit_state.epoch) == int(eager_state.epoch) == 3
    assert int(jit_state.samples) == int(eager_state.samples) == 8
    for a, b in zip(
        jax.tree.leaves((jit_params, jit_state)),
        jax.tree.leaves((eager_params, eager_state)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _train_single_delayed(epochs: int, peers: int, per_peer: int, micro: int, delay: int) -> dict:
    """Delayed updates by hand: epoch e's step is applied after the gradients of micro-step
    ``delay + 1`` of epoch e + 1 were computed (with the old parameters); the last is pending."""
    x, y = _data(peers * per_peer * epochs)
    tx = _inner()
    params = _init_params()
    state = tx.init(params)
    pending = None
    for e in range(epochs):
        acc = jax.tree.map(jnp.zeros_like, params)
        for i, s in enumerate(range(0, per_peer, micro)):
            for j in range(peers):
                lo = e * peers * per_peer + j * per_peer + s
                grads = jax.grad(_loss)(params, x[lo : lo + micro], y[lo : lo + micro])
                acc = jax.tree.map(lambda a, g: a + g * micro, acc, grads)
            if pending is not None and i == delay:
                updates, state = tx.update(pending, state, params)
                params = optax.apply_updates(params, updates)
                pending = None
        pending = jax.tree.map(lambda a: a / (peers * per_peer), acc)
    return jax.device_get(params)


@pytest.mark.parametrize(("peers", "delay"), [(1, 0), (2, 2)])
def test_overlap_applies_each_step_late_like_delayed_updates(peers: int, delay: int) -> None:
    epochs, micro, per_peer = 4, 4, 16
    results, group, cache_sizes = _train_collaborative(peers, epochs, micro, per_peer, delay=delay)
    assert group.averagings == epochs
    for other in results[1:]:
        for k in results[0]:
            np.testing.assert_array_equal(other[k], results[0][k])  # bit-identical
    reference = _train_single_delayed(epochs, peers, per_peer, micro, delay)
    undelayed = _train_single(epochs, peers * per_peer)
    for k in reference:
        np.testing.assert_allclose(results[0][k], reference[k], rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(results[0][k], undelayed[k]) for k in undelayed)
    assert cache_sizes == [1] * peers


def test_overlap_needs_a_host_that_averages_in_the_background() -> None:
    group = LockstepGroup(1, target_batch_size=8)
    with pytest.raises(TypeError, match="start_averaging"):
        collaborative(optax.sgd(0.1), group.peer(0), target_batch_size=8, overlap=True)


def test_donated_step_that_does_not_average_copies_no_parameter_sized_array() -> None:
    """The accumulator is updated in place, the optimizer state crosses the branch aliased, and
    no zero tree is materialised: a micro-step costs what plain optax costs in memory passes
    (bench.optax_overhead). A copy would show in the compiled program as a ``copy`` of the
    parameters' shape."""
    group = LockstepGroup(1, target_batch_size=10**9)
    tx = collaborative(optax.adam(1e-3), group.peer(0), target_batch_size=10**9)
    params = {"w": jnp.zeros((48, 40), jnp.float32), "v": jnp.ones((48, 40), jnp.float32)}

    def step(params, state, x):
        grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"]) * (x @ p["v"])))(params)
        updates, state = tx.update(grads, state, params, batch_size=x.shape[0])
        return optax.apply_updates(params, updates), state

    x = jnp.ones((8, 48), jnp.float32)
    state = tx.init(params)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    hlo = jitted.lower(params, state, x).compile().as_text()
    assert "f32[48,40]{1,0} copy(" not in hlo
    # and the masked updates are exact zeros: the parameters do not move while accumulating
    new_params, state = jitted(jax.tree.map(jnp.copy, params), state, x)
    for k in params:
        np.testing.assert_array_equal(new_params[k], params[k])
    assert int(state.samples) == 8 and float(jnp.abs(state.grad_sum["w"]).sum()) > 0


class _NeverDue:
    """A collaboration that averages mid-step (``host.MidStepHost``) whose target never lands."""

    def report_progress(self, epoch: int, samples: int, batch_size: int) -> bool:
        return False

    def report_whole_steps(self, epoch: int, samples: int, batch_size: int) -> bool:
        return False

    def average_gradients(self, epoch: int, gradients: list, samples: int) -> None:
        raise AssertionError("never due")

    def lands_within(self, seconds: float) -> bool:
        return False

    def hand_over(self, epoch: int, gradients: list, samples: int) -> None:
        raise AssertionError("never due")

    def take_over(self) -> None:
        return None


class _HandsOverAt:
    """One peer on its own (``host.MidStepHost``): after the report of ``samples``, says the
    target lands within the next micro-step; the round of what it was handed then begins at
    once and gives back what it was handed."""

    def __init__(self, samples: int) -> None:
        self.at = samples
        self.reports: list[tuple[int, int, int]] = []
        self.handed: tuple[int, list, int] | None = None

    def report_progress(self, epoch: int, samples: int, batch_size: int) -> bool:
        raise AssertionError("a mid-step peer decides on whole micro-steps")

    def report_whole_steps(self, epoch: int, samples: int, batch_size: int) -> bool:
        self.reports.append((epoch, samples, batch_size))
        return False

    def average_gradients(self, epoch: int, gradients: list, samples: int) -> None:
        raise AssertionError("never reached at the end of a micro-step")

    def lands_within(self, seconds: float) -> bool:
        return self.reports[-1][:2] == (0, self.at)

    def hand_over(self, epoch: int, gradients: list, samples: int) -> None:
        self.handed = (epoch, [np.array(g) for g in gradients], samples)

    def take_over(self) -> RoundOutcome | None:
        if self.handed is None:
            return None
        epoch, gradients, _ = self.handed
        return RoundOutcome(epoch, 1, True, average=gradients)


@pytest.mark.parametrize("jit", [False, True])
def test_a_handed_over_accumulator_steps_and_the_next_micro_step_starts_the_next_epoch(
    jit: bool,
) -> None:
    """The hand-over, eager and jitted: the step applies the mean through micro-step k-1
    (handed over at its end); micro-step k's gradients are the next epoch's accumulator."""
    host = _HandsOverAt(8)
    tx = collaborative(optax.sgd(0.1), host, target_batch_size=10**9)
    params = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(3, 2)}
    loss = jax.grad(lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]) ** 2))

    def step(params, state, x):
        updates, state = tx.update(loss(params, x), state, params, batch_size=x.shape[0])
        return optax.apply_updates(params, updates), state

    step = jax.jit(step) if jit else step
    xs = [np.random.default_rng(i).normal(size=(4, 3)).astype(np.float32) for i in range(3)]
    p, state = params, tx.init(params)
    for x in xs[:2]:
        p, state = step(p, state, x)
    assert int(state.epoch) == 0 and int(state.samples) == 8  # handed over, and kept
    assert host.handed is not None and host.handed[2] == 8
    p, state = step(p, state, xs[2])
    assert int(state.epoch) == 1 and int(state.samples) == 4
    mean = (loss(params, xs[0])["w"] + loss(params, xs[1])["w"]) / 2
    np.testing.assert_allclose(p["w"], params["w"] - 0.1 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.grad_sum["w"], 4 * loss(params, xs[2])["w"], rtol=1e-5)
    assert host.reports[-1] == (1, 4, 4)  # counted toward the next epoch


def _copies_by_computation(hlo: str, shape: str) -> dict[str, int]:
    """How many ``copy`` of ``shape`` each computation of a compiled HLO text holds."""
    counts: dict[str, int] = {}
    name = ""
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
        if f"{shape} copy(" in line:
            counts[name] = counts.get(name, 0) + 1
    return counts


def test_a_mid_step_peers_micro_step_that_does_not_average_copies_no_parameter_sized_array() -> (
    None
):
    """Averaging mid-step adds two branches (hand the accumulator over; step with its
    averaging). One ``lax.switch`` of five branches made XLA copy the state around it on every
    micro-step (4 parameter-sized copies on the step's top level, 28 in all); KEEP against the
    rest, then which of the rest, leaves the micro-step that keeps without any (the branches
    that act, near the target, copy: 16)."""
    tx = collaborative(optax.adam(1e-3), _NeverDue(), target_batch_size=10**9)
    params = {"w": jnp.zeros((48, 40), jnp.float32), "v": jnp.ones((48, 40), jnp.float32)}

    def step(params, state, x):
        grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"]) * (x @ p["v"])))(params)
        updates, state = tx.update(grads, state, params, batch_size=x.shape[0])
        return optax.apply_updates(params, updates), state

    x = jnp.ones((8, 48), jnp.float32)
    state = tx.init(params)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    hlo = jitted.lower(params, state, x).compile().as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    (outer,) = [line for line in entry.splitlines() if " conditional(" in line]
    keep = outer.split("branch_computations={")[1].split(",")[0].lstrip("%")
    copies = _copies_by_computation(hlo, "f32[48,40]{1,0}")
    assert copies.get("ENTRY", 0) == 0 and copies.get(keep, 0) == 0, copies
    new_params, state = jitted(jax.tree.map(jnp.copy, params), state, x)
    for k in params:
        np.testing.assert_array_equal(new_params[k], params[k])
    assert int(state.samples) == 8


def test_the_portable_host_callback_steps_like_the_cpu_buffer_views() -> None:
    """On GPU and TPU the jitted step reaches the host with ``jax.pure_callback`` (XLA's GPU
    buffers are no NumPy views, and TPUs cannot lower ``buffer_callback``); forced here on the
    CPU, it gives bit-identical results, and "auto" picks the buffer views on CPU."""
    import importlib

    module = importlib.import_module("dedloc_jax.host")

    x, y = _data(48)

    def train(callback: str) -> tuple:
        group = LockstepGroup(1, target_batch_size=12)
        tx = collaborative(_inner(), group.peer(0), target_batch_size=12, callback=callback)
        params = _init_params()
        state = tx.init(params)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, state, xb, yb):
            grads = jax.grad(_loss)(params, xb, yb)
            updates, state = tx.update(grads, state, params, batch_size=xb.shape[0])
            return optax.apply_updates(params, updates), state

        text = step.lower(params, state, x[:4], y[:4]).as_text()
        for i in range(0, 44, 4):
            params, state = step(params, state, x[i : i + 4], y[i : i + 4])
        return jax.device_get((params, state)), group.averagings, text

    pure, pure_avg, pure_text = train("pure")
    views, views_avg, views_text = train("buffer")
    auto, _, auto_text = train("auto")
    assert pure_avg == views_avg == 3
    leaves = (jax.tree.leaves(pure), jax.tree.leaves(views), jax.tree.leaves(auto))
    for a, b, c in zip(*leaves, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    # The lowered programs differ in the callback they call; auto on CPU is the buffer one.
    assert pure_text != views_text and auto_text == views_text
    assert module._buffer_views_work() is (jax.default_backend() == "cpu")
    with pytest.raises(ValueError, match="callback"):
        collaborative(_inner(), LockstepGroup(1, 4).peer(0), target_batch_size=4, callback="x")
