"""The simulated-collaboration helpers, kept importable from here for the tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from dedloc_jax.testing import (
    matchmakers,
    open_sim_attacker,
    open_sim_collaboration,
    open_sim_dhts,
)

__all__ = [
    "matchmakers",
    "open_sim_attacker",
    "open_sim_collaboration",
    "open_sim_dhts",
    "train_steadily",
]


async def train_steadily(
    core: Any,
    i: int,
    params: list[np.ndarray],
    *,
    micro: int,
    rate: float,
    on_step: Callable[[int], None] | None = None,
    serve: bool = True,
) -> None:
    """Peer ``i`` trains forever at ``rate`` samples/s in micro-batches of ``micro``: at each
    step it averages a gradient of ``i + 1`` everywhere, applies it to ``params[i]``, calls
    ``on_step(samples it fed)`` and serves its new state (with ``serve=False`` it serves
    none, as bench.byzantine's peers train)."""
    epoch = 0
    while True:
        samples = 0
        while True:
            await trio.sleep(micro / rate)
            samples += micro
            if core.report(epoch, samples, micro):
                break
        grad = np.full(params[i].shape, float(i + 1), np.float32)
        outcome = await core.average(epoch, [grad], samples)
        params[i] = params[i] + outcome.gradients[0]
        epoch = outcome.epoch
        if on_step is not None:
            on_step(samples)
        if serve:
            await core.share_state([params[i]], epoch)
