"""The Transport of a simulated host: ``listen`` on and ``dial`` ``/sim/<host>/tcp/<port>``.

Same contract as the TCP transport, so the secure channel, mux, RPC and node run on it
unchanged. A dial takes one round trip of virtual time; it fails with :class:`DialError` when
the target host is unknown, dead, behind NAT (``reachable=False``), partitioned from us, or has
no listener on that port (or, with ``silent_failures``, hangs until the caller gives up).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from p2p.errors import DialError, MultiaddrError
from p2p.multiaddr import Multiaddr
from p2p.sim.stream import Connection, SimStream

if TYPE_CHECKING:
    from p2p.sim.network import SimHost

logger = logging.getLogger(__name__)

ConnHandler = Callable[[trio.abc.Stream, Multiaddr | None], Awaitable[None]]

_EPHEMERAL = (20000, 60999)


class SimListener:
    """A listening port: where dials land and the nursery their handlers run in."""

    def __init__(self, handler: ConnHandler, nursery: trio.Nursery) -> None:
        self.handler = handler
        self.nursery = nursery


def _sim_parts(addr: Multiaddr | str) -> tuple[str, int]:
    try:
        ma = Multiaddr.parse(addr).transport_part()
    except MultiaddrError as e:
        raise DialError(f"bad simulated address {addr}: {e}") from None
    host, port = ma.value_of("sim"), ma.port
    if host is None or port is None or ma.components[0][0] != "sim":
        raise DialError(f"not a simulated address (want /sim/<host>/tcp/<port>): {addr}")
    return host, port


class SimTransport:
    """Listens and dials on behalf of one :class:`~p2p.sim.network.SimHost`."""

    def __init__(self, host: SimHost) -> None:
        self.host = host

    def __repr__(self) -> str:
        return f"SimTransport({self.host.name!r})"

    def _free_port(self) -> int:
        rng = self.host.net.rng
        while True:
            port = rng.randint(*_EPHEMERAL)
            if port not in self.host.listeners:
                return port

    async def listen(
        self,
        addr: Multiaddr | str,
        handler: ConnHandler,
        *,
        task_status: trio.TaskStatus[Multiaddr] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept connections on ``addr`` until cancelled; handlers run in our nursery."""
        ma = Multiaddr.parse(addr)
        name, port = ma.value_of("sim"), ma.port
        if name != self.host.name or port is None:
            raise ValueError(f"host {self.host.name!r} cannot listen on {ma}")
        if port == 0:
            port = self._free_port()
        elif port in self.host.listeners:
            raise OSError(errno.EADDRINUSE, f"{ma} is already in use")
        async with trio.open_nursery() as nursery:
            listener = SimListener(handler, nursery)
            self.host.listeners[port] = listener
            try:
                task_status.started(Multiaddr.parse(f"/sim/{name}/tcp/{port}"))
                await trio.sleep_forever()
            finally:
                if self.host.listeners.get(port) is listener:
                    del self.host.listeners[port]

    def _refusal(self, target: SimHost | None, port: int) -> str | None:
        me = self.host
        if not me.alive:
            return f"{me.name} is down"
        if target is None:
            return "no such host"
        if not target.alive:
            return f"{target.name} is down"
        if not target.reachable and target is not me:
            return f"{target.name} accepts no inbound connections (behind NAT)"
        if not me.net.can_reach(me, target):
            return f"{me.name} and {target.name} are partitioned"
        if port not in target.listeners:
            return f"connection refused: nothing listens on port {port} of {target.name}"
        return None

    async def dial(self, addr: Multiaddr | str) -> SimStream:
        """Connect to a simulated address, taking one round trip of virtual time."""
        name, port = _sim_parts(addr)
        net = self.host.net
        net.stats.dials += 1
        target = net.hosts.get(name)
        why = self._refusal(target, port)
        if why is None:
            assert target is not None
            rtt = net.latency(self.host, target) + net.latency(target, self.host)
            await net.sleep(rtt)
            why = self._refusal(target, port)
        else:
            await trio.lowlevel.checkpoint()
        if why is not None:
            net.stats.failed_dials += 1
            net._record("dial-failed", self.host.name, name, why)
            if net.silent_failures and not why.startswith(("no such", "connection refused")):
                await trio.sleep_forever()
            raise DialError(f"cannot dial {addr}: {why}")
        assert target is not None
        listener = target.listeners[port]
        local = Multiaddr.parse(f"/sim/{self.host.name}/tcp/{self._free_port()}")
        remote = Multiaddr.parse(f"/sim/{target.name}/tcp/{port}")
        conn = Connection(net, self.host, target, local, remote)
        net.stats.connections += 1
        net._record("connect", self.host.name, target.name, port)
        listener.nursery.start_soon(listener.handler, conn.b_end, local)
        return conn.a_end
