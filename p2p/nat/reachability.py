"""The NAT manager: observe, probe, and pick a role (public, relayed, or client).

:func:`open_nat` wires everything into a node: the identify and dial-back services, the relay
service (on by default, refusing while we are known to be private), the circuit transport.
It then asks the given peers how they see us and whether they can dial us back. A private
node keeps reservations on up to ``max_relays`` relays (given, or tried among the peers) and
adds the relayed addresses to ``node.addrs``; with no relay it becomes a *client*: it uses
the network (DHT queries, sending its gradients) without serving others. The verdict is
re-checked periodically, sooner after a change or failed dial-backs, and whenever the
observed addresses change; a user can force it. Relay reservations, advertised addresses and
(see :meth:`NATManager.use_dht`) the DHT's client/server mode follow every change.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import trio

from p2p.errors import P2PError
from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr
from p2p.nat.autonat import AutoNATConfig, DialBackAnswer, DialBackServer, Reachability, probe
from p2p.nat.circuit import CircuitTransport, attach
from p2p.nat.discovery import advertise_relay, find_relays, publish_addrs
from p2p.nat.holepunch import HolePunchConfig, HolePuncher
from p2p.nat.observed import IDENTIFY, ObservedAddrs, handle_identify, identify
from p2p.nat.portmap import PortMapConfig, PortMapper, mappable_port
from p2p.nat.relay import RelayConfig, RelayService

if TYPE_CHECKING:
    from p2p.dht import DHT
    from p2p.node import Node

logger = logging.getLogger(__name__)


class Role(enum.StrEnum):
    """How a node takes part: serving others directly, through relays, or as a client."""

    PUBLIC = "public"
    RELAYED = "relayed"
    CLIENT = "client"
    UNKNOWN = "unknown"


def decide_role(
    reachability: Reachability, relays: int, *, force_client: bool | None = None
) -> Role:
    """The role for a reachability verdict and a count of relay reservations held (pure).

    An unknown verdict keeps the node a server (``UNKNOWN``): wrongly serving costs others a
    failed dial, wrongly hiding would shrink a young network that cannot judge us yet.
    """
    if force_client is True:
        return Role.CLIENT
    if reachability is Reachability.PUBLIC:
        return Role.PUBLIC
    if reachability is Reachability.PRIVATE:
        if relays > 0:
            return Role.RELAYED
        return Role.UNKNOWN if force_client is False else Role.CLIENT
    return Role.UNKNOWN


@dataclass(frozen=True)
class NATConfig:
    """Reachability detection, relaying and client-mode settings of a node."""

    force_reachability: Reachability | None = None
    """Skip detection and take this verdict (e.g. a server with a known public address)."""
    force_client_mode: bool | None = None
    """True: always a client; False: never a client; None: decide from reachability."""
    offer_relay: bool = True
    """Serve as a relay for others while not known to be private."""
    max_relays: int = 2
    """Reservations an unreachable node keeps."""
    autonat: AutoNATConfig = field(default_factory=AutoNATConfig)
    relay: RelayConfig = field(default_factory=RelayConfig)
    hole_punching: HolePunchConfig | None = field(default_factory=HolePunchConfig)
    """Try to replace relayed connections by direct ones (None: never)."""
    identify_timeout: float = 10.0
    observe_interval: float = 60.0
    """How often connected peers are asked again how they see us."""
    observers: int = 8
    """How many connected peers are asked each time (in turn, not all of them: a node of a
    large collaboration holds hundreds of connections, and a few reports settle the address)."""
    advertise_interval: float = 300.0
    """How often relay adverts and relayed addresses are refreshed in the DHT (see use_dht)."""
    port_mapping: PortMapConfig | None = field(default_factory=PortMapConfig)
    """Ask the home router (NAT-PMP, PCP, UPnP IGD) to forward a port to our listener; with a
    mapping the node advertises it first and is public unless dial-backs prove otherwise.
    None: never (also skipped for loopback listeners and a forced reachability)."""

    def __post_init__(self) -> None:
        if self.force_reachability is not None:  # accept "public"/"private" as well
            object.__setattr__(self, "force_reachability", Reachability(self.force_reachability))
        if self.max_relays < 0:
            raise ValueError("max_relays must be >= 0")
        if self.observers < 1:
            raise ValueError("observers must be >= 1")

    @classmethod
    def default(cls) -> NATConfig:
        return cls()

    @classmethod
    def testing(cls) -> NATConfig:
        return cls(
            autonat=AutoNATConfig.testing(),
            relay=RelayConfig.testing(),
            identify_timeout=5.0,
            port_mapping=PortMapConfig.testing(),
        )

    def replace(self, **changes: Any) -> NATConfig:
        return replace(self, **changes)


class NATManager:
    """Reachability and role of one node; create it with :func:`open_nat`."""

    def __init__(self, node: Node, config: NATConfig, nursery: trio.Nursery) -> None:
        self.node = node
        self.config = config
        self._nursery = nursery
        self.observed = ObservedAddrs()
        self.dialback = DialBackServer(node, config.autonat)
        self.relay = RelayService(node, config.relay, enabled=config.offer_relay)
        self.circuits: CircuitTransport = attach(node)
        self.puncher: HolePuncher | None = None
        if config.hole_punching is not None:
            self.puncher = HolePuncher(node, nursery, self.observed.hosts, config.hole_punching)
            if self.puncher.supported and config.hole_punching.auto:
                self.circuits.notify_dials(self._schedule_upgrade)
        self.reachability = config.force_reachability or Reachability.UNKNOWN
        self.port_mapper: PortMapper | None = None
        port = mappable_port(node)
        if config.port_mapping is not None and config.force_reachability is None and port:
            self.port_mapper = PortMapper(port, config.port_mapping, self._recheck_soon)
        self.public_addrs: list[Multiaddr] = []
        self.answers: list[DialBackAnswer] = []
        """The answers of the last dial-back probe."""
        self.peers: list[Multiaddr | PeerID] = []
        self.relay_candidates: list[Multiaddr] = []
        self._relay_tasks: dict[PeerID, trio.CancelScope] = {}
        self._direct_addrs = [a for a in node.addrs if not a.is_relayed]
        self._changed = trio.Event()
        self._recheck = trio.Event()
        self._observe_turn = 0
        # what each peer reported on the connection we asked it over (peer -> (connection,
        # observed)): a connection's observed address cannot change while it is open
        self._identified: dict[PeerID, tuple[Any, Multiaddr | None]] = {}
        self.role = self._decide()
        self._state: tuple[Role, Reachability, tuple[Multiaddr, ...]] | None = None
        self._dht: DHT | None = None
        self._published = False
        self._unsettled = False  # the last check changed the verdict or met new failures
        self._failed_before = False  # some dial-back of the last check failed

    # ---- state ---------------------------------------------------------------------------

    @property
    def client_mode(self) -> bool:
        """Whether to take part as a client (DHT client mode, no aggregation share)."""
        return self.role is Role.CLIENT

    @property
    def dht_client_mode(self) -> bool:
        """Whether the DHT should only be used, not served: a private node is a DHT client even
        when relayed (a DHT server must be dialable directly: every query through a relay
        would cost a circuit), unless a mode was forced."""
        if self.config.force_client_mode is not None:
            return self.config.force_client_mode
        return self.reachability is Reachability.PRIVATE

    @property
    def relayed_addrs(self) -> list[Multiaddr]:
        return list(self.circuits.reservations.values())

    def _decide(self) -> Role:
        return decide_role(
            self.reachability,
            len(self.circuits.reservations),
            force_client=self.config.force_client_mode,
        )

    def _update(self) -> None:
        role = self._decide()
        self.relay.enabled = (
            self.config.offer_relay and self.reachability is not Reachability.PRIVATE
        )
        # best first, as dialers try them in this order: dial-back proven public addresses
        # (e.g. a forwarded port on the router's address), then relays, then the rest
        advertised: list[Multiaddr] = []
        if self.reachability is Reachability.PUBLIC:
            advertised += [a.with_peer(self.node.peer_id) for a in self.public_addrs]
        advertised += [a for a in self.relayed_addrs if a not in advertised]
        for addr in self._direct_addrs:  # kept even when private: peers on the same LAN
            if addr not in advertised:
                advertised.append(addr)
        if self._dht is not None:
            self._dht.set_client_mode(self.dht_client_mode)
        state = (role, self.reachability, tuple(advertised))
        if state == self._state:
            return  # nothing changed: wake nobody (waiters loop on changes)
        if self._state is not None and self._state[1] is not self.reachability:
            logger.info("reachability %s -> %s", self._state[1].value, self.reachability.value)
        self._state = state
        self.node.addrs[:] = advertised
        if role is not self.role:
            logger.info(
                "role %s -> %s (%s, %d relays)",
                self.role.value,
                role.value,
                self.reachability.value,
                len(self.circuits.reservations),
            )
            self.role = role
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        """Return at the next change of reachability, reservations or role."""
        await self._changed.wait()

    def _recheck_soon(self) -> None:
        """The port mapping changed: check reachability again (the run loop does)."""
        self._recheck.set()

    def force(self, reachability: Reachability | None) -> None:
        """Force a verdict (None: detect again)."""
        self.config = self.config.replace(force_reachability=reachability)
        if self.config.force_reachability is not None:
            self.reachability = self.config.force_reachability
            self._update()
        self._recheck.set()

    # ---- probing -------------------------------------------------------------------------

    def _probe_peers(self) -> list[PeerID]:
        out: list[PeerID] = []
        for peer in self.node.connected_peers():
            conn = self.node.connection_to(peer)
            if conn is not None and conn.remote_addr is not None and conn.remote_addr.is_relayed:
                continue
            out.append(peer)
        return out

    def _observers(self) -> list[PeerID]:
        """The next ``observers`` connected peers, taken in turn (by peer ID) so that
        successive rounds hear from different ones."""
        peers = sorted(self._probe_peers(), key=lambda p: p.digest)
        n = self.config.observers
        if len(peers) <= n:
            return peers
        start = self._observe_turn % len(peers)
        self._observe_turn += n
        return (peers[start:] + peers[:start])[:n]

    async def _identify_all(self, peers: Sequence[Multiaddr | PeerID]) -> None:
        """Ask each peer how it sees us; a peer already asked over the connection we still
        hold to it is not asked again (the same connection shows the same address: libp2p
        identifies once per connection too), its report is renewed without the RPC."""
        now = trio.current_time()
        for pid, (conn, _) in list(self._identified.items()):
            if self.node.connection_to(pid) is not conn:
                del self._identified[pid]  # closed or replaced: a new one is asked again

        async def one(peer: Multiaddr | PeerID) -> None:
            known = self._identified.get(peer) if isinstance(peer, PeerID) else None
            if known is not None:
                if known[1] is not None:
                    self.observed.record(peer, known[1], now)
                return
            try:
                result = await identify(self.node, peer, timeout=self.config.identify_timeout)
            except P2PError as e:
                logger.debug("identify %s failed: %s", peer, e)
                return
            conn = self.node.connection_to(result.peer)
            if conn is not None:
                self._identified[result.peer] = (conn, result.observed)
            if result.observed is not None:
                self.observed.record(result.peer, result.observed, trio.current_time())

        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(one, peer)

    async def check(self, *, identify_first: bool = True) -> Reachability:
        """Identify the known peers, ask them to dial us back, and update the verdict."""
        if identify_first:
            await self._identify_all([*self.peers, *self._observers()])
        before = self.reachability
        if self.config.force_reachability is not None:
            self.reachability = self.config.force_reachability
            self._unsettled = False
        else:
            mapped = self.port_mapper.addr if self.port_mapper is not None else None
            candidates = self.observed.candidates(self._direct_addrs)
            if mapped is not None:
                candidates = [mapped, *(c for c in candidates if c != mapped)]
            verdict, answers = await probe(
                self.node, self._probe_peers(), candidates, self.config.autonat
            )
            self.answers = answers
            heard = any(a.status in ("ok", "failed") for a in answers)
            if not heard and before is not Reachability.UNKNOWN and mapped is None:
                # errors and refusals say nothing about us: keep the verdict (turning a
                # private node "unknown" made it a DHT server and a relay from behind its
                # NAT), and ask again soon
                logger.info("no dial-back answered: staying %s", before.value)
                self._unsettled = True
                return await self._settle()
            confirmed = [a.addr.transport_part() for a in answers if a.status == "ok" and a.addr]
            if mapped is not None and verdict is not Reachability.PRIVATE:
                # the router forwards the port: public, even before peers could confirm it
                # (a dial-back that fails at the mapped address, behind a second NAT, wins)
                verdict = Reachability.PUBLIC
                confirmed.insert(0, mapped)
            self.public_addrs = list(dict.fromkeys(confirmed))
            self.reachability = verdict
            # failed dial-backs where none failed before: check again soon, not in 15 minutes
            failed = any(a.status == "failed" for a in answers)
            self._unsettled = verdict is not before or (failed and not self._failed_before)
            self._failed_before = failed
        return await self._settle()

    async def _settle(self) -> Reachability:
        """Bring relays, addresses and modes in line with the verdict just reached."""
        if self.reachability is Reachability.PRIVATE:
            await self.ensure_relays()  # decide once the reservations are known (no flapping)
        else:
            if self.reachability is Reachability.PUBLIC and self._relay_tasks:
                await self.drop_relays()  # reachable directly now: relays only cost a hop
            self._update()
        return self.reachability

    # ---- relays --------------------------------------------------------------------------

    async def ensure_relays(self, candidates: Sequence[Multiaddr | str] = ()) -> int:
        """Hold reservations on up to ``max_relays`` relays; returns how many are held."""
        pool = [Multiaddr.parse(c) for c in candidates] + self.relay_candidates
        pool += [p for p in self.peers if isinstance(p, Multiaddr)]
        for addr in pool:
            if len(self._relay_tasks) >= self.config.max_relays:
                break
            rid = addr.peer_id
            if (
                rid is None
                or addr.is_relayed
                or rid in self._relay_tasks
                or rid == self.node.peer_id
            ):
                continue
            try:
                await self._nursery.start(self._keep_relay, addr)
            except P2PError as e:
                logger.info("no reservation on %s: %s", addr, e)
        self._update()
        return len(self.circuits.reservations)

    async def _keep_relay(
        self, addr: Multiaddr, *, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        rid = addr.peer_id
        assert rid is not None
        with trio.CancelScope() as scope:
            self._relay_tasks[rid] = scope
            try:
                await self.circuits.listen(addr, self.node.accept_inbound, task_status=task_status)
            finally:
                del self._relay_tasks[rid]
                self._update()

    async def drop_relays(self) -> None:
        for scope in list(self._relay_tasks.values()):
            scope.cancel()
        await trio.lowlevel.checkpoint()

    # ---- the DHT -----------------------------------------------------------------------------

    def use_dht(self, dht: DHT) -> None:
        """Keep the DHT in step with our reachability, from now on: client mode while private
        (:attr:`dht_client_mode`), server otherwise; a public relay advertises itself; a
        private node short of relays looks for some there; a relayed node publishes its
        (relayed) addresses so that others can find it by peer ID, and publishes again when
        they change (also once it turned public: the relayed ones are gone)."""
        self._dht = dht
        dht.set_client_mode(self.dht_client_mode)
        self._nursery.start_soon(self._dht_loop, dht)

    async def _dht_loop(self, dht: DHT) -> None:
        ttl = 2 * self.config.advertise_interval
        while True:
            try:
                if self.role is Role.PUBLIC and self.relay.enabled:
                    await advertise_relay(dht, self.node, ttl)
                if self.reachability is Reachability.PRIVATE:
                    if len(self._relay_tasks) < self.config.max_relays:
                        await self.ensure_relays(await find_relays(dht))
                    if self.relayed_addrs:
                        self._published = await publish_addrs(dht, self.node, ttl)
                elif self._published:
                    await publish_addrs(dht, self.node, ttl)
            except P2PError as e:
                logger.info("DHT upkeep failed: %s", e)
            with trio.move_on_after(self.config.advertise_interval):
                await self.wait_changed()

    # ---- direct connection upgrade --------------------------------------------------------

    def _schedule_upgrade(self, peer: PeerID) -> None:
        self._nursery.start_soon(self._upgrade_soon, peer)

    async def _upgrade_soon(self, peer: PeerID) -> None:
        """Once the relayed connection we just dialed is up, try to go direct."""
        assert self.puncher is not None
        with trio.move_on_after(self.node.config.handshake_timeout + 1):
            while self.node.connection_to(peer) is None:
                await trio.sleep(0.05)
        await self.puncher.upgrade(peer)

    # ---- background ----------------------------------------------------------------------

    async def run(self) -> None:
        """Re-check periodically; soon (``unknown_recheck_interval``) while the verdict is
        unknown, just changed, or some dial-backs failed; at once when our observed host
        changes or on request."""
        self._nursery.start_soon(self._follow_reservations)
        last_check = trio.current_time()
        while True:
            interval = (
                self.config.autonat.unknown_recheck_interval
                if self.reachability is Reachability.UNKNOWN or self._unsettled
                else self.config.autonat.recheck_interval
            )
            with trio.move_on_after(min(interval, self.config.observe_interval)):
                await self._recheck.wait()
            asked = self._recheck.is_set()
            self._recheck = trio.Event()
            before = self.observed.hosts()
            await self._identify_all(self._observers())
            moved = self.observed.hosts() != before
            if moved:
                logger.info("observed address changed: re-checking reachability")
            if asked or moved or trio.current_time() - last_check >= interval:
                await self.check(identify_first=False)
                last_check = trio.current_time()

    async def _follow_reservations(self) -> None:
        while True:
            await self.circuits.wait_changed()
            self._update()


@asynccontextmanager
async def open_nat(
    node: Node,
    *,
    peers: Sequence[str | Multiaddr | PeerID] = (),
    relays: Sequence[str | Multiaddr] = (),
    config: NATConfig = NATConfig(),
    background: bool = True,
) -> AsyncIterator[NATManager]:
    """Run NAT traversal on ``node`` for the block: services, a first check, re-checks.

    ``peers``: whom to ask (typically the DHT's initial peers); ``relays``: preferred relays
    (otherwise the peers are tried as relays). Open the DHT *after* this, with
    ``client_mode=nat.client_mode``, so it advertises the relayed addresses.
    """
    async with trio.open_nursery() as nursery:
        nat = NATManager(node, config, nursery)
        nat.peers = [p if isinstance(p, PeerID) else Multiaddr.parse(p) for p in peers]
        nat.relay_candidates = [Multiaddr.parse(r) for r in relays]
        node.add_handler(IDENTIFY, handle_identify)
        nat.dialback.register()
        nat.relay.register()
        if nat.puncher is not None:
            nat.puncher.register()
        try:
            if nat.port_mapper is not None:
                # the first answer (or none) before the first check, so a mapped node starts
                # public; a router slower than this makes the mapping trigger a re-check
                nursery.start_soon(nat.port_mapper.run)
                with trio.move_on_after(nat.port_mapper.config.startup_wait):
                    await nat.port_mapper.first_attempt.wait()
            await nat.check()
            if background:
                nursery.start_soon(nat.run)
            yield nat
        finally:
            nursery.cancel_scope.cancel()
