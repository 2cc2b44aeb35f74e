"""Real sockets: peers in threads on loopback train one model with ``collaborative``."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dedloc_jax
from dedloc_jax import Collaboration, CollaborationConfig, collaborative

DIM = 5
MICRO = 4
PER_PEER = 8


def _data(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, DIM)).astype(np.float32)
    y = (x @ rng.normal(size=(DIM,)).astype(np.float32)).astype(np.float32)
    return x, y


def _loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _params():
    return {"w": jnp.zeros((DIM,), jnp.float32), "b": jnp.zeros((), jnp.float32)}


def _config(target: int) -> CollaborationConfig:
    # Each peer brings exactly its shard of the batch, so the estimate must not extrapolate
    # (an idle peer would otherwise be counted as still accumulating).
    config = CollaborationConfig.local_demo(target)
    return config.replace(
        rounds=config.rounds.replace(matchmaking_time=0.5),
        progress=config.progress.replace(extrapolate=False),
    )


class Peer:
    """One trainer: a Collaboration, a jitted step, and its shard of every epoch."""

    def __init__(self, collab: Collaboration, target: int) -> None:
        self.collab = collab
        self.tx = collaborative(optax.adam(0.05), collab, target_batch_size=target)
        self.params = _params()
        self.state = self.tx.init(self.params)
        tx = self.tx

        @jax.jit
        def step(params, state, xb, yb, batch_size):
            grads = jax.grad(_loss)(params, xb, yb)
            grads = jax.tree.map(lambda g: g * (batch_size > 0), grads)
            updates, state = tx.update(grads, state, params, batch_size=batch_size)
            return optax.apply_updates(params, updates), state

        self.step = step
        self.history: list[dict] = []

    @property
    def epoch(self) -> int:
        return int(self.state.epoch)

    def train_epoch(self, x: np.ndarray, y: np.ndarray, deadline: float) -> None:
        """Feed this peer's shard, then idle (batch 0) until the collaboration steps."""
        start = self.epoch
        for s in range(0, len(x), MICRO):
            self.params, self.state = self.step(
                self.params, self.state, x[s : s + MICRO], y[s : s + MICRO], MICRO
            )
        while self.epoch == start:
            if time.monotonic() > deadline:
                raise TimeoutError("the collaboration did not step")
            time.sleep(0.02)
            self.params, self.state = self.step(self.params, self.state, x[:MICRO], y[:MICRO], 0)
        dedloc_jax.share_state(self.collab, self.params, self.state)
        self.history.append(jax.device_get(self.params))


def _single(epochs: int, batch: int) -> dict:
    x, y = _data(batch * epochs)
    tx = optax.adam(0.05)
    params = _params()
    state = tx.init(params)
    for e in range(epochs):
        grads = jax.grad(_loss)(
            params, x[e * batch : (e + 1) * batch], y[e * batch : (e + 1) * batch]
        )
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return jax.device_get(params)


def _run_threads(fns) -> None:
    errors: list[BaseException] = []

    def wrap(fn):
        try:
            fn()
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("k", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_peers_on_loopback_match_single_process_training(k: int) -> None:
    epochs = 3
    target = k * PER_PEER
    x, y = _data(target * epochs)
    with Collaboration("equiv", config=_config(target)) as first:
        others = [
            Collaboration("equiv", initial_peers=first.addrs, config=_config(target))
            for _ in range(k - 1)
        ]
        for c in others:
            c.start()
        try:
            peers = [Peer(c, target) for c in [first, *others]]
            deadline = time.monotonic() + 60

            def run(i: int):
                def go():
                    for e in range(epochs):
                        lo = e * target + i * PER_PEER
                        peers[i].train_epoch(x[lo : lo + PER_PEER], y[lo : lo + PER_PEER], deadline)

                return go

            _run_threads([run(i) for i in range(k)])
        finally:
            for c in others:
                c.close()
    reference = _single(epochs, target)
    for e in range(epochs):
        for p in peers[1:]:
            for key in reference:
                assert p.history[e][key].tobytes() == peers[0].history[e][key].tobytes()
    for key in reference:
        np.testing.assert_allclose(peers[0].history[-1][key], reference[key], rtol=1e-5, atol=1e-6)
    assert all(p.step._cache_size() == 1 for p in peers)  # no recompilation


def test_newcomer_loads_state_and_continues_in_step() -> None:
    target = 24  # two peers bring 12 samples each, later three bring 8
    x, y = _data(target * 6)
    with (
        Collaboration("join", config=_config(target)) as a,
        Collaboration("join", initial_peers=a.addrs, config=_config(target)) as b,
    ):
        pa, pb = Peer(a, target), Peer(b, target)
        deadline = time.monotonic() + 240

        def epoch_of(peers, e):
            per = target // len(peers)
            return [
                (
                    lambda p=p, i=i: p.train_epoch(
                        x[e * target + i * per : e * target + (i + 1) * per],
                        y[e * target + i * per : e * target + (i + 1) * per],
                        deadline,
                    )
                )
                for i, p in enumerate(peers)
            ]

        for e in range(3):
            _run_threads(epoch_of([pa, pb], e))
        assert pa.epoch == pb.epoch == 3
        with Collaboration("join", initial_peers=a.addrs, config=_config(target)) as c:
            pc = Peer(c, target)
            pc.params, pc.state, epoch = dedloc_jax.sync_state(c, pc.params, pc.state)
            assert epoch == 3 and pc.epoch == 3 and int(pc.state.samples) == 0
            for key in pc.params:
                assert np.asarray(pc.params[key]).tobytes() == pa.history[-1][key].tobytes()
            for e in range(3, 5):
                _run_threads(epoch_of([pa, pb, pc], e))
            for key in pa.params:
                assert np.asarray(pc.params[key]).tobytes() == np.asarray(pa.params[key]).tobytes()
        # The newcomer left; the others keep stepping.
        _run_threads(epoch_of([pa, pb], 5))
        assert pa.epoch == pb.epoch == 6
