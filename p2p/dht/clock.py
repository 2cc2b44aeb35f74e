"""DHT time: the local clock corrected by the median offset of peers' clocks.

Expirations are absolute, so nodes must roughly agree on "now". Every DHT response carries the
responder's raw local clock reading. The caller estimates that peer's offset as
``peer_time - (sent + received) / 2`` (NTP-style, assuming symmetric delay), keeps the latest
offset of up to ``samples`` recently heard peers, and defines

    dht_time = local_time + median(offsets of sampled peers, plus 0 for itself)

Offsets larger than ``max_skew`` are ignored as garbage. The median resists a minority of
peers with wild or lying clocks. Peers report their raw clock (not their corrected DHT time),
so corrections never feed back on each other. In simulations the local clock is trio's
(virtual) clock plus an optional fixed skew.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable


class DHTClock:
    def __init__(
        self,
        local_time: Callable[[], float] = time.time,
        *,
        samples: int = 64,
        max_skew: float = 3600.0,
    ) -> None:
        self.local_time = local_time
        self.samples = samples
        self.max_skew = max_skew
        self._offsets: OrderedDict[Hashable, float] = OrderedDict()
        self._offset: float | None = 0.0  # None: recompute the median on next use

    def now(self) -> float:
        """The current DHT time."""
        return self.local_time() + self.offset

    @property
    def offset(self) -> float:
        if self._offset is None:
            self._offset = statistics.median([0.0, *self._offsets.values()])
        return self._offset

    def observe(self, peer: Hashable, peer_time: object, sent: float, received: float) -> None:
        """Record a peer's reported local time from a response (times are local readings)."""
        if not isinstance(peer_time, int | float) or isinstance(peer_time, bool):
            return
        offset = float(peer_time) - (sent + received) / 2
        if not abs(offset) <= self.max_skew:  # also drops NaN
            return
        self._offsets.pop(peer, None)
        self._offsets[peer] = offset
        while len(self._offsets) > self.samples:
            self._offsets.popitem(last=False)
        self._offset = None
