"""Peers that failed requests are skipped for a while, the ban doubling per further failure."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class Blacklist:
    """Exponential backoff: the n-th consecutive failure bans for ``base * 2**(n-1)`` seconds."""

    def __init__(self, base: float = 5.0, max_ban: float = 600.0, max_size: int = 10_000):
        self.base = base
        self.max_ban = max_ban
        self.max_size = max_size
        self._entries: OrderedDict[Hashable, tuple[int, float]] = OrderedDict()

    def failed(self, peer: Hashable, now: float) -> float:
        """Record a failure; returns when the ban ends."""
        failures = self._entries.pop(peer, (0, 0.0))[0] + 1
        until = now + min(self.max_ban, self.base * 2 ** min(failures - 1, 62))
        self._entries[peer] = (failures, until)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)
        return until

    def succeeded(self, peer: Hashable) -> None:
        self._entries.pop(peer, None)

    def __contains__(self, peer: object) -> bool:
        """Whether the peer failed lately (banned now or not): a cheap first check."""
        return peer in self._entries

    def is_banned(self, peer: Hashable, now: float) -> bool:
        entry = self._entries.get(peer)
        return entry is not None and now < entry[1]

    def failures(self, peer: Hashable) -> int:
        entry = self._entries.get(peer)
        return entry[0] if entry else 0
