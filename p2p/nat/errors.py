"""Errors of NAT traversal: a relay's refusal carries its reason to the dialer."""

from __future__ import annotations

from p2p.errors import DialError


class RelayRefused(DialError):
    """A relay refused a reservation or a circuit; ``reason`` says why (limits, no reservation)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"relay refused: {reason}")
        self.reason = reason
