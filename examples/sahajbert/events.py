"""A trainer's event file (``trainer --events FILE``): what it is doing, one JSON line per event.

Written for watchdogs such as ``python -m bench.chaos --peer sahajbert``, which kills the
trainer at chosen moments and checks afterwards that peers in step held the same parameters.
Each line is flushed at once (a SIGKILL loses at most the line being written) and carries
``t`` (unix time), ``pid`` and ``ev``:

- ``phase``: ``loading`` (a state download), ``compiling`` (at the start, after the first
  load), ``accumulating`` or ``averaging`` (matchmaking and the all-reduce);
- ``beat``: a heartbeat while accumulating (at most twice a second);
- ``epoch``: after each collaboration step (``how`` ``step``, ``group``: the averaging group's
  size) or state load (``how`` ``load``): the epoch, the SHA-256 of the parameters that
  peers in step hold bit for bit (``digest``; in DiLoCo mode the outer parameters), the mean
  loss and whether everything is finite.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np


def params_digest(params: Any) -> str:
    """The first 16 hex digits of the SHA-256 of every parameter's bytes, in tree order."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(params)):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()[:16]


def finite(tree: Any) -> bool:
    return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(tree))


class EventLog:
    """Appends events to ``path``; every method is a no-op without a path."""

    def __init__(self, path: Path | None) -> None:
        # held open for the process's life: one line per event, flushed (line buffering)
        self._f = None if path is None else Path(path).open("a", buffering=1)  # noqa: SIM115
        self._pid = os.getpid()
        self._last_beat = 0.0

    def write(self, ev: str, **fields: Any) -> None:
        if self._f is not None:
            row = {"t": time.time(), "pid": self._pid, "ev": ev, **fields}
            self._f.write(json.dumps(row) + "\n")

    def phase(self, name: str, **fields: Any) -> None:
        self.write("phase", phase=name, **fields)

    def beat(self, epoch: int) -> None:
        now = time.monotonic()
        if self._f is not None and now - self._last_beat >= 0.5:
            self._last_beat = now
            self.write("beat", epoch=epoch)

    def epoch(self, epoch: int, how: str, params: Any, **fields: Any) -> None:
        if self._f is not None:
            ok = finite(params) and all(
                np.isfinite(v) for v in fields.values() if isinstance(v, float)
            )
            self.write(
                "epoch", epoch=epoch, how=how, digest=params_digest(params), finite=ok, **fields
            )


class PhaseHost:
    """The collaboration as ``collaborative`` and ``keep_in_step`` use it, marking the
    averaging and loading phases in the event log; everything else is the collaboration's."""

    def __init__(self, collab: Any, events: EventLog) -> None:
        self._collab = collab
        self._events = events
        self._handed: int | None = None  # the epoch of the accumulator handed over

    def __getattr__(self, name: str) -> Any:
        return getattr(self._collab, name)

    # Declared, not only forwarded: the transforms check their host against typed protocols
    # (dedloc_jax.host), which look at the class, not at __getattr__.
    def report_progress(self, epoch: int, samples: int, batch_size: int) -> bool:
        return self._collab.report_progress(epoch, samples, batch_size)

    def use_target(self, target: int) -> None:
        self._collab.use_target(target)

    def start_averaging(self, *args: Any, **kw: Any) -> None:
        self._collab.start_averaging(*args, **kw)

    def poll_averaging(self) -> Any:
        return self._collab.poll_averaging()

    def average_gradients(self, epoch: int, gradients: Any, samples: int, **kw: Any) -> Any:
        self._events.phase("averaging", epoch=epoch)
        try:
            return self._collab.average_gradients(epoch, gradients, samples, **kw)
        finally:
            self._events.phase("accumulating", epoch=epoch + 1)

    # A blocking trainer averages mid-micro-step (dedloc_jax.host.MidStepHost): its
    # accumulator is in the averaging from the hand-over until the take-over's outcome.
    def report_whole_steps(self, epoch: int, samples: int, batch_size: int) -> bool:
        return self._collab.report_whole_steps(epoch, samples, batch_size)

    def lands_within(self, seconds: float) -> bool:
        return self._collab.lands_within(seconds)

    def hand_over(self, epoch: int, gradients: Any, samples: int, **kw: Any) -> None:
        self._collab.hand_over(epoch, gradients, samples, **kw)
        self._handed = epoch
        self._events.phase("averaging", epoch=epoch)

    def take_over(self) -> Any:
        epoch, self._handed = self._handed, None
        outcome = self._collab.take_over()
        if epoch is not None:  # (the micro-step in flight counts toward the next epoch)
            self._events.phase("accumulating", epoch=epoch if outcome is None else epoch + 1)
        return outcome

    def load_state(self, **kw: Any) -> Any:
        self._events.phase("loading")
        return self._collab.load_state(**kw)
