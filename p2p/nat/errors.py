"""Errors of NAT traversal: a relay's refusal carries its reason to the dialer; port mapping."""

from __future__ import annotations

from p2p.errors import DialError, P2PError


class RelayRefused(DialError):
    """A relay refused a reservation or a circuit; ``reason`` says why (limits, no reservation)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"relay refused: {reason}")
        self.reason = reason


class PortMapError(P2PError):
    """No port mapping from the home router: it speaks no such protocol, or answered garbage."""


class PortMapRefused(PortMapError):
    """The router answered and refused the request (its reason or error code in the text)."""


class OtherProtocol(PortMapRefused):
    """The router answered in the other protocol (PCP to NAT-PMP, or the reverse): asking it
    again in this one, e.g. for another port, is pointless."""
