"""Where a DHT node's bytes go: each request it makes, tallied by message and purpose.

The node's mux counts bytes per protocol (``dht.find``, ``dht.store``, ...), which says how
much the DHT costs but not which of its users pay: a ``dht.store`` may be a progress publish, a
relay advert or a republish, and a ``dht.find`` the lookup before any of them, a bucket
refresh or a follower's relocation. Callers name their purpose with :func:`purpose` (it holds
for the tasks they start); a request made under none is named after its key. Each request's
tally is its encoded request plus the answer it got (what both sides wrote, framing left out).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import msgpack

_PURPOSE: ContextVar[str | None] = ContextVar("dht_purpose", default=None)


@contextmanager
def purpose(name: str) -> Iterator[None]:
    """Requests made inside the block (and in the tasks it starts) count as ``name``. Work a
    request sets off in the background (a handoff, an eviction's ping) names its own."""
    token = _PURPOSE.set(name)
    try:
        yield
    finally:
        _PURPOSE.reset(token)


def current_purpose() -> str | None:
    return _PURPOSE.get()


@contextmanager
def default_purpose(name: str) -> Iterator[None]:
    """``name`` unless the caller named one (a republish's lookups stay the republish's)."""
    if _PURPOSE.get() is not None:
        yield
    else:
        with purpose(name):
            yield


def key_kind(key: str) -> str:
    """A key with its numbers and owner markers blanked: one name per kind of key
    (``run.group.#``, ``nat.addrs.[]``), so that tallies do not grow with epochs or peers."""
    return re.sub(r"\d+", "#", re.sub(r"\[[^\]]*\]", "[]", key))[:80]


def encoded_size(message: Any) -> int:
    """Bytes of ``message`` in msgpack (0 for what does not encode: it is only a tally)."""
    try:
        return len(msgpack.packb(message, use_bin_type=True))
    except (TypeError, ValueError, OverflowError):
        return 0


class Traffic:
    """Requests and bytes by ``message/purpose``."""

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()

    def add(self, message: str, label: str | None, size: int) -> None:
        name = f"{message}/{label or 'other'}"
        self.bytes[name] += size
        self.requests[name] += 1
