"""Exceptions of the DHT (all derive from :class:`p2p.errors.P2PError`)."""

from __future__ import annotations

from p2p.errors import P2PError


class DHTError(P2PError):
    """Base class of the DHT's errors."""


class BootstrapError(DHTError):
    """None of the initial peers answered, so the node cannot join the DHT."""


class InvalidRecordError(DHTError, ValueError):
    """A record was refused by a validator (bad signature, schema violation, bad fields)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
