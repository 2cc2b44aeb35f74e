"""Finding relays and peers' (relayed) addresses through the DHT.

Relays advertise themselves under ``nat.relays``, one subkey per relay; a peer publishes its
current addresses under ``nat.addrs.[owner:<id>]``. Both carry an owner marker, so the DHT
accepts them only signed by that peer: nobody can advertise a relay, or addresses, for
someone else. (An address list could still be stale; the end-to-end handshake is what
proves who answers at an address.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p2p.dht import KeySchema, ListOf, follower_replicas, owner_marker
from p2p.dht.records import owner_markers
from p2p.errors import IdentityError, MultiaddrError
from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr

if TYPE_CHECKING:
    from p2p.dht import DHT
    from p2p.node import Node

logger = logging.getLogger(__name__)

RELAYS_KEY = "nat.relays"
MAX_ADDRS = 8
MAX_ADDR_CHARS = 512


@dataclass(frozen=True)
class AddrText:
    """A multiaddr in text form, bounded (a DHT schema spec)."""

    def check(self, value: Any, path: str) -> str | None:
        if not isinstance(value, str) or len(value) > MAX_ADDR_CHARS:
            return f"{path} must be a multiaddr of at most {MAX_ADDR_CHARS} characters"
        try:
            Multiaddr.parse(value)
        except MultiaddrError as e:
            return f"{path} is not a multiaddr: {e}"
        return None


def nat_validators() -> list[KeySchema]:
    """Schemas of the NAT keys (every node of a public run installs them, so a writer cannot
    blank or fill ``nat.relays`` with values of another shape): a relay's advert and a peer's
    published addresses are short lists of multiaddrs, signed by their owner."""
    addrs = ListOf(AddrText(), max_len=MAX_ADDRS)
    return [
        KeySchema("relay advert", r"nat\.relays", addrs),
        KeySchema(
            "published addresses", r"nat\.addrs\.\[owner:[^\]]+\]", addrs, owned_subkeys=False
        ),
    ]


def addrs_key(peer: PeerID) -> str:
    return f"nat.addrs.{owner_marker(peer)}"


def _parse_addrs(value: Any, peer: PeerID) -> list[Multiaddr]:
    """Addresses of ``peer`` from a DHT value; entries naming someone else are dropped."""
    out: list[Multiaddr] = []
    if not isinstance(value, list):
        return out
    for text in value[:MAX_ADDRS]:
        try:
            ma = Multiaddr.parse(text)
        except MultiaddrError:
            continue
        if ma.peer_id == peer:
            out.append(ma)
    return out


def advert_replicas(dht: DHT) -> int:
    """Nodes an advert is stored on: twice the holders a get stops at (a writer renews it, and
    a renewal repairs what churn took), not the DHT's full replication: 20 replicas per relay
    renewal were a fifth of a 12-peer DiLoCo run's stores (issue 48)."""
    return follower_replicas(dht.config)


async def advertise_relay(dht: DHT, node: Node, ttl: float = 600.0) -> bool:
    """Announce ``node`` (its direct addresses) as a relay; True if some DHT node stored it."""
    addrs = [str(a) for a in node.addrs if not a.is_relayed][:MAX_ADDRS]
    result = await dht.store(
        RELAYS_KEY,
        addrs,
        dht.now() + ttl,
        subkey=owner_marker(node.peer_id),
        replicas=advert_replicas(dht),
    )
    return bool(result.ok)


async def find_relays(dht: DHT, limit: int = 8) -> list[Multiaddr]:
    """Direct addresses of advertised relays (one per relay, at most ``limit``)."""
    found = await dht.get(RELAYS_KEY)
    out: list[Multiaddr] = []
    if not isinstance(found, dict):
        return out
    for subkey, item in found.items():
        names = owner_markers(subkey)
        if len(names) != 1:
            continue
        try:
            relay = PeerID.from_base58(names[0])
        except IdentityError:
            continue
        addrs = [a for a in _parse_addrs(item.value, relay) if not a.is_relayed]
        if relay != dht.peer_id and addrs:
            out.append(addrs[0])
        if len(out) >= limit:
            break
    return out


async def publish_addrs(dht: DHT, node: Node, ttl: float = 600.0) -> bool:
    """Publish ``node``'s current addresses (relayed ones included) for others to find."""
    addrs = [str(a) for a in node.addrs][:MAX_ADDRS]
    result = await dht.store(
        addrs_key(node.peer_id), addrs, dht.now() + ttl, replicas=advert_replicas(dht)
    )
    return bool(result.ok)


async def lookup_addrs(dht: DHT, peer: PeerID) -> list[Multiaddr]:
    """``peer``'s published addresses (also added to the node's peerstore)."""
    found = await dht.get(addrs_key(peer))
    if found is None or isinstance(found, dict):
        return []
    addrs = _parse_addrs(found.value, peer)
    if addrs:
        dht.node.peerstore.add_addrs(peer, addrs)
    return addrs
