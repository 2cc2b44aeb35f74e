"""Real sockets: a blocking peer of ``collaborative`` averages mid-micro-step.

Peer b's micro-step is long: the target lands while it computes. At the end of the micro-step
before it, the transform hands b's accumulator over (:mod:`dedloc_jax.handover`); b's
collaboration begins the round once it is due, in the same round as peer a, and the long
micro-step's gradient starts b's next epoch. Before, b's host call waited for its micro-step,
and a's round went on without b (or b averaged a micro-step it had not yet computed).

b's collaboration says the target always lands within the next micro-step (the ETA is a
heuristic; what is checked here is what the hand-over averages and keeps), so the test does
not depend on timing.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import optax

import dedloc_jax
from dedloc_jax import Collaboration, PowerSGD
from dedloc_jax.powersgd import initial_q, reference_round
from tests.dedloc_jax.loopback import MICRO, LoopbackPeer, local_config
from tests.dedloc_jax.test_powersgd import _data, _loss, _params

TARGET = 24
LR = 0.05


class LandsEveryStep(Collaboration):
    """A collaboration whose ETA always lands within the next micro-step."""

    def lands_within(self, seconds: float) -> bool:
        return True


def _peer(collab: Collaboration, cfg: PowerSGD | None, mid_step: bool = True) -> LoopbackPeer:
    tx = dedloc_jax.collaborative(
        optax.sgd(LR), collab, target_batch_size=TARGET, compression=cfg, mid_step=mid_step
    )
    return LoopbackPeer(collab, tx, _params(), _loss)


def _grad(params: dict, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    return [np.asarray(g) for g in jax.tree.leaves(jax.grad(_loss)(params, x, y))]


def _micro(peer: LoopbackPeer, x: np.ndarray, y: np.ndarray) -> None:
    peer.params, peer.state = peer.step(peer.params, peer.state, x, y, len(x))


def _a_slow_peer_round(cfg: PowerSGD | None) -> None:
    """Epoch 0: a trains 16 samples; b 8, then a micro-step (x[24:28]) that lasts until a's
    round ended. Epoch 1: a 16 more, b 4 more beside the 4 it carried over."""
    x, y = _data(TARGET * 3)
    deadline = time.monotonic() + 240
    config = local_config(TARGET)
    with (
        Collaboration("midstep", config=config) as a,
        LandsEveryStep("midstep", initial_peers=a.addrs, config=config) as b,
    ):
        pa, pb = _peer(a, cfg, mid_step=False), _peer(b, cfg)
        params0 = jax.device_get(pb.params)
        for s in (16, 20):  # b's micro-steps 1 and 2: the second hands its 8 samples over
            _micro(pb, x[s : s + MICRO], y[s : s + MICRO])
        assert int(pb.state.samples) == 8 and pb.epoch == 0
        # b's micro-step 3 computes while a trains and its round runs: it ends after that
        trainer = threading.Thread(target=pa.train_epoch, args=(x[:16], y[:16], deadline))
        trainer.start()
        trainer.join(240)
        _micro(pb, x[24:28], y[24:28])
        assert pa.epoch == pb.epoch == 1
        for c in (a, b):  # one round of both, not a round late, not alone
            assert [(o.epoch, o.group_size, o.complete) for o in c.history] == [(0, 2, True)]
        for key in pa.params:
            assert np.asarray(pa.params[key]).tobytes() == np.asarray(pb.params[key]).tobytes()
        # the averaged gradient: the mean of a's 16 samples and b's 8 (through micro-step 2)
        sent = [_grad(params0, x[:16], y[:16]), _grad(params0, x[16:24], y[16:24])]
        treedef = jax.tree.structure(params0)
        if cfg is None:
            mean = [(16 * ga + 8 * gb) / TARGET for ga, gb in zip(*sent, strict=True)]
        else:
            shapes = [np.shape(p) for p in jax.tree.leaves(params0)]
            q = [v.astype(np.float64) for v in initial_q(cfg, shapes)]
            zero = [[np.zeros(shapes[i]) for i in cfg.plan(shapes).compressed] for _ in sent]
            mean, errors, _ = reference_round(cfg, sent, zero, q, [16, 8])
            for peer, want in zip((pa, pb), errors, strict=True):  # the new error, kept
                for got, e in zip(peer.state.powersgd.error, want, strict=True):
                    np.testing.assert_allclose(got, e, rtol=1e-4, atol=1e-6)
        want = jax.tree.map(lambda p, g: p - LR * g, params0, jax.tree.unflatten(treedef, mean))
        for key in want:
            np.testing.assert_allclose(pb.params[key], want[key], rtol=1e-4, atol=1e-6)
        # micro-step 3's gradient (on the parameters it was computed with) starts epoch 1
        assert int(pb.state.samples) == MICRO
        carried = _grad(params0, x[24:28], y[24:28])
        for got, g in zip(jax.tree.leaves(pb.state.grad_sum), carried, strict=True):
            np.testing.assert_allclose(got, g * MICRO, rtol=1e-5, atol=1e-7)
        # epoch 1 averages it: nothing was lost
        params1 = jax.device_get(pb.params)
        pb.history.append(params1)
        runs = [
            threading.Thread(target=pa.train_epoch, args=(x[28:44], y[28:44], deadline)),
            threading.Thread(target=pb.train_epoch, args=(x[44:48], y[44:48], deadline)),
        ]
        for t in runs:
            t.start()
        for t in runs:
            t.join(240)
        assert pa.epoch == pb.epoch == 2
        assert [o.group_size for o in b.history] == [2, 2]
        for key in pa.params:
            assert np.asarray(pa.params[key]).tobytes() == np.asarray(pb.params[key]).tobytes()
        if cfg is None:
            ga, g4 = _grad(params1, x[28:44], y[28:44]), _grad(params1, x[44:48], y[44:48])
            mean = [
                (16 * u + MICRO * c + MICRO * v) / TARGET
                for u, c, v in zip(ga, carried, g4, strict=True)
            ]
            want = jax.tree.map(lambda p, g: p - LR * g, params1, jax.tree.unflatten(treedef, mean))
            for key in want:
                np.testing.assert_allclose(pb.params[key], want[key], rtol=1e-4, atol=1e-6)
    assert pb.step._cache_size() == 1  # the hand-over's branches compile with the rest


def test_a_slow_peer_averages_the_accumulator_it_handed_over_in_the_others_round() -> None:
    _a_slow_peer_round(None)


def test_a_slow_powersgd_peer_compresses_the_handed_over_accumulator_with_its_error() -> None:
    _a_slow_peer_round(PowerSGD(rank=1, seed=7, codec="none"))
