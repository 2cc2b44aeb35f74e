"""Exception classes of the p2p layer.

Every error raised by p2p code derives from :class:`P2PError`, so callers can catch the
layer's failures precisely without a broad ``except Exception``.
"""

from __future__ import annotations


class P2PError(Exception):
    """Base class of every error raised by the p2p layer."""


class IdentityError(P2PError):
    """A key or peer ID is malformed, or a key file cannot be used."""


class MultiaddrError(P2PError, ValueError):
    """A multiaddr text or component is malformed."""


class HandshakeError(P2PError):
    """The secure-channel handshake failed (bad signature, wrong peer, garbage, timeout)."""


class PeerIDMismatch(HandshakeError):
    """The key that answered a dial does not match the ``/p2p/`` part of the dialed address."""


class ConnectionClosed(P2PError):
    """The connection or stream is closed (cleanly, by reset, or after a protocol violation)."""


class ProtocolError(P2PError):
    """The remote side broke the wire protocol (bad frame, bad message, limit exceeded)."""


class DialError(P2PError):
    """No connection could be made to a peer (unreachable, refused, timed out, unknown address)."""


class ListenError(DialError):
    """A listen address could not be bound (in use, not this host's, not permitted)."""


class RPCError(P2PError):
    """A remote procedure call failed; ``remote`` tells whether the handler itself raised."""

    def __init__(self, message: str, *, remote: bool = False) -> None:
        super().__init__(message)
        self.remote = remote


class RPCTimeout(RPCError):
    """A call did not complete before its deadline."""
