"""An in-process collaboration of K peers in threads that move in lockstep.

It implements :class:`dedloc_jax.host.CollaborationHost` without any network, so the optax
transform can be tested on its own: every micro-step all peers report together, and an
averaging step computes the weighted mean in a fixed order, so every peer gets the same bits.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from dedloc_jax.history import RoundOutcome


class LockstepGroup:
    def __init__(self, size: int, target_batch_size: int) -> None:
        self.size = size
        self.target = target_batch_size
        self._barrier = threading.Barrier(size)
        self._samples = [0] * size
        self._contrib: list[tuple[list[np.ndarray], int] | None] = [None] * size
        self.epoch = 0
        self.reports = 0
        self.averagings = 0

    def peer(self, index: int) -> LockstepPeer:
        return LockstepPeer(self, index)


class LockstepPeer:
    def __init__(self, group: LockstepGroup, index: int) -> None:
        self.group = group
        self.index = index

    def report_progress(self, epoch: int, samples: int, batch_size: int) -> bool:
        g = self.group
        g._samples[self.index] = samples
        g._barrier.wait()
        ready = sum(g._samples) >= g.target
        g._barrier.wait()
        if self.index == 0:
            g.reports += 1
        return ready

    def average_gradients(
        self, epoch: int, gradients: Sequence[np.ndarray], samples: int
    ) -> RoundOutcome:
        g = self.group
        g._contrib[self.index] = ([np.asarray(x, np.float32) for x in gradients], samples)
        g._barrier.wait()
        total = sum(c[1] for c in g._contrib)
        out = []
        for i in range(len(gradients)):
            acc = np.zeros_like(g._contrib[0][0][i])
            for grads, w in g._contrib:
                acc += grads[i] * np.float32(w)
            out.append(acc / np.float32(total))
        g._barrier.wait()
        if self.index == 0:
            g.epoch = epoch + 1
            g.averagings += 1
        return RoundOutcome(epoch, g.size, average=out)
