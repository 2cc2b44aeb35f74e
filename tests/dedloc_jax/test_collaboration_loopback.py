"""Real sockets: peers in threads on loopback train one model with ``collaborative``."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dedloc_jax
from dedloc_jax import Collaboration, collaborative
from tests.dedloc_jax.loopback import LoopbackPeer, local_config, run_threads, shards_of

DIM = 5
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


def _peer(collab: Collaboration, target: int) -> LoopbackPeer:
    """A trainer with ``collaborative(adam)``."""
    tx = collaborative(optax.adam(0.05), collab, target_batch_size=target)
    return LoopbackPeer(collab, tx, _params(), _loss)


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


@pytest.mark.parametrize("k", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_peers_on_loopback_match_single_process_training(k: int) -> None:
    epochs = 3
    target = k * PER_PEER
    x, y = _data(target * epochs)
    with Collaboration("equiv", config=local_config(target)) as first:
        others = [
            Collaboration("equiv", initial_peers=first.addrs, config=local_config(target))
            for _ in range(k - 1)
        ]
        for c in others:
            c.start()
        try:
            peers = [_peer(c, target) for c in [first, *others]]
            deadline = time.monotonic() + 60

            def run(i: int):
                def go():
                    for e in range(epochs):
                        lo = e * target + i * PER_PEER
                        peers[i].train_epoch(x[lo : lo + PER_PEER], y[lo : lo + PER_PEER], deadline)

                return go

            run_threads([run(i) for i in range(k)])
        finally:
            for c in others:
                c.close()
    # What a peer averaged stays readable after it closed; the rest says it closed.
    assert [o.complete for o in first.history] == [True] * epochs
    assert first.last_outcome == first.history[-1]
    with pytest.raises(RuntimeError, match="closed"):
        _ = first.epoch
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
        Collaboration("join", config=local_config(target)) as a,
        Collaboration("join", initial_peers=a.addrs, config=local_config(target)) as b,
    ):
        pa, pb = _peer(a, target), _peer(b, target)
        deadline = time.monotonic() + 240

        def epoch_of(peers, e):
            return shards_of(x, y, target, deadline, peers, e)

        for e in range(3):
            run_threads(epoch_of([pa, pb], e))
        assert pa.epoch == pb.epoch == 3
        with Collaboration("join", initial_peers=a.addrs, config=local_config(target)) as c:
            pc = _peer(c, target)
            pc.params, pc.state, epoch = dedloc_jax.sync_state(c, pc.params, pc.state)
            assert epoch == 3 and pc.epoch == 3 and int(pc.state.samples) == 0
            for key in pc.params:
                assert np.asarray(pc.params[key]).tobytes() == pa.history[-1][key].tobytes()
            for e in range(3, 5):
                run_threads(epoch_of([pa, pb, pc], e))
            for key in pa.params:
                assert np.asarray(pc.params[key]).tobytes() == np.asarray(pa.params[key]).tobytes()
        # The newcomer left; the others keep stepping.
        run_threads(epoch_of([pa, pb], 5))
        assert pa.epoch == pb.epoch == 6
