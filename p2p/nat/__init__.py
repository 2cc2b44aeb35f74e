"""NAT traversal: observed addresses, reachability (AutoNAT), relays, circuits, client mode.

Typical use (before opening the DHT, so that it advertises relayed addresses)::

    async with open_node(identity, listen=[...]) as node:
        async with open_nat(node, peers=bootstrap) as nat:
            async with open_dht(node, initial_peers=bootstrap, client_mode=nat.client_mode):
                ...
"""

from p2p.nat.autonat import AutoNATConfig, DialBackAnswer, Reachability, conclude
from p2p.nat.circuit import CircuitStream, CircuitTransport, attach, circuit_addr
from p2p.nat.discovery import nat_validators
from p2p.nat.errors import RelayRefused
from p2p.nat.observed import IdentifyResult, ObservedAddrs, identify
from p2p.nat.portmap import PortMapConfig, PortMapper, PortMapping
from p2p.nat.reachability import NATConfig, NATManager, Role, decide_role, open_nat
from p2p.nat.relay import RelayConfig, RelayService, RelayStats

__all__ = [
    "AutoNATConfig",
    "CircuitStream",
    "CircuitTransport",
    "DialBackAnswer",
    "IdentifyResult",
    "NATConfig",
    "NATManager",
    "ObservedAddrs",
    "PortMapConfig",
    "PortMapper",
    "PortMapping",
    "Reachability",
    "RelayConfig",
    "RelayRefused",
    "RelayService",
    "RelayStats",
    "Role",
    "attach",
    "circuit_addr",
    "conclude",
    "decide_role",
    "identify",
    "nat_validators",
    "open_nat",
]
