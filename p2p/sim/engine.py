"""A tiny discrete-event engine in virtual time: the simulator's only clock-driven machinery.

Pure logic, no trio: the simulated network calls :meth:`Engine.run_until` with
``trio.current_time()`` whenever a task touches it, and one waiting task sleeps until
:meth:`Engine.next_time`, so every event fires at its exact virtual time without a task or a
trio timer per event. Ties are broken by scheduling order, which keeps runs deterministic.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any


class Event:
    """A scheduled callback; :meth:`cancel` makes it a no-op (it is dropped lazily)."""

    __slots__ = ("time", "seq", "fn", "args", "alive", "owner")

    def __init__(
        self, time: float, seq: int, fn: Callable[..., None], args: tuple[Any, ...], owner: Any
    ) -> None:
        self.time = time
        self.seq = seq
        self.fn = fn
        self.args = args
        self.alive = True
        self.owner = owner  # whoever this event will wake, if known (a hint for the waker)

    def cancel(self) -> None:
        self.alive = False

    def __lt__(self, other: Event) -> bool:
        return (self.time, self.seq) < (other.time, other.seq)


class Engine:
    """Events ordered by (time, scheduling order); time only moves forward.

    ``on_new_head``: called whenever a newly scheduled event becomes the earliest (the
    simulated network wakes its waiting task then).
    """

    def __init__(self, on_new_head: Callable[[], None] | None = None) -> None:
        self._heap: list[Event] = []
        self._seq = 0
        self.now = -math.inf
        self.on_new_head = on_new_head
        self.pending: Callable[[], bool] | None = None
        self.flush: Callable[[], bool] | None = None

    def defer_to(self, pending: Callable[[], bool], flush: Callable[[], bool]) -> None:
        """Work deferred within an instant: while ``pending()``, :meth:`next_time` is now;
        ``flush()`` does it (returning whether it did anything) before time moves on. A method,
        not a constructor argument: the one deferring (the fluid model) schedules on this
        engine, so it is made after it."""
        self.pending = pending
        self.flush = flush

    def at(self, time: float, fn: Callable[..., None], *args: Any, owner: Any = None) -> Event:
        """Schedule ``fn(*args)`` at ``time`` (clamped to now)."""
        if time < self.now:
            time = self.now
        ev = Event(time, self._seq, fn, args, owner)
        self._seq += 1
        heap = self._heap
        heapq.heappush(heap, ev)
        if heap[0] is ev and self.on_new_head is not None:
            self.on_new_head()
        return ev

    def peek(self) -> Event | None:
        """The earliest live event, or None."""
        heap = self._heap
        while heap and not heap[0].alive:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def next_time(self) -> float:
        """Time of the earliest live event (now, if work is pending for this instant), or inf."""
        if self.pending is not None and self.pending():
            return self.now
        ev = self.peek()
        return ev.time if ev is not None else math.inf

    def run_until(self, time: float) -> None:
        """Fire every live event due at or before ``time``, in order, then set now = time.

        Before virtual time moves past the current instant, ``flush`` (if set) runs once more
        for work deferred within the instant (it returns whether it did anything).
        """
        heap = self._heap
        while True:
            while heap and not heap[0].alive:
                heapq.heappop(heap)
            nxt = heap[0].time if heap else math.inf
            if nxt > self.now and time > self.now and self.flush is not None and self.flush():
                continue
            if nxt > time:
                break
            ev = heapq.heappop(heap)
            ev.alive = False
            if ev.time > self.now:
                self.now = ev.time
            ev.fn(*ev.args)
        if time > self.now:
            self.now = time
