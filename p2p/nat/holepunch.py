"""Direct connection upgrade: two peers that met through a relay punch a hole through their NATs.

Over the relayed connection the initiator sends the addresses it will connect *from* (each
observed public host with a local port it just bound), the other side answers likewise, the
initiator measures that round trip and says "go", and half a round trip later both connect
to each other at once from those ports. Behind NATs that keep the source port (cone NATs),
each side's outgoing SYN opens the mapping the other's SYN arrives through: a TCP
simultaneous open. The smaller peer ID then runs the outbound handshake and the other the
inbound one, so the new connection is authenticated end to end like any other; the node's
duplicate rule keeps it (it is initiated by the smaller ID) and drains the relayed one.
Symmetric NATs (a new port per destination) defeat this; the relay simply stays in use.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import trio

from p2p.errors import ConnectionClosed, MultiaddrError, P2PError, ProtocolError
from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr
from p2p.rpc import CallContext, MessageStream
from p2p.transport import TcpTransport

if TYPE_CHECKING:
    from p2p.node import Node

logger = logging.getLogger(__name__)

UPGRADE = "nat.holepunch"
MAX_PUNCH_ADDRS = 4


@dataclass(frozen=True)
class HolePunchConfig:
    auto: bool = True
    """Start an upgrade after each relayed dial (otherwise only ``HolePuncher.upgrade``)."""
    attempts: int = 3
    """Rounds of simultaneous connects before giving up (the relay stays in use)."""
    connect_timeout: float = 3.0
    """One round (the kernel retransmits the SYN within it)."""
    retry_interval: float = 0.3
    exchange_timeout: float = 10.0
    """The address exchange over the relay must finish within this."""

    def replace(self, **changes: Any) -> HolePunchConfig:
        return replace(self, **changes)


def punch_addrs(hosts: Iterable[str], local_ip: str | None, port: int) -> list[str]:
    """The addresses to announce: each public IPv4 host we were seen at, then our own IP."""
    out: list[str] = []
    for host in [*hosts, *([local_ip] if local_ip else [])]:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            continue
        if ip.version != 4 or ip.is_unspecified or ip.is_loopback:
            continue
        text = f"/ip4/{ip}/tcp/{port}"
        if text not in out:
            out.append(text)
    return out[:MAX_PUNCH_ADDRS]


def parse_punch_addrs(value: Any) -> list[tuple[str, int]]:
    """(host, port) pairs from a peer's announcement; ProtocolError when malformed."""
    if not isinstance(value, list) or not value:
        raise ProtocolError("hole punch: addrs must be a non-empty list")
    out: list[tuple[str, int]] = []
    for text in value[:MAX_PUNCH_ADDRS]:
        try:
            ma = Multiaddr.parse(text)
        except MultiaddrError as e:
            raise ProtocolError(f"hole punch: bad address: {e}") from None
        if ma.value_of("ip4") is None or ma.port in (None, 0) or ma.is_relayed:
            raise ProtocolError(f"hole punch: not an IPv4 TCP address: {text!r:.100}")
        ip = ipaddress.ip_address(ma.value_of("ip4"))
        if ip.is_unspecified or ip.is_multicast or ip.is_loopback:
            raise ProtocolError(f"hole punch: unusable address {text!r:.100}")
        assert ma.host is not None and ma.port is not None
        out.append((ma.host, ma.port))
    return out


def _bind(local_ip: str, port: int) -> trio.socket.SocketType:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


async def connect_from(
    local_ip: str,
    first: trio.socket.SocketType,
    targets: list[tuple[str, int]],
    config: HolePunchConfig,
) -> tuple[trio.SocketStream, tuple[str, int]] | None:
    """Connect from the port ``first`` is bound to, to any target, in a few rounds."""
    port = first.getsockname()[1]
    spare: list[trio.socket.SocketType] = [first]
    won: list[tuple[trio.SocketStream, tuple[str, int]]] = []

    async def attempt(target: tuple[str, int], cancel: trio.CancelScope) -> None:
        if spare:
            sock = spare.pop()
        else:
            sock = _bind(local_ip, port)
        try:
            if sock.getsockname()[1] != port:
                await sock.bind((local_ip, port))
            await sock.connect(target)
        except OSError as e:
            logger.debug("hole punch to %s failed: %s", target, e)
            sock.close()
            return
        except BaseException:
            sock.close()
            raise
        if won:
            sock.close()
            return
        won.append((trio.SocketStream(sock), target))
        cancel.cancel()

    try:
        for round_ in range(config.attempts):
            if round_:
                await trio.sleep(config.retry_interval)
            with trio.move_on_after(config.connect_timeout):
                async with trio.open_nursery() as nursery:
                    for target in targets:
                        nursery.start_soon(attempt, target, nursery.cancel_scope)
            if won:
                return won[0]
        return None
    finally:
        for sock in spare:
            sock.close()


def local_ipv4(listen_addrs: Iterable[Multiaddr]) -> str:
    """The first specific IPv4 host among bound listen addresses, else ``0.0.0.0`` (pure)."""
    for addr in listen_addrs:
        host = addr.value_of("ip4")
        if host is None or addr.is_relayed:
            continue
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            continue
        if ip.version == 4 and not ip.is_unspecified:
            return str(ip)
    return "0.0.0.0"


class HolePuncher:
    """Upgrades relayed connections to direct ones (TCP transports only)."""

    def __init__(
        self,
        node: Node,
        nursery: trio.Nursery,
        hosts: Callable[[], set[str]],
        config: HolePunchConfig,
    ) -> None:
        self.node = node
        self.nursery = nursery
        self.hosts = hosts  # () -> our observed public hosts
        self.config = config
        self.upgraded = 0
        self.failed = 0

    @property
    def supported(self) -> bool:
        return isinstance(self.node.transport, TcpTransport)

    def register(self) -> None:
        self.node.add_stream_handler(UPGRADE, self.handle)

    def _local_ip(self) -> str:
        """An IPv4 address a listener is bound to, else any (``0.0.0.0``).

        Never one of ``node.addrs``: those are what we advertise (``--announce``, dial-back
        proven public addresses), and behind a 1:1 NAT or a port forward they are not ours
        to bind (``OSError 99``).
        """
        return local_ipv4(self.node.listen_addrs)

    async def _prepare(self) -> tuple[trio.socket.SocketType, list[str]]:
        """A socket bound to a fresh local port and the addresses to announce for it.

        Raises OSError when the port cannot be bound (the caller logs it and stays relayed).
        """
        local_ip = self._local_ip()
        sock = _bind(local_ip, 0)
        try:
            await sock.bind((local_ip, 0))
        except BaseException:
            sock.close()
            raise
        port = sock.getsockname()[1]
        return sock, punch_addrs(self.hosts(), local_ip, port)

    def _relayed(self, peer: PeerID) -> bool:
        conn = self.node.connection_to(peer)
        return conn is not None and conn.remote_addr is not None and conn.remote_addr.is_relayed

    async def upgrade(self, peer: PeerID) -> bool:
        """Try to replace our relayed connection to ``peer`` by a direct one.

        Never raises for a failed attempt (a bind, the exchange, the connects, the handshake):
        it is logged, counted in ``failed``, and the relayed connection stays in use.
        """
        if not self.supported or not self._relayed(peer):
            return False
        try:
            return await self._upgrade(peer)
        except (P2PError, OSError, trio.TooSlowError) as e:
            logger.info("hole punch with %s failed, staying on the relay: %r", peer, e)
            self.failed += 1
            return False

    async def _upgrade(self, peer: PeerID) -> bool:
        sock, mine = await self._prepare()
        try:
            async with self.node.open_stream(peer, UPGRADE) as ms:
                with trio.fail_after(self.config.exchange_timeout):
                    start = trio.current_time()
                    await ms.send({"addrs": mine})
                    answer = await ms.receive()
                    rtt = trio.current_time() - start
                    offered = answer.get("addrs") if isinstance(answer, dict) else None
                    theirs = parse_punch_addrs(offered)
                    await ms.send({"go": True})
                    await ms.send_eof()
                logger.debug("hole punch with %s: %s <-> %s, rtt %.3f s", peer, mine, theirs, rtt)
                await trio.sleep(rtt / 2)  # "go" reaches the other side about now
                result = await connect_from(self._local_ip(), sock, theirs, self.config)
                # Let the responder end the stream: closing it first would reset it, and a
                # reset that overtakes "go" would cancel the responder's side of the punch.
                with trio.move_on_after(self.config.exchange_timeout):
                    try:
                        async for _ in ms:
                            pass
                    except ConnectionClosed:
                        pass
        except (P2PError, trio.TooSlowError) as e:
            logger.info("hole punch with %s: exchange failed: %s", peer, e)
            sock.close()
            self.failed += 1
            return False
        except BaseException:
            sock.close()
            raise
        return await self._finish(peer, result)

    async def handle(self, ctx: CallContext, ms: MessageStream) -> None:
        peer = ctx.remote_peer
        if ctx.remote_addr is None or not ctx.remote_addr.is_relayed or not self.supported:
            raise ProtocolError("hole punching is only for relayed connections over TCP")
        with trio.move_on_after(self.config.exchange_timeout) as scope:
            request = await ms.receive()
        if scope.cancelled_caught:
            raise ProtocolError("hole punch: no addresses from the initiator in time")
        theirs = parse_punch_addrs(request.get("addrs") if isinstance(request, dict) else None)
        try:
            sock, mine = await self._prepare()
        except OSError as e:
            self.failed += 1
            raise ProtocolError(f"hole punch: cannot bind a local port: {e}") from None
        try:
            with trio.move_on_after(self.config.exchange_timeout) as scope:
                await ms.send({"addrs": mine})
                go = await ms.receive()
            if scope.cancelled_caught or go != {"go": True}:
                raise ProtocolError("hole punch: no go from the initiator")
        except BaseException:
            sock.close()
            raise
        logger.debug("hole punch from %s: ours %s, theirs %s", peer, mine, theirs)
        # in the manager's nursery: the punch, and the connection it makes, outlive this stream
        # (and the relayed connection, which is drained once the direct one is up)
        self.nursery.start_soon(self._punch, peer, sock, theirs)

    async def _punch(
        self, peer: PeerID, sock: trio.socket.SocketType, theirs: list[tuple[str, int]]
    ) -> None:
        try:
            result = await connect_from(self._local_ip(), sock, theirs, self.config)
            await self._finish(peer, result)
        except (P2PError, OSError, trio.TooSlowError) as e:
            # this task runs in the NAT manager's nursery: an escape would end the node
            logger.info("hole punch from %s failed, staying on the relay: %r", peer, e)
            self.failed += 1

    async def _finish(
        self, peer: PeerID, result: tuple[trio.SocketStream, tuple[str, int]] | None
    ) -> bool:
        if result is None:
            logger.info("hole punch with %s failed: staying on the relay", peer)
            self.failed += 1
            return False
        stream, (host, port) = result
        addr = Multiaddr.parse(f"/ip4/{host}/tcp/{port}")
        if self.node.peer_id < peer:
            try:
                await self.node.adopt_outbound(stream, addr.with_peer(peer), peer)
            except P2PError as e:
                logger.info("hole punch with %s: handshake failed: %s", peer, e)
                self.failed += 1
                return False
        else:
            self.nursery.start_soon(self.node.accept_inbound, stream, addr)
            with trio.move_on_after(self.config.exchange_timeout):
                while self._relayed(peer) or self.node.connection_to(peer) is None:
                    await trio.sleep(0.05)
            if self._relayed(peer) or self.node.connection_to(peer) is None:
                self.failed += 1
                return False
        self.upgraded += 1
        logger.info("hole punch with %s: direct connection via %s", peer, addr)
        return True
