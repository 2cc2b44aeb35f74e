"""Port mapping: ask the home router to forward a public port to our TCP listener.

A node behind a home NAT that speaks NAT-PMP (:mod:`p2p.nat.natpmp`), PCP
(:mod:`p2p.nat.pcp`) or UPnP IGD (:mod:`p2p.nat.upnp`) asks it, at start, for the same external
port as its listen port (a random one when that is taken), learns the router's external
address, and advertises ``/ip4/EXTERNAL/tcp/PORT``: peers then dial it directly, no relay
needed. The mapping is renewed at half its lease and deleted on exit; a lost mapping is asked
for again every ``retry_interval``. NAT-PMP is tried first (one datagram to the gateway), then
PCP, then UPnP.

Rules: every failure is logged and leaves the node as it was (no mapping is the normal case on
most networks); the router's answers are bounded and checked by the pure decoders; deleting a
mapping on exit runs shielded from cancellation, for at most ``delete_timeout`` seconds.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import trio

from p2p.multiaddr import Multiaddr
from p2p.nat.errors import OtherProtocol, PortMapError, PortMapRefused
from p2p.nat.natpmp import PORT as NATPMP_PORT
from p2p.nat.natpmp import NATPMPClient, default_gateway
from p2p.nat.pcp import PCPClient
from p2p.nat.upnp import UPnPClient, fault_code

if TYPE_CHECKING:
    from p2p.node import Node

logger = logging.getLogger(__name__)

PROTOCOLS = ("natpmp", "pcp", "upnp")
UPNP_PERMANENT_ONLY = 725  # OnlyPermanentLeasesSupported


@dataclass(frozen=True)
class PortMapConfig:
    """How a node asks its router for a port (``NATConfig.port_mapping``; None: never)."""

    protocols: tuple[str, ...] = PROTOCOLS
    """Tried in this order; the first that gives a mapping is kept."""
    lease: int = 3600
    """Seconds asked for; renewed at half of what the router grants."""
    discover_timeout: float = 2.0
    """How long to wait for a router's answer to discovery (SSDP, NAT-PMP's first request)."""
    request_timeout: float = 5.0
    retry_interval: float = 300.0
    """After a failure (no router, refused, lost mapping), seconds before asking again."""
    delete_timeout: float = 2.0
    startup_wait: float = 3.0
    """How long ``open_nat`` waits for the first mapping before its first reachability check."""
    gateway: str | None = None
    """The router's address; None: this host's IPv4 default gateway."""
    natpmp_port: int = NATPMP_PORT
    description: str = "dedloc-jax p2p"
    attempts: int = 3
    """External ports tried: our listen port first, then random ones."""

    def __post_init__(self) -> None:
        unknown = set(self.protocols) - set(PROTOCOLS)
        if unknown or not self.protocols:
            raise ValueError(f"protocols must be some of {PROTOCOLS}, got {self.protocols}")
        if not 0 < self.lease < 1 << 31:
            raise ValueError("lease must be positive seconds")
        if self.attempts < 1:
            raise ValueError("attempts must be >= 1")

    @classmethod
    def testing(cls) -> PortMapConfig:
        return cls(discover_timeout=1.0, request_timeout=3.0, retry_interval=5.0)

    def replace(self, **changes: Any) -> PortMapConfig:
        return replace(self, **changes)


@dataclass(frozen=True)
class PortMapping:
    """One mapping held: the router forwards ``external_ip:external_port`` to our port."""

    protocol: str
    external_ip: str
    external_port: int
    internal_port: int
    lease: int  # seconds granted (0: permanent, UPnP routers that take no lease)

    @property
    def addr(self) -> Multiaddr:
        return Multiaddr.parse(f"/ip4/{self.external_ip}/tcp/{self.external_port}")


def local_ip_towards(host: str) -> str:
    """Our address on the interface that routes to ``host`` (no packet is sent)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((host, 9))
        return s.getsockname()[0]
    finally:
        s.close()


def mappable_port(node: Node) -> int | None:
    """The TCP port of the node's first IPv4 listener that a home router could forward to: a
    private address or the wildcard. None for simulated, loopback-only or public listeners
    (a host with a public address needs no mapping)."""
    for addr in node.listen_addrs:
        ip = addr.value_of("ip4")
        if ip is None or not addr.port:
            continue
        parsed = ipaddress.IPv4Address(ip)
        if parsed.is_unspecified or (parsed.is_private and not parsed.is_loopback):
            return addr.port
    return None


class PortMapper:
    """Holds a mapping of ``internal_port`` while :meth:`run` runs; ``on_change`` is called
    whenever :attr:`mapping` changes (got, moved, lost)."""

    def __init__(
        self,
        internal_port: int,
        config: PortMapConfig,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.internal_port = internal_port
        self.config = config
        self.on_change = on_change
        self.mapping: PortMapping | None = None
        self.last_error: str | None = None
        self.first_attempt = trio.Event()
        self._pcp_nonce = os.urandom(12)  # names our mapping to the router (renew, delete)
        self._upnp: UPnPClient | None = None
        self._rng = random.Random()

    @property
    def addr(self) -> Multiaddr | None:
        return self.mapping.addr if self.mapping is not None else None

    def _set(self, mapping: PortMapping | None) -> None:
        if mapping != self.mapping:
            if mapping is not None:
                logger.info(
                    "port mapping by %s: %s -> local port %d (lease %d s)",
                    mapping.protocol,
                    mapping.addr,
                    mapping.internal_port,
                    mapping.lease,
                )
            else:
                logger.info("port mapping lost")
            self.mapping = mapping
            self.on_change()

    def _gateway(self) -> str | None:
        return self.config.gateway or default_gateway()

    # ---- one request ---------------------------------------------------------------------
    def _ports(self, current: PortMapping | None) -> list[int]:
        if current is not None:
            return [current.external_port]  # renewing: keep the port peers know
        ports = [self.internal_port]
        while len(ports) < self.config.attempts:
            ports.append(self._rng.randrange(20000, 60000))
        return ports

    async def _first_granted(
        self, protocol: str, current: PortMapping | None, ask: Callable[[int], Awaitable[Any]]
    ) -> Any:
        """``ask(port)`` for each external port to try (:meth:`_ports`) until the router grants
        one; its last refusal otherwise. A router of the other protocol is not asked again."""
        last: PortMapError | None = None
        for port in self._ports(current):
            try:
                return await ask(port)
            except OtherProtocol:
                raise
            except PortMapRefused as e:
                last = e
        raise last or PortMapError(f"{protocol} gave no mapping")

    async def _natpmp(self, current: PortMapping | None) -> PortMapping:
        gateway = self._gateway()
        if gateway is None:
            raise PortMapError("no default gateway")
        client = NATPMPClient(
            gateway, port=self.config.natpmp_port, first_wait=self.config.discover_timeout / 8
        )
        external = await client.external_address()
        lease = self.config.lease
        got = await self._first_granted(
            "NAT-PMP", current, lambda port: client.map(self.internal_port, port, lease)
        )
        return PortMapping(
            "natpmp", external.address, got.external_port, self.internal_port, got.lifetime
        )

    def _pcp_client(self) -> PCPClient:
        gateway = self._gateway()
        if gateway is None:
            raise PortMapError("no default gateway")
        return PCPClient(
            gateway,
            local_ip_towards(gateway),
            self._pcp_nonce,
            port=self.config.natpmp_port,
            first_wait=self.config.discover_timeout / 8,
        )

    async def _pcp(self, current: PortMapping | None) -> PortMapping:
        client = self._pcp_client()
        lease = self.config.lease
        got = await self._first_granted(
            "PCP", current, lambda port: client.map(self.internal_port, port, lease)
        )
        return PortMapping(
            "pcp", got.external_address, got.external_port, self.internal_port, got.lifetime
        )

    async def _upnp_map(self, current: PortMapping | None) -> PortMapping:
        if self._upnp is None:
            self._upnp = await UPnPClient.find(
                self._gateway(),
                timeout=self.config.discover_timeout,
                request_timeout=self.config.request_timeout,
            )
        igd = self._upnp
        client = local_ip_towards(igd.host)
        external = await igd.external_ip()
        lease = self.config.lease
        last: PortMapError | None = None
        for port in self._ports(current):
            try:
                await igd.add_port_mapping(
                    port, self.internal_port, client, lease, self.config.description
                )
            except PortMapRefused as e:
                last = e
                if fault_code(e) == UPNP_PERMANENT_ONLY and lease:
                    lease = 0
                    try:
                        await igd.add_port_mapping(
                            port, self.internal_port, client, 0, self.config.description
                        )
                    except PortMapRefused as e2:
                        last = e2
                        continue
                else:
                    continue
            return PortMapping("upnp", external, port, self.internal_port, lease)
        raise last or PortMapError("UPnP gave no mapping")

    async def request(self) -> PortMapping:
        """Ask for (or renew) the mapping by each protocol in turn; PortMapError if none."""
        current = self.mapping
        reasons = []
        for protocol in self.config.protocols:
            if current is not None and current.protocol != protocol:
                continue
            try:
                with trio.fail_after(
                    self.config.discover_timeout + 3 * self.config.request_timeout
                ):
                    if protocol == "natpmp":
                        return await self._natpmp(current)
                    if protocol == "pcp":
                        return await self._pcp(current)
                    return await self._upnp_map(current)
            except (PortMapError, OSError, trio.TooSlowError) as e:
                if protocol == "upnp":
                    self._upnp = None  # find the gateway afresh next time
                reasons.append(f"{protocol}: {e or type(e).__name__}")
        raise PortMapError("; ".join(reasons))

    async def delete(self) -> None:
        mapping = self.mapping
        if mapping is None:
            return
        try:
            if mapping.protocol == "pcp":
                await self._pcp_client().unmap(self.internal_port)
            elif mapping.protocol == "natpmp":
                gateway = self._gateway()
                if gateway is not None:
                    client = NATPMPClient(gateway, port=self.config.natpmp_port, tries=2)
                    await client.unmap(self.internal_port)
            elif self._upnp is not None:
                await self._upnp.delete_port_mapping(mapping.external_port)
            logger.info("port mapping %s deleted", mapping.addr)
        except (PortMapError, OSError) as e:
            logger.info("could not delete port mapping %s: %s", mapping.addr, e)
        self.mapping = None

    # ---- the task ------------------------------------------------------------------------
    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Map at once (reported started after the first attempt, mapped or not), renew at
        half the lease, retry after failures, delete on exit."""
        started = False
        try:
            while True:
                try:
                    self._set(await self.request())
                    self.last_error = None
                    lease = self.mapping.lease if self.mapping else 0
                    wait = lease / 2 if lease else self.config.lease / 2
                except PortMapError as e:
                    if self.mapping is not None or not started:
                        logger.info("no port mapping: %s", e)
                    self.last_error = str(e)
                    self._set(None)
                    wait = self.config.retry_interval
                if not started:
                    started = True
                    self.first_attempt.set()
                    task_status.started()
                await trio.sleep(max(wait, 1.0))
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(self.config.delete_timeout):
                await self.delete()
