"""Transports: how raw byte streams between hosts are made (TCP here, the simulator elsewhere).

A transport knows nothing of peers or encryption. It binds listeners and dials addresses, and
hands every accepted connection, with the remote address it was observed from, to a handler.
Everything above (secure channel, multiplexer, RPC) runs unchanged over any transport that
follows :class:`Transport`, which is what lets the in-memory simulator test the real code.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol, runtime_checkable

import trio

from p2p.errors import ConnectionClosed, DialError, ListenError, MultiaddrError, P2PError
from p2p.multiaddr import Multiaddr

logger = logging.getLogger(__name__)

ConnHandler = Callable[[trio.abc.Stream, Multiaddr | None], Awaitable[None]]
"""Called with (raw stream, observed remote address) for each accepted connection."""


@runtime_checkable
class Transport(Protocol):
    """What the node needs from a network: listen on an address, dial an address."""

    async def listen(
        self,
        addr: Multiaddr,
        handler: ConnHandler,
        *,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind, report the bound address via ``task_status.started(addr)``, serve forever."""
        ...

    async def dial(self, addr: Multiaddr) -> trio.abc.Stream:
        """Open a raw stream to ``addr``; raises :class:`DialError` when it cannot."""
        ...


def _host_port(addr: Multiaddr) -> tuple[str, int]:
    """The (host, port) a TCP socket uses for ``addr``; MultiaddrError when it has none."""
    addr = addr.transport_part()
    host = addr.host
    port = addr.port
    if host is None or port is None or addr.value_of("sim") is not None:
        raise MultiaddrError(f"not a TCP address: {addr}")
    return host, port


def sockaddr_to_multiaddr(sockaddr: Any) -> Multiaddr:
    """A Multiaddr for a socket address tuple (IPv4 or IPv6)."""
    host, port = sockaddr[0], sockaddr[1]
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    proto = "ip4" if ip.version == 4 else "ip6"
    return Multiaddr.parse(f"/{proto}/{ip}/tcp/{port}")


class TcpTransport:
    """TCP over the OS sockets via trio (TCP_NODELAY is set by trio on every socket stream)."""

    def __init__(self, *, backlog: int | None = None) -> None:
        self.backlog = backlog

    async def listen(
        self,
        addr: Multiaddr,
        handler: ConnHandler,
        *,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        host, port = _host_port(addr)
        try:
            listeners = await trio.open_tcp_listeners(port, host=host, backlog=self.backlog)
        except OSError as e:
            why = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror or e
            raise ListenError(f"cannot listen on {addr}: {why}") from e
        bound = sockaddr_to_multiaddr(listeners[0].socket.getsockname())
        logger.debug("listening on %s", bound)
        task_status.started(bound)
        await trio.serve_listeners(partial(self._serve_one, handler), listeners)

    async def _serve_one(self, handler: ConnHandler, stream: trio.SocketStream) -> None:
        try:
            observed: Multiaddr | None = sockaddr_to_multiaddr(stream.socket.getpeername())
        except (OSError, ValueError, MultiaddrError):
            observed = None  # the peer already hung up, or an address family we do not name
        try:
            await handler(stream, observed)
        except (
            P2PError,
            ConnectionClosed,
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            OSError,
        ) as e:
            logger.debug("connection from %s ended: %r", observed, e)
        finally:
            await trio.aclose_forcefully(stream)

    async def dial(self, addr: Multiaddr) -> trio.abc.Stream:
        try:
            host, port = _host_port(addr)
        except MultiaddrError as e:
            raise DialError(str(e)) from None
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError as e:
            raise DialError(f"cannot connect to {addr}: {e}") from e
        try:
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        except OSError:
            pass  # already closed by the peer; the first read will say so
        return stream
