"""Simulated connections and their two :class:`trio.abc.HalfCloseableStream` endpoints.

Error semantics follow trio's ``SocketStream`` over TCP: ``b""`` after the peer's orderly
close once its bytes are read; :class:`trio.BrokenResourceError` when the connection was reset
(peer host killed, partition) or when sending to a peer that closed; and
:class:`trio.ClosedResourceError` for using an endpoint this side already closed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from p2p.multiaddr import Multiaddr
from p2p.sim.pipe import Pipe

if TYPE_CHECKING:
    from p2p.sim.network import SimHost, SimNetwork

DEFAULT_RECEIVE_SIZE = 256 * 1024


class Connection:
    """A simulated TCP connection between host ``a`` (dialer) and host ``b`` (listener)."""

    def __init__(
        self, net: SimNetwork, a: SimHost, b: SimHost, a_addr: Multiaddr, b_addr: Multiaddr
    ) -> None:
        self.net = net
        self.a = a
        self.b = b
        self.ab = Pipe(net, a, b)
        self.ba = Pipe(net, b, a)
        self.a_end = SimStream(self, send=self.ab, recv=self.ba, local=a_addr, remote=b_addr)
        self.b_end = SimStream(self, send=self.ba, recv=self.ab, local=b_addr, remote=a_addr)
        a.connections[self] = None
        b.connections[self] = None
        timeouts = [t for t in (a.nat_mapping_timeout, b.nat_mapping_timeout) if t is not None]
        self.mapping_timeout = min(timeouts) if timeouts else None
        self.last_traffic = net.engine.now
        self.blackholed = False
        """True once a NAT on the path forgot this connection: bytes sent vanish."""

    def traffic(self) -> bool:
        """Bytes are about to cross the path now: False if a NAT's mapping expired first (the
        bytes are lost, as are all later ones), else True (and the mapping is refreshed)."""
        if self.blackholed:
            return False
        now = self.net.engine.now
        if self.mapping_timeout is not None and now - self.last_traffic > self.mapping_timeout:
            self.blackholed = True
            return False
        self.last_traffic = now
        return True

    def reset(self, reason: str) -> None:
        """Break both directions (as a TCP reset does) and forget the connection."""
        self.ab.reset(reason)
        self.ba.reset(reason)
        self._forget()

    def maybe_forget(self) -> None:
        if self.a_end.closed and self.b_end.closed:
            self._forget()

    def _forget(self) -> None:
        self.a.connections.pop(self, None)
        self.b.connections.pop(self, None)

    def __repr__(self) -> str:
        return f"Connection({self.a.name} -> {self.b.name})"


class SimStream(trio.abc.HalfCloseableStream):
    """One end of a simulated connection."""

    def __init__(
        self, conn: Connection, *, send: Pipe, recv: Pipe, local: Multiaddr, remote: Multiaddr
    ) -> None:
        self._conn = conn
        self._net = conn.net
        self._send = send
        self._recv = recv
        self.local_addr = local
        self.remote_addr = remote
        self.closed = False
        self._sending = False
        self._receiving = False

    def __repr__(self) -> str:
        return f"SimStream({self.local_addr} -> {self.remote_addr})"

    def _check_open(self) -> None:
        if self.closed:
            raise trio.ClosedResourceError("this simulated stream was closed")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        self._sending = True
        try:
            self._check_open()
            await trio.lowlevel.checkpoint_if_cancelled()
            if self._send.eof_sent:
                raise trio.ClosedResourceError("cannot send after send_eof")
            view = memoryview(data)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            pos = 0
            net = self._net
            pipe = self._send
            yielded = False
            net._settle()
            if not self._conn.traffic():
                pos = len(view)  # into the void: the sender cannot tell
            while True:
                net._settle()
                self._check_open()
                if pipe.broken is not None:
                    raise trio.BrokenResourceError(pipe.broken)
                if pos >= len(view):
                    break
                taken = pipe.write(view[pos:])
                pos += taken
                if taken == 0:
                    await net._wait(pipe, "send_waiter")
                    yielded = True
            if not yielded:
                await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self._sending = False

    async def wait_send_all_might_not_block(self) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        self._sending = True
        try:
            self._check_open()
            await trio.lowlevel.checkpoint()
            while True:
                self._net._settle()
                self._check_open()
                pipe = self._send
                if pipe.broken is not None or pipe.send_space() > 0:
                    return
                await self._net._wait(pipe, "send_waiter")
        finally:
            self._sending = False

    async def send_eof(self) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        self._check_open()
        await trio.lowlevel.checkpoint()
        self._check_open()
        self._net._settle()
        if self._conn.traffic():
            self._send.write_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if max_bytes is None:
            max_bytes = DEFAULT_RECEIVE_SIZE
        elif max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        if self._receiving:
            raise trio.BusyResourceError("another task is receiving on this stream")
        self._receiving = True
        try:
            self._check_open()
            await trio.lowlevel.checkpoint_if_cancelled()
            net = self._net
            pipe = self._recv
            yielded = False
            while True:
                net._settle()
                self._check_open()
                if pipe.broken is not None:
                    raise trio.BrokenResourceError(pipe.broken)
                now = net.engine.now
                if pipe.readable(now):
                    data = b"" if pipe.at_eof() else pipe.read(now, max_bytes)
                    break
                await net._wait(pipe, "recv_waiter")
                yielded = True
            if not yielded:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return data
        finally:
            self._receiving = False

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self._net._settle()
            # our unsent bytes still go out, then EOF; the peer can no longer send to us
            if self._conn.traffic():
                self._send.write_eof()
            self._recv.reset("the peer closed the connection")
            self._send.wake_all()
            self._conn.maybe_forget()
            self._net._refresh_keeper()
        await trio.lowlevel.checkpoint()
