"""``diloco``: local inner steps, one averaged outer step per collaboration-wide batch.

In-process peers (``tests.dedloc_jax.lockstep``) test the transform on its own; the tests at
the end run real :class:`dedloc_jax.Collaboration` peers on loopback sockets.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dedloc_jax
from dedloc_jax import Collaboration, CollaborationConfig, DefenceConfig, DiLoCoState, diloco
from dedloc_jax.diloco import outer_params_after_step
from dedloc_jax.host import AveragingOutcome
from dedloc_jax.state.training import share_state, sync_state
from tests.dedloc_jax.lockstep import LockstepGroup, LockstepPeer

DIM = 5
MICRO = 4


def _data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    y = (x @ rng.normal(size=(DIM,)).astype(np.float32)).astype(np.float32)
    return x, y


def _loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _params() -> dict:
    return {"w": jnp.zeros((DIM,), jnp.float32), "b": jnp.zeros((), jnp.float32)}


class CodecPeer(LockstepPeer):
    """A lockstep peer whose averaging takes the wire codec (and records it)."""

    def __init__(self, group: LockstepGroup, index: int) -> None:
        super().__init__(group, index)
        self.codecs: list[str | None] = []

    def average_gradients(self, epoch, gradients, samples, *, codec=None) -> AveragingOutcome:
        self.codecs.append(codec)
        return super().average_gradients(epoch, gradients, samples)


class OverlapPeer(CodecPeer):
    """Averages in the background; the outcome shows ``delay`` polls after the start."""

    def __init__(self, group: LockstepGroup, index: int, delay: int) -> None:
        super().__init__(group, index)
        self.delay = delay
        self._job: list | None = None

    def start_averaging(self, epoch, gradients, samples, *, codec=None) -> None:
        assert self._job is None, "one averaging at a time"
        self._job = [self.delay, self.average_gradients(epoch, gradients, samples, codec=codec)]

    def poll_averaging(self) -> AveragingOutcome | None:
        assert self._job is not None
        if self._job[0] > 0:
            self._job[0] -= 1
            return None
        outcome, self._job = self._job[1], None
        return outcome


def _step_fn(tx: optax.GradientTransformation, jit: bool) -> Callable:
    def step(params, state, xb, yb):
        grads = jax.grad(_loss)(params, xb, yb)
        updates, state = tx.update(grads, state, params, batch_size=xb.shape[0])
        return optax.apply_updates(params, updates), state

    return jax.jit(step) if jit else step


def _run_peers(fns: list[Callable[[], None]], group: LockstepGroup | None = None) -> None:
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
            if group is not None:
                group._barrier.abort()

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if errors:
        raise errors[0]


def _reference(
    inner: Callable[[], optax.GradientTransformation],
    outer: optax.GradientTransformation,
    shards: list[list[list[tuple[np.ndarray, np.ndarray]]]],
    *,
    reset_inner: bool = False,
    equal_weights: bool = False,
) -> list[dict]:
    """One process: every outer step replays each peer's inner loop from the outer
    parameters, one peer after the other, then steps ``outer`` on the sample-weighted mean
    pseudo-gradient. ``shards[i][e]``: the micro-batches peer i fed toward outer step e."""
    outer_params = _params()
    outer_state = outer.init(outer_params)
    inner_tx = [inner() for _ in shards]
    inner_states = [tx.init(outer_params) for tx in inner_tx]
    history = []
    for e in range(len(shards[0])):
        deltas, weights = [], []
        for i, tx in enumerate(inner_tx):
            local = outer_params
            for xb, yb in shards[i][e]:
                grads = jax.grad(_loss)(local, xb, yb)
                updates, inner_states[i] = tx.update(grads, inner_states[i], local)
                local = optax.apply_updates(local, updates)
            deltas.append(jax.tree.map(lambda o, p: o - p, outer_params, local))
            weights.append(1 if equal_weights else sum(len(xb) for xb, _ in shards[i][e]))
        total = sum(weights)
        scale = [np.float32(w) / np.float32(total) for w in weights]
        mean = jax.tree.map(
            lambda *d, c=scale: sum(w * x for w, x in zip(c, d, strict=True)), *deltas
        )
        updates, outer_state = outer.update(mean, outer_state, outer_params)
        outer_params = optax.apply_updates(outer_params, updates)
        if reset_inner:
            inner_states = [tx.init(outer_params) for tx in inner_tx]
        history.append(jax.device_get(outer_params))
    return history


def _lockstep_train(
    inner: Callable[[], optax.GradientTransformation],
    outer: Callable[[], optax.GradientTransformation],
    per_peer: list[int],
    epochs: int,
    *,
    jit: bool = True,
    reset_inner: bool = False,
) -> tuple[list[list[dict]], list[list[list]], list[DiLoCoState]]:
    """Peers feed ``per_peer[i]`` samples per outer step in micro-batches, then wait (batch
    size 0) for the step; returns each peer's parameters after every outer step (as
    ``outer_params_after_step`` hands them to the loop), the micro-batches it fed and its
    final state."""
    k = len(per_peer)
    target = sum(per_peer)
    group = LockstepGroup(k, target_batch_size=target)
    x, y = _data(target * epochs)
    history: list[list[dict]] = [[] for _ in range(k)]
    fed: list[list[list]] = [[[] for _ in range(epochs)] for _ in range(k)]
    final: list = [None] * k

    def run(i: int) -> None:
        peer = CodecPeer(group, i)
        tx = diloco(inner(), peer, target_batch_size=target, outer=outer(), reset_inner=reset_inner)
        final[i] = _train_peer(tx, jit, per_peer, i, (x, y), fed[i], history[i])
        assert peer.codecs == ["int8"] * epochs  # the default codec, asked per call

    _run_peers([lambda i=i: run(i) for i in range(k)], group)
    return history, fed, final


def _train_peer(
    tx: optax.GradientTransformation,
    jit: bool,
    per_peer: list[int],
    i: int,
    data: tuple[np.ndarray, np.ndarray],
    fed: list[list],
    history: list[dict],
) -> optax.OptState:
    """Peer ``i`` of a lockstep run, one epoch per entry of ``fed``: it feeds its share of the
    epoch's samples (``per_peer[i]``, after the peers before it) in micro-batches, recorded in
    ``fed``, steps until the epoch moves and keeps the outer parameters in ``history``;
    returns its final state."""
    x, y = data
    target, offset = sum(per_peer), sum(per_peer[:i])
    step = _step_fn(tx, jit)
    params = _params()
    state = tx.init(params)
    for e, batches in enumerate(fed):
        lo = e * target + offset
        for s in range(0, per_peer[i], MICRO):
            xb, yb = x[lo + s : lo + s + MICRO], y[lo + s : lo + s + MICRO]
            batches.append((xb, yb))
            params, state = step(params, state, xb, yb)
        while int(state.epoch) == e:
            params, state = step(params, state, x[:0], y[:0])
        params = outer_params_after_step(params, state)
        history.append(jax.device_get(params))
    return state


def _assert_bit_identical(history: list[list[dict]]) -> None:
    for peer in history[1:]:
        for mine, theirs in zip(peer, history[0], strict=True):
            for key in mine:
                assert mine[key].tobytes() == theirs[key].tobytes()


@pytest.mark.parametrize("jit", [True, False])
def test_sgd_outer_step_is_the_weighted_mean_of_the_replayed_local_params(jit: bool) -> None:
    a = 0.05
    history, fed, final = _lockstep_train(
        lambda: optax.sgd(a), lambda: optax.sgd(1.0), [12, 4], epochs=3, jit=jit
    )
    _assert_bit_identical(history)
    # sgd(1.0) outer: new outer = outer - mean(outer - local_i) = mean(local_i), each local_i
    # replayed from the previous outer parameters on what peer i fed, weighted 12:4
    reference = _reference(lambda: optax.sgd(a), optax.sgd(1.0), fed)
    for got, want in zip(history[0], reference, strict=True):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6)
    # not the unweighted mean: the weights matter
    unweighted = _reference(lambda: optax.sgd(a), optax.sgd(1.0), fed, equal_weights=True)
    assert not np.allclose(history[0][0]["w"], unweighted[0]["w"], rtol=1e-6, atol=1e-6)
    assert [int(s.epoch) for s in final] == [3, 3]
    assert all(int(s.group_size) == 2 and bool(s.complete) for s in final)


def test_nesterov_outer_and_adamw_inner_match_a_single_process_reference() -> None:
    inner = lambda: optax.adamw(0.02, weight_decay=0.1)  # noqa: E731
    outer = lambda: optax.sgd(0.7, momentum=0.9, nesterov=True)  # noqa: E731
    history, fed, final = _lockstep_train(inner, outer, [8, 12, 4], epochs=3)
    _assert_bit_identical(history)
    reference = _reference(inner, outer(), fed)
    for got, want in zip(history[0], reference, strict=True):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)
    # the outer optimizer's state is bit-identical across peers too
    for s in final[1:]:
        for mine, theirs in zip(
            jax.tree.leaves(s.outer_state), jax.tree.leaves(final[0].outer_state), strict=True
        ):
            assert np.asarray(mine).tobytes() == np.asarray(theirs).tobytes()


def test_reset_inner_restarts_the_inner_state_at_each_outer_step() -> None:
    inner = lambda: optax.adam(0.02)  # noqa: E731
    history, fed, final = _lockstep_train(
        inner, lambda: optax.sgd(1.0), [8, 8], epochs=2, reset_inner=True
    )
    reference = _reference(inner, optax.sgd(1.0), fed, reset_inner=True)
    kept = _reference(inner, optax.sgd(1.0), fed, reset_inner=False)
    for key in reference[-1]:
        np.testing.assert_allclose(history[0][-1][key], reference[-1][key], rtol=1e-5, atol=1e-6)
    assert not np.allclose(history[0][-1]["w"], kept[-1]["w"], rtol=1e-5, atol=1e-6)
    # reset: the inner state is inner.init of the new outer parameters, on every peer
    for s in final:
        fresh = inner().init(s.outer_params)
        for mine, want in zip(jax.tree.leaves(s.inner_state), jax.tree.leaves(fresh), strict=True):
            assert np.asarray(mine).tobytes() == np.asarray(want).tobytes()


def test_inner_steps_between_outer_steps_are_plain_local_training() -> None:
    group = LockstepGroup(1, target_batch_size=16)
    tx = diloco(optax.sgd(0.1), CodecPeer(group, 0), target_batch_size=16)
    ref = optax.sgd(0.1)
    x, y = _data(16)
    params, state = _params(), tx.init(_params())
    ref_params, ref_state = _params(), ref.init(_params())
    for s in range(0, 12, MICRO):
        grads = jax.grad(_loss)(params, x[s : s + MICRO], y[s : s + MICRO])
        updates, state = tx.update(grads, state, params, batch_size=MICRO)
        params = optax.apply_updates(params, updates)
        r_updates, ref_state = ref.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, r_updates)
        for key in params:
            assert np.asarray(params[key]).tobytes() == np.asarray(ref_params[key]).tobytes()
    assert int(state.samples) == 12 and int(state.epoch) == 0 and group.averagings == 0
    # the outer parameters have not moved
    for leaf in jax.tree.leaves(state.outer_params):
        assert not np.any(np.asarray(leaf))


def test_jit_compiles_once_and_composes_with_chain() -> None:
    group = LockstepGroup(1, target_batch_size=8)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        diloco(optax.adam(0.05), CodecPeer(group, 0), target_batch_size=8),
    )
    step = _step_fn(tx, jit=True)
    x, y = _data(32)
    params = _params()
    state = tx.init(params)
    for s in range(0, 32, MICRO):
        params, state = step(params, state, x[s : s + MICRO], y[s : s + MICRO])
    assert int(state[1].epoch) == 4 and group.averagings == 4
    assert step._cache_size() == 1  # fixed shapes: no recompilation
    # the outer step landed: what the loop holds is the outer parameters (one rounding off
    # at most, before keep_in_step replaces them exactly)
    for got, want in zip(
        jax.tree.leaves(params), jax.tree.leaves(state[1].outer_params), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    exact = outer_params_after_step(params, state)
    for got, want in zip(
        jax.tree.leaves(exact), jax.tree.leaves(state[1].outer_params), strict=True
    ):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_flax_nnx_optimizer() -> None:
    group = LockstepGroup(1, target_batch_size=8)
    model = nnx.Linear(DIM, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model,
        diloco(optax.sgd(0.1), CodecPeer(group, 0), target_batch_size=8, outer=optax.sgd(0.5)),
        wrt=nnx.Param,
    )
    x, y = _data(16)

    @nnx.jit
    def train_step(model, optimizer, xb, yb):
        def loss_fn(m):
            return jnp.mean((m(xb)[:, 0] - yb) ** 2)

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads, batch_size=xb.shape[0])

    kernel0 = np.array(model.kernel.value)
    train_step(model, optimizer, x[:4], y[:4])
    local = np.array(model.kernel.value)
    assert not np.array_equal(local, kernel0)  # an inner step, locally
    train_step(model, optimizer, x[4:8], y[4:8])
    assert group.averagings == 1
    state = optimizer.opt_state
    assert isinstance(state, DiLoCoState) and int(state.epoch.value) == 1
    # the model moved onto the new outer parameters, which moved from the initial ones
    outer_kernel = np.array(state.outer_params["kernel"].value)
    np.testing.assert_allclose(np.array(model.kernel.value), outer_kernel, rtol=1e-6, atol=1e-7)
    assert not np.allclose(outer_kernel, kernel0)


def test_overlap_lands_the_outer_step_late_and_keeps_the_steps_taken_meanwhile() -> None:
    group = LockstepGroup(2, target_batch_size=16)
    x, y = _data(64)
    results: list = [None, None]

    def run(i: int) -> None:
        peer = OverlapPeer(group, i, delay=2)
        tx = diloco(optax.sgd(0.05), peer, target_batch_size=16, outer=optax.sgd(1.0), overlap=True)
        step = _step_fn(tx, jit=True)
        params = _params()
        state = tx.init(params)
        trace = []
        for s in range(0, 32, MICRO):
            lo = i * 32 + s
            params, state = step(params, state, x[lo : lo + MICRO], y[lo : lo + MICRO])
            trace.append((int(state.epoch), int(state.samples), jax.device_get(params)))
        results[i] = (trace, state)

    _run_peers([lambda i=i: run(i) for i in range(2)], group)
    for trace, state in results:
        # micro-steps 1-2 feed 8 each (16): averaging starts at step 2, lands 2 polls later
        assert [t[0] for t in trace] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert int(state.epoch) == 1
    # the outer parameters agree bit for bit; the local ones carry each peer's own steps
    o0, o1 = (jax.tree.leaves(r[1].outer_params) for r in results)
    assert all(
        np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(o0, o1, strict=True)
    )
    # the steps taken while the averaging ran are kept on top of the outer step
    for trace, state in results:
        drift = [
            np.asarray(p) - np.asarray(o)
            for p, o in zip(
                jax.tree.leaves(trace[4][2]), jax.tree.leaves(state.outer_params), strict=True
            )
        ]
        assert max(np.abs(d).max() for d in drift) > 1e-4
    # samples fed after the averaging started count toward the next outer step
    assert results[0][0][4][1] == 12  # 3 micro-batches of 4 since the start (steps 3, 4, 5)


def test_served_state_is_the_outer_state_and_one_digest_per_outer_state() -> None:
    """Peers that hold different local parameters between outer steps serve the same arrays:
    the outer parameters, the outer optimizer state, the local work emptied."""
    k = 2
    group = LockstepGroup(k, target_batch_size=16)
    x, y = _data(64)
    served: list = [None] * k
    held: list = [None] * k

    class Host:
        def share_state(self, arrays, epoch):
            self.got = (arrays, epoch)

    def run(i: int) -> None:
        tx = diloco(optax.adam(0.05), CodecPeer(group, i), target_batch_size=16)
        step = _step_fn(tx, jit=True)
        params = _params()
        state = tx.init(params)
        for s in range(0, 12, MICRO):  # 8 samples each: one outer step, then 4 more
            lo = i * 32 + s
            params, state = step(params, state, x[lo : lo + MICRO], y[lo : lo + MICRO])
        host = Host()
        share_state(host, params, state)
        served[i], held[i] = host.got, (params, state)

    _run_peers([lambda i=i: run(i) for i in range(k)], group)
    (a, ea), (b, eb) = served
    assert ea == eb == 1
    assert len(a) == len(b) and all(u.tobytes() == v.tobytes() for u, v in zip(a, b, strict=True))
    pa, pb = held[0][0], held[1][0]
    assert pa["w"].tobytes() != pb["w"].tobytes()  # the local parameters differ
    # a newcomer loads it: the outer parameters as its parameters, a fresh inner state
    tx = diloco(optax.adam(0.05), CodecPeer(LockstepGroup(1, 16), 0), target_batch_size=16)

    class Donor:
        def load_state(self, *, timeout):
            return 1, a

    params, state, epoch = sync_state(Donor(), _params(), tx.init(_params()))
    assert epoch == 1 and int(state.epoch) == 1 and int(state.samples) == 0
    assert bool(state.fresh)
    for got, want in zip(
        jax.tree.leaves(params), jax.tree.leaves(held[0][1].outer_params), strict=True
    ):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    # its next micro-step starts the inner state afresh (adam: zero moments) and trains on
    grads = jax.grad(_loss)(params, x[:MICRO], y[:MICRO])
    updates, state = tx.update(grads, state, params, batch_size=MICRO)
    assert not bool(state.fresh) and int(state.inner_state[0].count) == 1


def test_rejects_bad_arguments() -> None:
    group = LockstepGroup(1, target_batch_size=8)
    with pytest.raises(ValueError, match="target_batch_size"):
        diloco(optax.sgd(0.1), CodecPeer(group, 0), target_batch_size=0)
    with pytest.raises(ValueError, match="codec"):
        diloco(optax.sgd(0.1), CodecPeer(group, 0), target_batch_size=8, codec="gzip")
    with pytest.raises(TypeError, match="codec"):  # this host cannot choose a codec
        diloco(optax.sgd(0.1), group.peer(0), target_batch_size=8)
    diloco(optax.sgd(0.1), group.peer(0), target_batch_size=8, codec=None)
    with pytest.raises(TypeError, match="overlap"):
        diloco(optax.sgd(0.1), CodecPeer(group, 0), target_batch_size=8, overlap=True)
    tx = diloco(optax.sgd(0.1), CodecPeer(group, 0), target_batch_size=8)
    with pytest.raises(ValueError, match="parameters"):
        tx.update(_params(), tx.init(_params()), None, batch_size=4)


# --- real peers: Collaborations on loopback sockets ---------------------------------------
class LoopbackPeer:
    """A trainer as a user writes it: a jitted step, then ``keep_in_step`` after each."""

    def __init__(self, collab: Collaboration, tx: optax.GradientTransformation) -> None:
        self.collab = collab
        self.params = _params()
        self.state = tx.init(self.params)

        # donated, as the README's loop does: what keep_in_step hands back must not share buffers
        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, state, xb, yb, batch_size):
            grads = jax.grad(_loss)(params, xb, yb)
            updates, state = tx.update(grads, state, params, batch_size=batch_size)
            return optax.apply_updates(params, updates), state

        self.step = step
        self.history: list[dict] = []
        self.fed: list[list] = []
        self.group = 2  # the peers every outer step averages

    def _step(self, xb: np.ndarray, yb: np.ndarray, batch_size: int) -> None:
        self.params, self.state = self.step(self.params, self.state, xb, yb, batch_size)
        self.params, self.state = dedloc_jax.keep_in_step(self.collab, self.params, self.state)

    def train_epoch(
        self,
        x: np.ndarray,
        y: np.ndarray,
        deadline: float,
        after: float = 0.0,
    ) -> None:
        """Feed this peer's shard, then wait (batch 0: no inner step) for the outer step.
        ``after``: first wait until this peer's tracker counts that many of the others'
        samples toward the epoch (it then completes the target itself)."""
        while after and self.collab.estimate.others_samples < after:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the others' {after} samples never showed")
            time.sleep(0.02)
        start = int(self.state.epoch)
        self.fed.append([])
        for s in range(0, len(x), MICRO):
            self.fed[-1].append((x[s : s + MICRO], y[s : s + MICRO]))
            self._step(x[s : s + MICRO], y[s : s + MICRO], MICRO)
        while int(self.state.epoch) == start:
            if time.monotonic() > deadline:
                raise TimeoutError("the collaboration took no outer step")
            time.sleep(0.02)
            self._step(x[:MICRO], y[:MICRO], 0)
        assert int(self.state.group_size) == self.group and bool(self.state.complete)
        self.history.append(jax.device_get(self.params))


@pytest.mark.parametrize("kind", ["sgd", pytest.param("adamw-nesterov", marks=pytest.mark.slow)])
def test_two_peers_on_loopback_step_to_the_weighted_mean_of_their_local_training(
    kind: str,
) -> None:
    """Two Collaborations on loopback feed 12 and 4 samples per outer step; after each outer
    step their parameters (as keep_in_step hands them back) are bit-identical and equal the
    single-process replay of both inner loops and the outer step."""
    if kind == "sgd":
        inner, outer = (lambda: optax.sgd(0.05)), (lambda: optax.sgd(1.0))
        rtol = 1e-6
    else:
        inner = lambda: optax.adamw(0.02, weight_decay=0.1)  # noqa: E731
        outer = lambda: optax.sgd(0.7, momentum=0.9, nesterov=True)  # noqa: E731
        rtol = 1e-5
    shares, epochs = [12, 4], 3
    target = sum(shares)
    x, y = _data(target * epochs)
    config = CollaborationConfig.local_demo(target)
    config = config.replace(
        rounds=config.rounds.replace(matchmaking_time=0.5),
        progress=config.progress.replace(extrapolate=False),
    )
    with (
        Collaboration("diloco", config=config) as a,
        Collaboration("diloco", initial_peers=a.addrs, config=config) as b,
    ):
        peers = [
            LoopbackPeer(
                c, diloco(inner(), c, target_batch_size=target, outer=outer(), codec="none")
            )
            for c in (a, b)
        ]
        deadline = time.monotonic() + 120

        def run(i: int) -> Callable[[], None]:
            def go() -> None:
                for e in range(epochs):
                    lo = e * target + sum(shares[:i])
                    hi = lo + shares[i]
                    peers[i].train_epoch(x[lo:hi], y[lo:hi], deadline)

            return go

        _run_peers([run(0), run(1)])
    _assert_bit_identical([p.history for p in peers])
    reference = _reference(inner, outer(), [p.fed for p in peers])
    for got, want in zip(peers[0].history, reference, strict=True):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=1e-6)
    assert all(p.step._cache_size() == 1 for p in peers)


def test_a_newcomer_loads_the_outer_state_and_steps_in_step() -> None:
    """Two peers take two outer steps (outer SGD with momentum), then a third joins: it loads
    the outer parameters and the outer momentum, and the next outer steps of all three are
    bit-identical and equal the replay of their local training."""
    target = 16
    x, y = _data(target * 4)
    # robust=False: the reference is the plain weighted mean (open runs default to CenteredClip)
    config = CollaborationConfig.local_demo(target)
    config = config.replace(
        rounds=config.rounds.replace(matchmaking_time=0.5),
        progress=config.progress.replace(extrapolate=False),
        defence=DefenceConfig(robust=False),
    )

    def tx(c: Collaboration) -> optax.GradientTransformation:
        outer = optax.sgd(0.8, momentum=0.5)
        return diloco(optax.sgd(0.05), c, target_batch_size=target, outer=outer, codec="none")

    def epoch_of(
        peers: list[LoopbackPeer], shares: list[int], e: int, last: int | None = None
    ) -> list[Callable]:
        """``last``: the peer that feeds once it counts the others' samples."""
        starts = [e * target + sum(shares[:i]) for i in range(len(peers))]
        afters = [target - n if i == last else 0 for i, n in enumerate(shares)]
        return [
            lambda p=p, lo=lo, n=n, a=a: p.train_epoch(
                x[lo : lo + n], y[lo : lo + n], deadline, after=a
            )
            for p, lo, n, a in zip(peers, starts, shares, afters, strict=True)
        ]

    deadline = time.monotonic() + 180
    with (
        Collaboration("join", config=config) as a,
        Collaboration("join", initial_peers=a.addrs, config=config) as b,
    ):
        pa, pb = LoopbackPeer(a, tx(a)), LoopbackPeer(b, tx(b))
        for e in range(2):
            _run_peers(epoch_of([pa, pb], [8, 8], e))
        with Collaboration("join", initial_peers=a.addrs, config=config) as c:
            pc = LoopbackPeer(c, tx(c))
            pc.params, pc.state, epoch = dedloc_jax.sync_state(c, pc.params, pc.state)
            assert epoch == 2 and int(pc.state.epoch) == 2 and bool(pc.state.fresh)
            start = jax.device_get(pc.params)
            for key in start:
                assert start[key].tobytes() == pa.history[-1][key].tobytes()
            for mine, theirs in zip(
                jax.tree.leaves(pc.state.outer_state),
                jax.tree.leaves(pa.state.outer_state),
                strict=True,
            ):
                assert np.asarray(mine).tobytes() == np.asarray(theirs).tobytes()
            # compiled before its first epoch (a step of no samples), as a trainer is: a newcomer
            # that never averaged is not waited for (matchmaking's _earned: a fresh identity's
            # record must not stall a round), so one still compiling on a loaded machine
            # registered late and stepped apart. For the same reason it feeds last, once it
            # counts the others' samples: it completes the target and registers before they
            # read its samples; fed alongside them, it registered after the other two had
            # grouped in about 1 of 6 runs on a loaded machine.
            pc._step(x[:MICRO], y[:MICRO], 0)
            for p in (pa, pb, pc):
                p.group = 3
            for e in range(2, 4):
                _run_peers(epoch_of([pa, pb, pc], [8, 4, 4], e, last=2))
    _assert_bit_identical([pa.history[2:], pb.history[2:], pc.history])
    # the replay: momentum carried from the first two steps, so not from zero
    outer = optax.sgd(0.8, momentum=0.5)
    params, state = _params(), outer.init(_params())
    for e in range(4):
        fed = [pa.fed[e], pb.fed[e]] + ([pc.fed[e - 2]] if e >= 2 else [])
        locals_, weights = [], []
        for batches in fed:
            local = params
            for xb, yb in batches:
                grads = jax.grad(_loss)(local, xb, yb)
                local = jax.tree.map(lambda w, g: w - 0.05 * g, local, grads)
            locals_.append(local)
            weights.append(sum(len(xb) for xb, _ in batches))
        total = sum(weights)
        delta = jax.tree.map(
            lambda o, *ls, c=weights, t=total: sum(
                np.float32(w / t) * (o - loc) for w, loc in zip(c, ls, strict=True)
            ),
            params,
            *locals_,
        )
        updates, state = outer.update(delta, state, params)
        params = optax.apply_updates(params, updates)
        got = pa.history[e]
        for key in params:
            np.testing.assert_allclose(got[key], params[key], rtol=1e-5, atol=1e-6)
