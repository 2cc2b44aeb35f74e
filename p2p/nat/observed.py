"""Observed addresses: peers tell each other which address a connection came from.

Behind a NAT a node's listen address (``10.0.0.5:4001``) is not what others see
(``203.0.113.7:51234``). The ``nat.identify`` RPC answers with the caller's observed address
and the responder's own listen addresses; :class:`ObservedAddrs` keeps what several peers
reported, so a single liar cannot steer us, and proposes dial-back candidates from it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p2p.errors import MultiaddrError, ProtocolError
from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr
from p2p.rpc import CallContext

if TYPE_CHECKING:
    from p2p.node import Node

logger = logging.getLogger(__name__)

IDENTIFY = "nat.identify"
MAX_ADDRS = 8


@dataclass(frozen=True)
class IdentifyResult:
    """What a peer told us: where it saw us coming from, and where it listens."""

    peer: PeerID
    observed: Multiaddr | None
    listen_addrs: tuple[Multiaddr, ...]


async def handle_identify(ctx: CallContext, request: Any) -> dict:
    """Server side: the caller's observed address (not for relayed connections) and our addrs."""
    observed = ctx.remote_addr
    seen = None if observed is None or observed.is_relayed else str(observed.transport_part())
    return {"observed": seen, "addrs": [str(a) for a in ctx.node.addrs[:MAX_ADDRS]]}


def parse_identify(peer: PeerID, reply: Any) -> IdentifyResult:
    """Validate an identify answer; addresses naming another peer are dropped."""
    if not isinstance(reply, dict):
        raise ProtocolError("identify answer is not a map")
    observed: Multiaddr | None = None
    raw = reply.get("observed")
    if raw is not None:
        if not isinstance(raw, str) or len(raw) > 300:
            raise ProtocolError("identify: bad observed address")
        try:
            observed = Multiaddr.parse(raw)
        except MultiaddrError as e:
            raise ProtocolError(f"identify: bad observed address: {e}") from None
        if observed.is_relayed or observed.peer_id is not None or observed.port is None:
            raise ProtocolError(f"identify: observed address is not a transport address: {raw}")
    addrs = reply.get("addrs", [])
    if not isinstance(addrs, list):
        raise ProtocolError("identify: addrs is not a list")
    listen: list[Multiaddr] = []
    for text in addrs[:MAX_ADDRS]:
        try:
            ma = Multiaddr.parse(text)
        except MultiaddrError:
            continue
        if ma.peer_id == peer:
            listen.append(ma)
    return IdentifyResult(peer, observed, tuple(listen))


async def identify(
    node: Node, peer: PeerID | Multiaddr | str, *, timeout: float = 10.0
) -> IdentifyResult:
    """Ask ``peer`` how it sees us; its listen addresses go to the peerstore."""
    pid = await node.connect(peer)
    reply = await node.call(pid, IDENTIFY, None, timeout=timeout)
    result = parse_identify(pid, reply)
    if result.listen_addrs:
        node.peerstore.add_addrs(pid, result.listen_addrs)
    return result


class ObservedAddrs:
    """Observed addresses of this node, each with the set of peers that reported it.

    Bounded: at most ``max_addrs`` addresses (the least reported is dropped) and reports
    older than ``ttl`` seconds are forgotten.
    """

    def __init__(self, *, ttl: float = 1800.0, max_addrs: int = 16) -> None:
        self.ttl = ttl
        self.max_addrs = max_addrs
        self._seen: dict[Multiaddr, dict[PeerID, float]] = {}

    def record(self, reporter: PeerID, observed: Multiaddr, now: float) -> None:
        observed = observed.transport_part()
        self.expire(now)
        reporters = self._seen.setdefault(observed, {})
        reporters[reporter] = now
        if len(self._seen) > self.max_addrs:
            weakest = min(
                self._seen, key=lambda a: (len(self._seen[a]), max(self._seen[a].values()))
            )
            del self._seen[weakest]

    def expire(self, now: float) -> None:
        for addr in list(self._seen):
            reporters = {p: t for p, t in self._seen[addr].items() if now - t < self.ttl}
            if reporters:
                self._seen[addr] = reporters
            else:
                del self._seen[addr]

    def addrs(self, min_reporters: int = 1) -> list[Multiaddr]:
        """Observed addresses reported by at least ``min_reporters`` peers, most reported first."""
        ranked = sorted(self._seen, key=lambda a: -len(self._seen[a]))
        return [a for a in ranked if len(self._seen[a]) >= min_reporters]

    def hosts(self) -> set[str]:
        return {h for a in self._seen if (h := a.host) is not None}

    def candidates(self, listen_addrs: list[Multiaddr]) -> list[Multiaddr]:
        """Addresses worth a dial-back: our listen addresses, every observed address, and
        each observed host with each of our listen ports (a NAT that keeps ports, or a
        port forwarded by hand)."""
        out: list[Multiaddr] = []

        def add(a: Multiaddr) -> None:
            a = a.transport_part()
            if a not in out and not a.is_relayed:
                out.append(a)

        listen = [a for a in listen_addrs if not a.is_relayed]
        for a in listen:
            add(a)
        for obs in self.addrs():
            add(obs)
            for a in listen:
                port = a.port
                if port is None or not obs.components or not a.components:
                    continue
                if obs.components[0][0] != a.components[0][0]:
                    continue  # ip4 vs ip6 vs sim
                comps = [(p, str(port) if p == "tcp" else v) for p, v in obs.components]
                add(Multiaddr(tuple(comps)))
        return out


__all__ = [
    "IDENTIFY",
    "IdentifyResult",
    "ObservedAddrs",
    "handle_identify",
    "identify",
    "parse_identify",
]
