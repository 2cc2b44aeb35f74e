"""An in-memory stand-in for :class:`p2p.node.Node`, for DHT simulations at scale.

It delivers DHT RPCs as direct calls between node objects in one trio run, with a fixed
one-way latency and a msgpack round trip of every request and response (so messages are
exactly what the wire would carry), but no transport, handshake or encryption. The full
simulator (:mod:`p2p.sim`) runs real nodes and costs ~0.2 s of CPU per node; this costs a few
milliseconds, so lookups can be studied at thousands of nodes (``bench.dht``). Tests of the
DHT's behaviour use the real simulator.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import trio

from p2p.errors import DialError, ProtocolError, RPCError, RPCTimeout
from p2p.identity import Identity, PeerID
from p2p.multiaddr import Multiaddr
from p2p.peerstore import PeerStore


@dataclass(frozen=True)
class MemoryContext:
    remote_peer: PeerID
    remote_addr: Multiaddr | None
    node: MemoryNode


class MemoryNetwork:
    def __init__(self, latency: float = 0.005) -> None:
        self.latency = latency
        self.nodes: dict[PeerID, MemoryNode] = {}
        self.dead: set[PeerID] = set()
        self.calls = 0
        self._arrivals: dict[float, _Arrival] = {}

    def add_node(self, identity: Identity) -> MemoryNode:
        node = MemoryNode(self, identity, len(self.nodes))
        self.nodes[node.peer_id] = node
        return node

    def kill(self, peer: PeerID) -> None:
        self.dead.add(peer)

    def revive(self, peer: PeerID) -> None:
        self.dead.discard(peer)

    async def travel(self) -> None:
        """Wait one latency (a message in flight).

        Messages sent at the same instant arrive together and share one timer: the first
        sleeps and wakes the others (a trio sleep per message, whose wake-up is a cancellation,
        costs more than the rest of a delivery). If that one is cancelled, the next takes over.
        """
        task = trio.lowlevel.current_task()
        due = trio.current_time() + self.latency
        group = self._arrivals.get(due)
        if group is None:
            group = self._arrivals[due] = _Arrival(task)
        else:
            group.waiting.append(task)

            def abort(_: object) -> trio.lowlevel.Abort:
                group.waiting.remove(task)
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
            if group.timer is not task:
                return  # woken by the timer's holder: arrived
        arrived = False
        try:
            await trio.sleep_until(due)
            arrived = True
        finally:
            if arrived or not group.waiting:
                del self._arrivals[due]
                for other in group.waiting:
                    trio.lowlevel.reschedule(other)
            else:  # cancelled: the next one holds the timer now
                group.timer = group.waiting.pop(0)
                trio.lowlevel.reschedule(group.timer)


@dataclass
class _Arrival:
    """Messages due at one instant: the task sleeping until then, and those it will wake."""

    timer: trio.lowlevel.Task
    waiting: list[trio.lowlevel.Task] = field(default_factory=list)


_packer = msgpack.Packer(use_bin_type=True)  # reused: building one per message costs more


def _roundtrip(obj: Any) -> Any:
    return msgpack.unpackb(_packer.pack(obj), raw=False, strict_map_key=False)


class MemoryNode:
    """The part of the Node API the DHT uses: handlers, call, connect, peerstore, addrs."""

    def __init__(self, net: MemoryNetwork, identity: Identity, index: int) -> None:
        self.net = net
        self.identity = identity
        self.peer_id = identity.peer_id
        self.addrs = [Multiaddr.parse(f"/sim/mem{index}/tcp/1").with_peer(self.peer_id)]
        self.peerstore = PeerStore()
        self.handlers: dict[str, Callable[[Any, Any], Awaitable[Any]]] = {}

    def add_handler(self, name: str, handler: Callable[[Any, Any], Awaitable[Any]]) -> None:
        self.handlers[name] = handler

    def remove_handler(self, name: str) -> None:
        self.handlers.pop(name, None)

    def _target(self, peer: PeerID | Multiaddr | str) -> MemoryNode:
        if isinstance(peer, str):
            peer = Multiaddr.parse(peer) if peer.startswith("/") else PeerID.from_base58(peer)
        if isinstance(peer, Multiaddr):
            peer = peer.peer_id
        node = self.net.nodes.get(peer) if peer is not None else None
        if node is None or peer in self.net.dead or self.peer_id in self.net.dead:
            raise DialError(f"cannot reach {peer}")
        return node

    async def connect(self, peer: PeerID | Multiaddr | str) -> PeerID:
        return self._target(peer).peer_id

    async def call(
        self,
        peer: PeerID | Multiaddr | str,
        name: str,
        request: Any,
        *,
        timeout: float | None = None,
    ) -> Any:
        target = self._target(peer)
        self.net.calls += 1
        with trio.move_on_after(math.inf if timeout is None else timeout):
            await self.net.travel()
            handler = target.handlers.get(name)
            if handler is None:
                raise RPCError(f"{name}: no such handler", remote=True)
            try:
                resp = await handler(MemoryContext(self.peer_id, None, target), _roundtrip(request))
            except (ProtocolError, ValueError, RPCError) as e:
                raise RPCError(f"{name}: {e}", remote=True) from None
            await self.net.travel()
            if target.peer_id in self.net.dead:
                raise DialError(f"{target.peer_id} died")
            return _roundtrip(resp)
        raise RPCTimeout(f"{name} on {peer}: no response within {timeout} s")
