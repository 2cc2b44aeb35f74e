"""Real sockets: PowerSGD's two phases through the collaboration's butterfly all-reduce.

Two peers in threads on loopback train with ``collaborative(compression=PowerSGD(...))``: bit-
identical parameters on both after every step, equal to the NumPy reference replay (factors sent
uncompressed, ``codec="none"``); then a newcomer loads the state (the others' ``Q``, a zero
error) and the three step on in step.
"""

from __future__ import annotations

import time

import numpy as np
import optax

import dedloc_jax
from dedloc_jax import Collaboration, PowerSGD
from tests.dedloc_jax.loopback import LoopbackPeer, local_config, run_threads, shards_of
from tests.dedloc_jax.test_powersgd import _data, _loss, _params, _replay


def _peer(collab: Collaboration, target: int, cfg: PowerSGD, overlap: bool = False) -> LoopbackPeer:
    """A trainer with ``collaborative(sgd, compression=cfg)``."""
    tx = dedloc_jax.collaborative(
        optax.sgd(0.05), collab, target_batch_size=target, compression=cfg, overlap=overlap
    )
    return LoopbackPeer(collab, tx, _params(), _loss)


def test_powersgd_with_overlap_on_loopback_is_bit_identical() -> None:
    """Delayed updates: both phases run in the background round."""
    cfg = PowerSGD(rank=2, seed=1)
    target = 16
    x, y = _data(target * 3)
    with (
        Collaboration("psgd-overlap", config=local_config(target)) as a,
        Collaboration("psgd-overlap", initial_peers=a.addrs, config=local_config(target)) as b,
    ):
        peers = [_peer(a, target, cfg, overlap=True), _peer(b, target, cfg, overlap=True)]
        deadline = time.monotonic() + 240
        for e in range(3):
            run_threads(shards_of(x, y, target, deadline, peers, e))
        pa, pb = peers
        assert pa.epoch == pb.epoch == 3
        for e in range(3):
            for key in pa.history[e]:
                assert pa.history[e][key].tobytes() == pb.history[e][key].tobytes()
        assert all(o.complete and o.group_size == 2 for o in a.history)
        assert np.abs(pa.state.powersgd.error[0]).max() > 0


def test_powersgd_peers_on_loopback_are_bit_identical_and_match_the_reference() -> None:
    cfg = PowerSGD(rank=1, seed=7, codec="none")
    target, epochs = 24, 3
    x, y = _data(target * 6)
    with (
        Collaboration("psgd", config=local_config(target)) as a,
        Collaboration("psgd", initial_peers=a.addrs, config=local_config(target)) as b,
    ):
        peers = [_peer(a, target, cfg), _peer(b, target, cfg)]
        deadline = time.monotonic() + 240

        def epoch_of(members, e):
            return shards_of(x, y, target, deadline, members, e)

        for e in range(epochs):
            run_threads(epoch_of(peers, e))
        pa, pb = peers
        for e in range(epochs):
            for key in pa.history[e]:
                assert pa.history[e][key].tobytes() == pb.history[e][key].tobytes()
        assert all(o.complete and o.group_size == 2 for o in a.history)
        want = _replay(2, epochs, target // 2, cfg, (x, y))
        for key in want:
            np.testing.assert_allclose(pa.history[-1][key], want[key], rtol=1e-4, atol=1e-6)
        assert np.abs(pa.state.powersgd.error[0]).max() > 0
        with Collaboration("psgd", initial_peers=a.addrs, config=local_config(target)) as c:
            pc = _peer(c, target, cfg)
            pc.params, pc.state, epoch = dedloc_jax.sync_state(c, pc.params, pc.state)
            assert epoch == epochs
            assert not np.asarray(pc.state.powersgd.error[0]).any()  # never served
            assert np.asarray(pc.state.powersgd.q[0]).tobytes() == (
                np.asarray(pa.state.powersgd.q[0]).tobytes()
            )
            for e in range(epochs, epochs + 2):
                run_threads(epoch_of([pa, pb, pc], e))
            for p in (pb, pc):
                for key in pa.params:
                    assert np.asarray(p.params[key]).tobytes() == (
                        np.asarray(pa.params[key]).tobytes()
                    )
    assert all(p.step._cache_size() == 1 for p in (pa, pb, pc))
