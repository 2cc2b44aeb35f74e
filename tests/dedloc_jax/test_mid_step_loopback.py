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
from dedloc_jax.config import MID_STEP_POLL
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


def _reference(cfg: PowerSGD | None, params: dict, sent: list, lowrank: tuple) -> tuple:
    """The parameters after SGD on the round of ``sent`` (a's 16 samples, b's 8), and PowerSGD's
    new ``(errors, q)`` (the NumPy reference of both phases, with error feedback)."""
    if cfg is None:
        mean = [(16 * ga + 8 * gb) / TARGET for ga, gb in zip(*sent, strict=True)]
    else:
        mean, errors, q = reference_round(cfg, sent, *lowrank, [16, 8])
        lowrank = (errors, q)
    mean = jax.tree.unflatten(jax.tree.structure(params), mean)
    return jax.tree.map(lambda p, g: p - LR * g, params, mean), lowrank


def _epoch(
    pa: LoopbackPeer, pb: LoopbackPeer, x: np.ndarray, y: np.ndarray, a: int, at: int
) -> None:
    """b's micro-step ``x[at:at+4]`` hands its accumulator over (8 samples); its next one,
    ``x[at+4:at+8]``, computes while a trains ``x[a:a+16]`` and its round runs, and ends
    after that."""
    _micro(pb, x[at : at + MICRO], y[at : at + MICRO])
    assert int(pb.state.samples) == 8
    deadline = time.monotonic() + 240
    trainer = threading.Thread(target=pa.train_epoch, args=(x[a : a + 16], y[a : a + 16], deadline))
    trainer.start()
    trainer.join(240)
    _micro(pb, x[at + MICRO : at + 2 * MICRO], y[at + MICRO : at + 2 * MICRO])


def _check_round(
    pa: LoopbackPeer, pb: LoopbackPeer, cfg: PowerSGD | None, want: dict, lowrank
) -> None:
    """Both peers stepped together to ``want`` (a round of both: bit-identical), each keeping
    its own new PowerSGD error."""
    for c in (pa.collab, pb.collab):  # one round of both, not a round late, not alone
        assert [(o.group_size, o.complete) for o in c.history][-1] == (2, True)
    for key in pa.params:
        assert np.asarray(pa.params[key]).tobytes() == np.asarray(pb.params[key]).tobytes()
        np.testing.assert_allclose(pb.params[key], want[key], rtol=1e-4, atol=1e-6)
    if cfg is not None:
        for peer, errors in zip((pa, pb), lowrank[0], strict=True):
            for got, e in zip(peer.state.powersgd.error, errors, strict=True):
                np.testing.assert_allclose(got, e, rtol=1e-4, atol=1e-6)


def _a_slow_peer_round(cfg: PowerSGD | None) -> None:
    """Two epochs; in each, a trains 16 samples and b 8, handed over at the end of b's second
    micro-step of the epoch, then a micro-step that lasts until a's round ended."""
    x, y = _data(TARGET * 3)
    config = local_config(TARGET)
    with (
        Collaboration("midstep", config=config) as a,
        LandsEveryStep("midstep", initial_peers=a.addrs, config=config) as b,
    ):
        pa, pb = _peer(a, cfg, mid_step=False), _peer(b, cfg)
        params0 = jax.device_get(pb.params)
        lowrank = None
        if cfg is not None:
            shapes = [np.shape(p) for p in jax.tree.leaves(params0)]
            zero = [[np.zeros(shapes[i]) for i in cfg.plan(shapes).compressed] for _ in "ab"]
            lowrank = (zero, [v.astype(np.float64) for v in initial_q(cfg, shapes)])
        _micro(pb, x[16:20], y[16:20])  # (its first micro-step: no step length known yet)
        _epoch(pa, pb, x, y, 0, 20)
        assert pa.epoch == pb.epoch == 1
        # the averaged gradient: the mean of a's 16 samples and b's 8 (through its micro-step 2)
        sent = [_grad(params0, x[:16], y[:16]), _grad(params0, x[16:24], y[16:24])]
        want, lowrank = _reference(cfg, params0, sent, lowrank)
        _check_round(pa, pb, cfg, want, lowrank)
        # b's micro-step 3 (on the parameters it was computed with) starts epoch 1
        assert int(pb.state.samples) == MICRO
        carried = _grad(params0, x[24:28], y[24:28])
        for got, g in zip(jax.tree.leaves(pb.state.grad_sum), carried, strict=True):
            np.testing.assert_allclose(got, g * MICRO, rtol=1e-5, atol=1e-7)
        # epoch 1 averages it (nothing was lost), handed over with the error of epoch 0
        params1 = jax.device_get(pb.params)
        _epoch(pa, pb, x, y, 28, 44)
        assert pa.epoch == pb.epoch == 2
        mine = [
            (c + g) / 2 for c, g in zip(carried, _grad(params1, x[44:48], y[44:48]), strict=True)
        ]
        want, lowrank = _reference(
            cfg, params1, [_grad(params1, x[28:44], y[28:44]), mine], lowrank
        )
        _check_round(pa, pb, cfg, want, lowrank)
        assert [o.epoch for o in b.history] == [0, 1]
        assert int(pb.state.samples) == MICRO
        # with default settings b announces that it checks mid-step (rounds that expect only
        # such peers matchmake eagerly); a, deciding between micro-steps, announces nothing
        assert b._core()[1].tracker.poll == MID_STEP_POLL and a._core()[1].tracker.poll is None
    assert pb.step._cache_size() == 1  # the hand-over's branches compile with the rest


def test_a_slow_peer_averages_the_accumulator_it_handed_over_in_the_others_round() -> None:
    _a_slow_peer_round(None)


def test_a_slow_powersgd_peer_compresses_the_handed_over_accumulator_with_its_error() -> None:
    _a_slow_peer_round(PowerSGD(rank=1, seed=7, codec="none"))
