"""The node: listeners, dialing, one secure multiplexed connection per peer, RPC handlers.

Why one connection per peer pair: the handshake costs two round trips and a few signatures,
and the mux already isolates streams from each other. When both sides dial each other at the
same moment, both keep the connection initiated by the smaller peer ID (the same choice on
both ends), and the other one is drained: no new streams, closed when its last stream ends.

Every task belongs to the nursery :func:`open_node` owns: listeners, accepted and dialed
connections, their multiplexers and handlers. Leaving the ``async with`` block sends GOAWAY
on every connection and cancels them all.
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import msgpack
import trio

from p2p.errors import (
    ConnectionClosed,
    DialError,
    HandshakeError,
    MultiaddrError,
    P2PError,
    PeerIDMismatch,
    ProtocolError,
    RPCError,
    RPCTimeout,
)
from p2p.identity import Identity, PeerID
from p2p.local_addrs import local_ipv4_addrs
from p2p.messages import EXT_ACCEPT, encode_parts
from p2p.multiaddr import Multiaddr
from p2p.mux import ByteCount, MemoryBudget, Mux, MuxStream
from p2p.mux_frames import DISCONNECT, DUPLICATE, IDLE, SHUTTING_DOWN
from p2p.mux_stream import MessageStream, check_ext
from p2p.node_config import NodeConfig
from p2p.peerstore import PeerStore
from p2p.rpc import STREAMING, UNARY, CallContext, Registry, ServeLimits, serve_stream
from p2p.secure import SecureChannel, secure_inbound, secure_outbound
from p2p.transport import TcpTransport, Transport

logger = logging.getLogger(__name__)

PeerLike = PeerID | Multiaddr | str


_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters
_M_MMAP_THRESHOLD = -3


def retain_freed_memory(trim_threshold: int = 128 << 20, mmap_threshold: int = 32 << 20) -> bool:
    """Ask glibc's allocator to keep freed memory for reuse rather than hand it back at once.

    Why: a node receiving 1 MiB messages allocates a fresh megabyte per message (the decrypted
    chunk it hands over). With glibc's defaults the top of the heap is returned to the kernel
    over and over, and each new message then pays a page fault per 4 KiB page (on the bench's
    receiver, about a fifth of its CPU time). This is process-wide: allocations below
    ``mmap_threshold`` come from the heap, and up to ``trim_threshold`` bytes of freed heap stay
    mapped for reuse. Nodes call it once per process unless ``NodeConfig.retain_freed_memory``
    is False. Returns False where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1 and ok
    if not ok:
        logger.info("mallopt refused the allocator settings; freed memory is returned as before")
    return ok


_allocator_settled = False


def _retain_freed_memory_once() -> None:
    global _allocator_settled
    if not _allocator_settled:
        _allocator_settled = True
        if retain_freed_memory():
            logger.debug("glibc keeps freed memory for reuse (NodeConfig.retain_freed_memory)")


class Connection:
    """One secure, multiplexed connection to a proven peer."""

    def __init__(
        self,
        channel: SecureChannel,
        remote_addr: Multiaddr | None,
        outbound: bool,
        local_peer: PeerID,
    ) -> None:
        self.channel = channel
        self.peer: PeerID = channel.remote_peer
        self.remote_addr = remote_addr
        self.outbound = outbound
        self.initiator: PeerID = local_peer if outbound else channel.remote_peer
        self.draining = False
        self.wakeup = trio.Event()  # set to make the idle watcher re-check (draining started)
        self.mux: Mux  # set by the node before use

    @property
    def usable(self) -> bool:
        return not self.draining and not self.mux.is_closed and not self.mux._closing

    @property
    def relayed(self) -> bool:
        """Over a relay circuit (both ends see it so)."""
        return self.remote_addr is not None and self.remote_addr.is_relayed

    def __repr__(self) -> str:
        direction = "out" if self.outbound else "in"
        return f"Connection({self.peer}, {direction}, {self.remote_addr})"


class Node:
    """A peer: use :func:`open_node` to create one."""

    def __init__(
        self, identity: Identity, transport: Transport, config: NodeConfig, nursery: trio.Nursery
    ) -> None:
        self.identity = identity
        self.peer_id: PeerID = identity.peer_id
        self.transport = transport
        self.config = config
        if config.retain_freed_memory:
            _retain_freed_memory_once()
        self.addrs: list[Multiaddr] = []
        """What the node advertises (DHT, identify): the announced addresses if any, else the
        bound listen addresses; p2p.nat may add relayed or dial-back proven ones."""
        self.listen_addrs: list[Multiaddr] = []
        """Where the listeners are actually bound."""
        self.peerstore = PeerStore()
        self.circuit_transport: Transport | None = None
        """Dials relayed (``/p2p-circuit``) addresses when set (see :mod:`p2p.nat.circuit`)."""
        self._nursery = nursery
        self._registry = Registry()
        self._conns: dict[PeerID, Connection] = {}  # the connection used for new streams
        self._all_conns: dict[Connection, None] = {}  # a set in opening order (repeatable)
        self._dialing: dict[PeerID, trio.Event] = {}
        self._pending_inbound = 0
        self._per_ip: Counter[str] = Counter()
        self._closing = False
        self._parsed: dict[str, PeerID | Multiaddr] = {}
        self._budget = MemoryBudget(config.max_buffered_total)
        # Bytes this node wrote to its secure channels per stream protocol, over all its
        # connections, closed ones included (frames of no stream as mux/<kind>: p2p.mux.CONTROL).
        self.bytes_sent: Counter[str] = Counter()
        self.bytes_received = ByteCount()  # read from its secure channels, framing included
        self._serve_limits = ServeLimits(
            max_message_size=config.max_message_size,
            header_timeout=config.header_timeout,
            request_timeout=config.request_timeout,
        )

    def __repr__(self) -> str:
        return f"Node({self.peer_id})"

    # ---- handlers -------------------------------------------------------------------------

    def add_handler(self, name: str, handler: Callable[[CallContext, Any], Awaitable[Any]]) -> None:
        """Serve unary calls of protocol ``name``: ``await handler(ctx, request) -> response``."""
        self._registry.add(name, UNARY, handler)

    def add_stream_handler(
        self, name: str, handler: Callable[[CallContext, MessageStream], Awaitable[None]]
    ) -> None:
        """Serve streams of protocol ``name``: ``await handler(ctx, message_stream)``."""
        self._registry.add(name, STREAMING, handler)

    def remove_handler(self, name: str) -> None:
        self._registry.handlers.pop(name, None)

    def use_circuit_transport(self, transport: Transport) -> None:
        """Dial relayed addresses through ``transport`` (:func:`p2p.nat.circuit.attach` sets it:
        a circuit transport opens its streams through this node, so it comes after it)."""
        self.circuit_transport = transport

    # ---- connections ----------------------------------------------------------------------

    def connected_peers(self) -> list[PeerID]:
        return [p for p, c in self._conns.items() if c.usable]

    def connection_to(self, peer: PeerID) -> Connection | None:
        conn = self._conns.get(peer)
        return conn if conn is not None and conn.usable else None

    @property
    def num_connections(self) -> int:
        return len(self._all_conns)

    async def connect(self, peer: PeerLike) -> PeerID:
        """Make sure a connection to ``peer`` exists; returns its proven peer ID."""
        return (await self._get_connection(peer)).peer

    async def redial(self, addr: Multiaddr | str) -> PeerID:
        """Open a new connection to ``addr`` even if one to its peer exists: the new one takes
        the peer's new streams and the old one drains (its streams finish on it). For a
        connection about to end, such as one over a relay circuit near its limits."""
        pid, addrs = self._resolve(addr)
        if pid == self.peer_id or not addrs:
            raise DialError(f"cannot redial {addr}")
        if self._closing:
            raise DialError("node is closing")
        return (await self._dial(pid, addrs)).peer

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the background, owned by the node (it ends with the node)."""
        if not self._closing:
            self._nursery.start_soon(fn, *args)

    async def disconnect(self, peer: PeerID, reason: str = DISCONNECT) -> None:
        for conn in [c for c in self._all_conns if c.peer == peer]:
            await conn.mux.aclose(reason)

    def _resolve(self, peer: PeerLike) -> tuple[PeerID | None, list[Multiaddr]]:
        if isinstance(peer, str):
            parsed = self._parsed.get(peer)
            if parsed is None:
                parsed = Multiaddr.parse(peer) if peer.startswith("/") else PeerID.from_base58(peer)
                if len(self._parsed) >= 1024:  # callers repeat a few addresses; keep it small
                    self._parsed.clear()
                self._parsed[peer] = parsed
            peer = parsed
        if isinstance(peer, PeerID):
            return peer, []  # addresses come from the peer store, only if we must dial
        if isinstance(peer, Multiaddr):
            if peer.is_relayed and self.circuit_transport is None:
                raise DialError(f"relayed addresses are not supported by this node: {peer}")
            return peer.peer_id, [peer]
        raise TypeError(f"expected PeerID, Multiaddr or str, got {type(peer).__name__}")

    async def _get_connection(self, peer: PeerLike) -> Connection:
        pid, addrs = self._resolve(peer)
        if pid == self.peer_id:
            raise DialError("cannot connect to ourselves")
        if self._closing:
            raise DialError("node is closing")
        if pid is not None:
            conn = self.connection_to(pid)
            if conn is not None:
                return conn
            pending = self._dialing.get(pid)
            if pending is not None:
                await pending.wait()
                conn = self.connection_to(pid)
                if conn is not None:
                    return conn
            if not addrs:
                addrs = self.peerstore.addrs_of(pid)
        if not addrs:
            raise DialError(f"no known address for {pid}")
        return await self._dial(pid, addrs)

    async def _dial(self, pid: PeerID | None, addrs: list[Multiaddr]) -> Connection:
        done = trio.Event()
        if pid is not None:
            self._dialing[pid] = done
        try:
            if len(addrs) == 1:
                try:
                    return await self._dial_attempt(addrs[0], pid)
                except PeerIDMismatch:
                    raise
                except (DialError, HandshakeError, ConnectionClosed) as e:
                    raise DialError(f"cannot reach {pid or addrs[0]}: {addrs[0]}: {e}") from None
            return await self._dial_staggered(pid, addrs)
        finally:
            if pid is not None and self._dialing.get(pid) is done:
                del self._dialing[pid]
            done.set()

    async def _dial_staggered(self, pid: PeerID | None, addrs: list[Multiaddr]) -> Connection:
        """Dial ``addrs`` in their order, a new attempt every ``dial_stagger`` seconds or as
        soon as the previous one failed (Happy Eyeballs): the first connection wins and the
        other attempts are cancelled, so an address that silently drops costs one stagger,
        not a whole dial timeout."""
        errors: dict[int, str] = {}
        won: list[Connection] = []

        async def attempt(i: int, addr: Multiaddr, failed: trio.Event) -> None:
            try:
                conn = await self._dial_attempt(addr, pid)
            except (DialError, HandshakeError, ConnectionClosed) as e:
                errors[i] = f"{addr}: {e}"
                failed.set()
                return
            if not won:  # a later winner is a duplicate the node drains
                won.append(conn)
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for i, addr in enumerate(addrs):
                failed = trio.Event()
                nursery.start_soon(attempt, i, addr, failed)
                if i + 1 < len(addrs):
                    with trio.move_on_after(self.config.dial_stagger):
                        await failed.wait()
        if won:
            return won[0]
        raise DialError(
            f"cannot reach {pid or addrs[0]}: " + "; ".join(errors[i] for i in sorted(errors))
        )

    def _attempt_budget(self) -> float:
        """Seconds one dial attempt (transport and handshake) may take: the configured
        limits, but at most ``dial_deadline_share`` of what is left of the caller's deadline,
        so that a dead address fails as a DialError while the caller can still act on it."""
        limit = self.config.dial_timeout + self.config.handshake_timeout
        left = trio.current_effective_deadline() - trio.current_time()
        return max(0.0, min(limit, left * self.config.dial_deadline_share))

    async def _dial_attempt(self, addr: Multiaddr, expected: PeerID | None) -> Connection:
        budget = self._attempt_budget()
        with trio.move_on_after(budget):
            return await self._dial_one(addr, expected)
        raise DialError(f"dialing {addr}: no connection within {budget:.3g} s")

    async def _dial_one(self, addr: Multiaddr, expected: PeerID | None) -> Connection:
        if len(self._all_conns) + self._pending_inbound >= self.config.max_connections:
            raise DialError(f"connection limit ({self.config.max_connections}) reached")
        with trio.move_on_after(self.config.dial_timeout) as scope:
            if addr.is_relayed:
                if self.circuit_transport is None:
                    raise DialError(f"relayed addresses are not supported by this node: {addr}")
                raw = await self.circuit_transport.dial(addr)
            else:
                raw = await self.transport.dial(addr.transport_part())
        if scope.cancelled_caught:
            raise DialError(f"dialing {addr} timed out after {self.config.dial_timeout} s")
        return await self.adopt_outbound(raw, addr, expected)

    async def adopt_outbound(
        self, raw: trio.abc.Stream, addr: Multiaddr, expected: PeerID | None
    ) -> Connection:
        """Run the outbound handshake on a raw stream opened some other way (a hole punched
        through NATs) and use it as a connection to the proven peer."""
        channel = await secure_outbound(
            raw,
            self.identity,
            expected,
            timeout=self.config.handshake_timeout,
            cipher=self.config.cipher,
            frame_timeout=self.config.frame_timeout,
        )
        if channel.remote_peer == self.peer_id:
            await channel.aclose()
            raise DialError(f"{addr} is ourselves")
        conn: Connection = await self._nursery.start(self._run_connection, channel, addr, True)
        self.peerstore.add_addrs(conn.peer, [addr])
        return conn

    async def accept_inbound(self, raw: trio.abc.Stream, observed: Multiaddr | None) -> None:
        """Serve a raw stream that arrived some other way (a relayed circuit) as an inbound
        connection: secure handshake, then the usual connection; returns when it ends."""
        await self._handle_inbound(raw, observed)

    async def _handle_inbound(self, raw: trio.abc.Stream, observed: Multiaddr | None) -> None:
        """Transport handler for accepted connections (runs in the listener's nursery)."""
        try:
            await self._serve_inbound(raw, observed)
        finally:
            await trio.aclose_forcefully(raw)

    async def _serve_inbound(self, raw: trio.abc.Stream, observed: Multiaddr | None) -> None:
        ip = (observed.host if observed is not None else None) or "?"
        if self._closing:
            return
        if len(self._all_conns) + self._pending_inbound >= self.config.max_connections:
            logger.warning(
                "refusing connection from %s: %d connections open", observed, len(self._all_conns)
            )
            return
        if self._per_ip[ip] >= self.config.max_connections_per_ip:
            logger.warning(
                "refusing connection from %s: %d connections from %s already",
                observed,
                self._per_ip[ip],
                ip,
            )
            return
        self._per_ip[ip] += 1
        try:
            self._pending_inbound += 1
            try:
                channel = await secure_inbound(
                    raw,
                    self.identity,
                    timeout=self.config.handshake_timeout,
                    cipher=self.config.cipher,
                    frame_timeout=self.config.frame_timeout,
                )
            except HandshakeError as e:
                logger.info("inbound handshake from %s failed: %s", observed, e)
                return
            finally:
                self._pending_inbound -= 1
            if channel.remote_peer == self.peer_id:
                await channel.aclose()
                return
            await self._run_connection(channel, observed, False)
        finally:
            self._per_ip[ip] -= 1
            if self._per_ip[ip] <= 0:
                del self._per_ip[ip]

    async def _run_connection(
        self,
        channel: SecureChannel,
        remote_addr: Multiaddr | None,
        outbound: bool,
        *,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        conn = Connection(channel, remote_addr, outbound, self.peer_id)
        conn.mux = Mux(
            channel,
            initiator=outbound,
            handle_stream=partial(self._serve_stream, conn),
            config=self.config.mux_config(getattr(channel, "max_frame", None)),
            label=f"{str(conn.peer)[:10]}{'>' if outbound else '<'}",
            budget=self._budget,
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
        )
        self._all_conns[conn] = None

        async def run_mux(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await conn.mux.run(task_status=task_status)
            finally:
                nursery.cancel_scope.cancel()  # the idle watcher too

        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(run_mux)
                self._register(conn)
                task_status.started(conn)
                logger.debug("connected to %s", conn)
                if self.config.keepalive_interval is not None:
                    nursery.start_soon(self._keepalive, conn, self.config.keepalive_interval)
                await self._watch_idle(conn)
        finally:
            self._all_conns.pop(conn, None)
            if self._conns.get(conn.peer) is conn:
                del self._conns[conn.peer]
                # promote a remaining live connection, if any (e.g. the drained duplicate)
                for other in self._all_conns:
                    if other.peer == conn.peer and not other.mux.is_closed:
                        other.draining = False
                        self._conns[conn.peer] = other
                        break
            logger.debug("connection %s closed: %s", conn, conn.mux.close_reason)

    def _register(self, conn: Connection) -> None:
        """Make ``conn`` the connection to its peer, or drain it if a better one exists."""
        existing = self._conns.get(conn.peer)
        if existing is None or not existing.usable:
            self._conns[conn.peer] = conn
            return
        if existing.relayed != conn.relayed:
            # a direct connection beats a relayed one (both ends see which is which, so they
            # agree): a relay's budget is for signalling, and relays serve only direct peers
            keep, drop = (existing, conn) if conn.relayed else (conn, existing)
        elif existing.initiator == conn.initiator:
            keep, drop = conn, existing  # a redial: the old one is probably dead
        else:
            smaller = min(self.peer_id, conn.peer)
            keep, drop = (conn, existing) if conn.initiator == smaller else (existing, conn)
        self._conns[conn.peer] = keep
        drop.draining = True
        drop.wakeup.set()  # its idle watcher switches to drain_grace
        logger.debug("duplicate connection to %s: keeping %s, draining %s", conn.peer, keep, drop)

    async def _watch_idle(self, conn: Connection) -> None:
        """Close ``conn`` once it had no streams for the idle timeout (within +25%).

        Polls four times per timeout instead of waking on every stream, which keeps a
        busy connection free of timer churn; runs until the connection's nursery ends.
        """
        mux = conn.mux
        seen = mux.activity
        idle_since = trio.current_time()
        while True:
            timeout = self.config.drain_grace if conn.draining else self.config.idle_timeout
            with trio.move_on_after(timeout / 4):
                await conn.wakeup.wait()
            if conn.wakeup.is_set():
                conn.wakeup = trio.Event()
            now = trio.current_time()
            if mux.num_streams or mux.activity != seen:
                seen = mux.activity
                idle_since = now
            elif now - idle_since >= timeout:
                why = DUPLICATE if conn.draining else IDLE
                logger.debug("closing %s: %s", conn, why)
                await mux.aclose(why)
                await trio.sleep_forever()  # until run_mux ends and cancels us

    async def _keepalive(self, conn: Connection, interval: float) -> None:
        """Ping ``conn`` once nothing arrived on it for ``interval`` (within a quarter), and
        close it when nothing at all arrives within ``keepalive_timeout`` after a ping.

        Only silence is pinged, measured from the last frame that arrived (a PONG, the peer's
        own PING, stream data), and the dialing end goes first (its NAT is the one that
        forgets; the other end waits half an interval more, so both do not ping at once): a
        silent connection carries one ping per interval. (Checking whole intervals for
        "anything arrived" at both ends pinged once per 37 s at 15 s.)"""
        if not conn.outbound:
            interval *= 1.5
        mux = conn.mux
        seen = mux.frames_received
        heard = trio.current_time()
        pinged: float | None = None
        while not mux.is_closed:
            await trio.sleep(interval / 4)
            now = trio.current_time()
            if mux.frames_received != seen:
                seen = mux.frames_received
                heard, pinged = now, None
            elif pinged is None:
                if now - heard >= interval:
                    pinged = now
                    mux.ping()
            elif now - pinged >= self.config.keepalive_timeout:
                logger.info("closing %s: no answer to a keepalive ping", conn)
                conn.draining = True
                if self._conns.get(conn.peer) is conn:
                    del self._conns[conn.peer]
                await mux.aclose("no answer to a keepalive ping")  # GOAWAY bounded by 2 s
                return

    async def _serve_stream(self, conn: Connection, stream: MuxStream) -> None:
        def make_context(name: str) -> CallContext:
            return CallContext(conn.peer, conn.remote_addr, self, name)

        await serve_stream(stream, self._registry, make_context, self._serve_limits)

    # ---- calls ----------------------------------------------------------------------------

    def _drop(self, conn: Connection) -> None:
        """Stop using a connection that failed under us (its task closes it)."""
        conn.draining = True
        if self._conns.get(conn.peer) is conn:
            del self._conns[conn.peer]
        conn.mux.close_nowait("failed")

    async def _on_new_stream(
        self, peer: PeerLike, use: Callable[[MuxStream], Awaitable[Any]], *, keep: bool
    ) -> Any:
        """``await use(stream)`` on a new stream to ``peer``.

        A reused connection can turn out dead only when we first write to it, or the peer may
        close it (idle, shutting down) as our stream is on its way; when the peer certainly did
        not process the stream, retrying on a fresh connection is safe, so we do, once.
        The stream is reset unless ``use`` succeeded with ``keep`` (or it finished cleanly).
        """
        for attempt in (0, 1):
            conn = await self._get_connection(peer)
            try:
                stream = await conn.mux.open_stream()
            except ConnectionClosed:
                if attempt:
                    raise
                self._drop(conn)
                continue
            ok = False
            try:
                result = await use(stream)
                ok = True
                return result
            except ConnectionClosed:
                if attempt or not (stream.frames_sent == 0 or stream.unprocessed):
                    raise
                self._drop(conn)
            finally:
                if not (ok and keep) and not stream.finished:
                    stream.reset("call cancelled" if not ok else "done")
        raise AssertionError("unreachable")

    async def call(
        self, peer: PeerLike, name: str, request: Any, *, timeout: float | None = None
    ) -> Any:
        """Call ``name`` on ``peer`` and return its response.

        Raises RPCError(remote=True) when the handler failed, RPCTimeout past the deadline,
        DialError when the peer cannot be reached. Cancelling the call cancels the handler.
        """
        if timeout is None:
            timeout = self.config.call_timeout
        limit = self.config.max_message_size
        with trio.move_on_after(math.inf if timeout is None else timeout):
            return await self._on_new_stream(
                peer,
                partial(begin_call, kind=UNARY, name=name, max_message_size=limit, request=request),
                keep=False,
            )
        raise RPCTimeout(f"{name} on {peer}: no response within {timeout} s")

    @asynccontextmanager
    async def open_stream(
        self, peer: PeerLike, name: str, *, timeout: float | None = None
    ) -> AsyncIterator[MessageStream]:
        """A message stream to ``name`` on ``peer``; ``timeout`` bounds opening it only."""
        if timeout is None:
            timeout = self.config.call_timeout
        limit = self.config.max_message_size
        ms: MessageStream | None = None
        with trio.move_on_after(math.inf if timeout is None else timeout):
            ms = await self._on_new_stream(
                peer,
                partial(begin_call, kind=STREAMING, name=name, max_message_size=limit),
                keep=True,
            )
        if ms is None:
            raise RPCTimeout(f"opening {name} on {peer}: no answer within {timeout} s")
        try:
            yield ms
        except BaseException:
            ms.reset("aborted by the caller")
            raise
        else:
            await ms.aclose()

    async def _shutdown(self) -> None:
        self._closing = True
        with trio.move_on_after(2) as scope:
            scope.shield = True
            async with trio.open_nursery() as nursery:
                for conn in list(self._all_conns):
                    nursery.start_soon(conn.mux.aclose, SHUTTING_DOWN)


async def begin_call(
    stream: MuxStream, kind: str, name: str, max_message_size: int, request: Any = None
) -> Any:
    """Open a call of ``kind`` to ``name`` on a fresh stream: a unary call sends the header,
    ``request`` and EOF in one write and returns the response; a streaming call sends the
    header and returns its :class:`MessageStream` once the server accepted it. One function
    for both: the same header, the same first reply, the same failures. The caller resets
    the stream if this is cancelled."""
    ms = MessageStream(stream, max_message_size)
    stream.protocol = name
    unary = kind == UNARY
    parts = encode_parts([kind, name], max_message_size)
    if unary:
        parts += encode_parts(request, max_message_size)
    await stream.send_parts(parts, eof=unary)
    try:
        reply = await ms.receive_raw()
    except ConnectionClosed as e:
        if stream.unprocessed:
            raise  # the peer never saw the call: the node may retry it
        awaited = "a response" if unary else "it was accepted"
        raise RPCError(f"{name}: stream closed before {awaited} ({e})") from e
    if unary:
        return check_ext(reply)
    if isinstance(reply, msgpack.ExtType) and reply.code == EXT_ACCEPT:
        return ms
    check_ext(reply)
    raise ProtocolError(f"{name}: unexpected reply to a stream header")


@asynccontextmanager
async def open_node(
    identity: Identity | None = None,
    *,
    listen: Sequence[str | Multiaddr] = ("/ip4/127.0.0.1/tcp/0",),
    transport: Transport | None = None,
    config: NodeConfig = NodeConfig(),
    announce: Sequence[str | Multiaddr] = (),
) -> AsyncIterator[Node]:
    """Run a node for the duration of the block; everything it starts ends with it.

    ``announce``: addresses that reach this node from outside (a forwarded port, a proxy).
    When given, they *replace* the listen addresses in ``node.addrs`` (as in libp2p), so the
    DHT, identify and every record built from ``node.addrs`` carry only them.
    """
    identity = identity if identity is not None else Identity.generate()
    transport = transport if transport is not None else TcpTransport()
    announced = announce_addrs(announce, identity.peer_id)
    # A listen address that cannot be bound ends the node with that one error, not with a
    # group of them from the nursery (a caller can name the address to its user).
    failed: P2PError | None = None
    async with trio.open_nursery() as nursery:
        node = Node(identity, transport, config, nursery)
        try:
            for addr in listen:
                bound: Multiaddr = await nursery.start(
                    transport.listen, Multiaddr.parse(addr), node._handle_inbound
                )
                node.listen_addrs.append(bound.with_peer(node.peer_id))
        except P2PError as e:
            failed = e
            nursery.cancel_scope.cancel()
        if failed is None:
            node.addrs[:] = announced or dialable_addrs(node.listen_addrs)
            try:
                yield node
            finally:
                await node._shutdown()
                nursery.cancel_scope.cancel()
    if failed is not None:
        raise failed


def dialable_addrs(bound: Sequence[Multiaddr]) -> list[Multiaddr]:
    """Listen addresses as others can dial them: a wildcard ``/ip4/0.0.0.0`` listener stands
    for each of the host's IPv4 addresses (non-loopback first), since ``0.0.0.0`` reaches
    nobody; other addresses are kept as they are."""
    out: list[Multiaddr] = []
    for addr in bound:
        if addr.value_of("ip4") == "0.0.0.0":
            rest = str(addr)[len("/ip4/0.0.0.0") :]
            expanded = [Multiaddr.parse(f"/ip4/{ip}{rest}") for ip in local_ipv4_addrs()]
        else:
            expanded = [addr]
        out += [a for a in expanded if a not in out]
    return out


def announce_addrs(addrs: Sequence[str | Multiaddr], peer_id: PeerID) -> list[Multiaddr]:
    """``addrs`` parsed, each ending in ``/p2p/<peer_id>``; a clear error for one that cannot
    be dialed directly (no host or port, port 0, a relay circuit, another peer's ID)."""
    out: list[Multiaddr] = []
    for text in addrs:
        try:
            addr = Multiaddr.parse(text)
        except MultiaddrError as e:
            raise MultiaddrError(f"announce address {text!r:.200}: {e}") from None
        own = addr.peer_id
        if own is not None and own != peer_id:
            raise MultiaddrError(f"announce address {addr} names another peer ({own})")
        if addr.is_relayed:
            raise MultiaddrError(f"announce address {addr} is a relay circuit (p2p.nat adds those)")
        if addr.host is None or not addr.port:
            raise MultiaddrError(
                f"announce address {addr} is not dialable: it needs a host and a TCP port "
                "(e.g. /ip4/203.0.113.7/tcp/31337)"
            )
        addr = addr.with_peer(peer_id)
        if addr not in out:
            out.append(addr)
    return out


__all__ = [
    "Connection",
    "Node",
    "NodeConfig",
    "P2PError",
    "announce_addrs",
    "dialable_addrs",
    "open_node",
]
