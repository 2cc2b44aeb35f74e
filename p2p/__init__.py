"""The p2p layer: identities, secure multiplexed connections, RPC and a simulated network.

Pure Python on trio; nothing here imports JAX or the training code. Typical use::

    async with open_node(Identity.generate()) as node:
        node.add_handler("echo", echo)
        reply = await node.call("/ip4/1.2.3.4/tcp/4001/p2p/<id>", "echo", {"x": 1})

Non-async code uses :class:`SyncNode` (over the one bridge thread, :class:`TrioThread`).
"""

from __future__ import annotations

from p2p.bridge import SyncNode, TrioThread
from p2p.errors import (
    ConnectionClosed,
    DialError,
    HandshakeError,
    IdentityError,
    MultiaddrError,
    P2PError,
    PeerIDMismatch,
    ProtocolError,
    RPCError,
    RPCTimeout,
)
from p2p.identity import Identity, PeerID, verify_signature
from p2p.multiaddr import Multiaddr
from p2p.node import Connection, Node, NodeConfig, open_node
from p2p.peerstore import PeerStore
from p2p.rpc import CallContext, MessageStream
from p2p.secure import SecureChannel, secure_inbound, secure_outbound
from p2p.sim import SimNetwork
from p2p.transport import ConnHandler, TcpTransport, Transport

__all__ = [
    "CallContext",
    "ConnHandler",
    "Connection",
    "ConnectionClosed",
    "DialError",
    "HandshakeError",
    "Identity",
    "IdentityError",
    "MessageStream",
    "Multiaddr",
    "MultiaddrError",
    "Node",
    "NodeConfig",
    "P2PError",
    "PeerID",
    "PeerIDMismatch",
    "PeerStore",
    "ProtocolError",
    "RPCError",
    "RPCTimeout",
    "SecureChannel",
    "SimNetwork",
    "SyncNode",
    "TcpTransport",
    "Transport",
    "TrioThread",
    "open_node",
    "secure_inbound",
    "secure_outbound",
    "verify_signature",
]
