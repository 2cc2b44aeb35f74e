"""Trainers on loopback for the real-socket tests (``test_collaboration_loopback``,
``test_powersgd_loopback``): a Collaboration, a jitted step of a transform on it, and each
epoch's shard, fed in micro-batches by peers in threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

import dedloc_jax
from dedloc_jax import Collaboration, CollaborationConfig

MICRO = 4


def local_config(target: int) -> CollaborationConfig:
    """A loopback run whose peers each bring exactly their shard of the batch, so the estimate
    must not extrapolate (an idle peer would otherwise be counted as still accumulating)."""
    config = CollaborationConfig.local_demo(target)
    return config.replace(
        rounds=config.rounds.replace(matchmaking_time=0.5),
        progress=config.progress.replace(extrapolate=False),
    )


class LoopbackPeer:
    """One trainer: ``collab``, a jitted step of ``tx`` (a transform on ``collab``) on
    ``loss``, and the parameters after each of its epochs (``history``)."""

    def __init__(
        self,
        collab: Collaboration,
        tx: optax.GradientTransformationExtraArgs,
        params: Any,
        loss: Callable[..., Any],
    ) -> None:
        self.collab = collab
        self.tx = tx
        self.params = params
        self.state = tx.init(params)

        @jax.jit
        def step(params, state, xb, yb, batch_size):
            grads = jax.grad(loss)(params, xb, yb)
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


def shards_of(
    x: np.ndarray,
    y: np.ndarray,
    target: int,
    deadline: float,
    members: list[LoopbackPeer],
    e: int,
) -> list[Callable[[], None]]:
    """Epoch ``e`` of ``members``: each trains its equal shard of that epoch's ``target``."""
    per = target // len(members)
    lo = e * target
    return [
        (
            lambda p=p, i=i: p.train_epoch(
                x[lo + i * per : lo + (i + 1) * per], y[lo + i * per : lo + (i + 1) * per], deadline
            )
        )
        for i, p in enumerate(members)
    ]


def run_threads(fns: list[Callable[[], None]]) -> None:
    """Run ``fns`` in threads; re-raise the first error in the caller's thread."""
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
