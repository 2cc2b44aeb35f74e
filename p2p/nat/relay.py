"""The relay service: reachable peers forward circuits to peers that cannot accept connections.

Three streaming protocols, all over the node's ordinary secure connections:

* ``nat.relay.reserve`` (unreachable peer -> relay): the reservation lives as long as this
  stream stays open (at most ``reservation_ttl``; the peer then renews). It is bound to the
  *authenticated* peer ID of the connection, so nobody can reserve on another's behalf.
* ``nat.relay.hop`` (dialer -> relay): ``{"target": id}``; the relay checks its limits and
  that the target holds a reservation, opens
* ``nat.relay.stop`` (relay -> target, over the target's own connection to the relay):
  ``{"src": id}``; once both sides said ok, both streams carry raw bytes and the relay copies
  them across. The two ends run the secure handshake inside the circuit, so the relay sees
  only ciphertext and cannot pose as either end.

Every refusal is answered ``{"ok": False, "reason": ...}`` naming the limit. A circuit that
exceeds its byte budget (both directions together) or its duration is reset.
"""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import trio

from p2p.errors import ConnectionClosed, IdentityError, P2PError, ProtocolError
from p2p.identity import PeerID
from p2p.mux import MuxStream
from p2p.rpc import CallContext, MessageStream

if TYPE_CHECKING:
    from p2p.node import Node

logger = logging.getLogger(__name__)

RESERVE = "nat.relay.reserve"
HOP = "nat.relay.hop"
STOP = "nat.relay.stop"


@dataclass(frozen=True)
class RelayConfig:
    """Limits of a relay (the defaults let a volunteer relay averaging rounds for a few peers)."""

    max_reservations: int = 64
    max_reservations_per_ip: int = 8
    reservation_ttl: float = 3600.0
    """A reservation ends after this; the peer renews it with a new request."""
    max_circuits: int = 256
    """Circuits open at once through this relay."""
    max_circuits_per_peer: int = 64
    """Circuits one peer takes part in at once (as source or as target): a relayed member of
    an averaging group (up to 64 members) is dialed by every other member."""
    max_circuit_bytes: int = 256 << 20
    """Bytes one circuit may carry, both directions together; then it is reset. Dialers
    renew a circuit at half of it (:class:`~p2p.nat.circuit.CircuitTransport`), so the other
    half must hold the largest stream in flight: one averaging part and its result
    (sahajBERT: under 72 MB, its 18M parameters in float32)."""
    max_circuit_duration: float = 1800.0
    """Seconds a circuit may stay open; then it is reset (renewed at half, as above)."""
    connect_timeout: float = 10.0
    """Reaching the target over its reservation must finish within this."""
    request_timeout: float = 10.0
    """A hop or reserve request must arrive within this."""
    buffer_size: int = 256 << 10
    """Largest chunk read from one side before it is written to the other."""

    @classmethod
    def default(cls) -> RelayConfig:
        return cls()

    @classmethod
    def bulk(cls) -> RelayConfig:
        """A trusted collaboration with very large models: larger, longer circuits."""
        return cls(
            max_circuit_bytes=64 << 30, max_circuit_duration=24 * 3600.0, max_circuits_per_peer=128
        )

    @classmethod
    def testing(cls) -> RelayConfig:
        return cls(
            max_reservations=4,
            max_circuits=8,
            max_circuits_per_peer=2,
            max_circuit_bytes=1 << 20,
            max_circuit_duration=60.0,
            connect_timeout=5.0,
            request_timeout=5.0,
        )

    def replace(self, **changes: Any) -> RelayConfig:
        return replace(self, **changes)


@dataclass
class Reservation:
    peer: PeerID
    ip: str
    expires: float
    scope: trio.CancelScope


@dataclass
class RelayStats:
    reservations_refused: int = 0
    circuits_opened: int = 0
    circuits_refused: int = 0
    circuits_cut: int = 0
    """Circuits reset for exceeding their byte or time budget."""
    bytes_relayed: int = 0
    refusals: Counter[str] = field(default_factory=Counter)
    """Refusals by kind (the reason without its figures)."""
    cuts: Counter[str] = field(default_factory=Counter)
    """Circuits cut, by kind ("circuit data limit", "circuit duration limit")."""


@dataclass(eq=False)
class Circuit:
    src: PeerID
    dst: PeerID
    started: float
    bytes: int = 0
    cut: str | None = None


def _peer_field(msg: Any, key: str) -> PeerID:
    if not isinstance(msg, dict) or not isinstance(msg.get(key), str):
        raise ProtocolError(f"relay request lacks {key!r}")
    try:
        return PeerID.from_base58(msg[key])
    except IdentityError as e:
        raise ProtocolError(f"relay request: bad {key}: {e}") from None


class RelayService:
    """Serves reservations and circuits for other peers, within :class:`RelayConfig` limits.

    ``enabled`` is switched off by the NAT manager while we are not publicly reachable (a
    relay nobody can reach helps nobody); requests are then refused with that reason.
    """

    def __init__(
        self, node: Node, config: RelayConfig = RelayConfig(), *, enabled: bool = True
    ) -> None:
        self.node = node
        self.config = config
        self.enabled = enabled
        self.reservations: dict[PeerID, Reservation] = {}
        self.circuits: set[Circuit] = set()
        self.stats = RelayStats()

    def register(self) -> None:
        self.node.add_stream_handler(RESERVE, self.handle_reserve)
        self.node.add_stream_handler(HOP, self.handle_hop)

    def unregister(self) -> None:
        self.node.remove_handler(RESERVE)
        self.node.remove_handler(HOP)

    def _circuits_of(self, peer: PeerID) -> int:
        return sum(1 for c in self.circuits if peer in (c.src, c.dst))

    # ---- reservations --------------------------------------------------------------------

    def reservation_refusal(self, peer: PeerID, ip: str, relayed: bool) -> str | None:
        """Why a reservation by ``peer`` is refused now, or None (pure bookkeeping)."""
        if not self.enabled:
            return "this node does not relay (not publicly reachable)"
        if relayed:
            return "reservations over a relayed connection are not accepted"
        if peer in self.reservations:
            return None  # a renewal replaces the old one
        if len(self.reservations) >= self.config.max_reservations:
            return f"reservation limit reached ({self.config.max_reservations} reservations)"
        same_ip = sum(1 for r in self.reservations.values() if r.ip == ip)
        if same_ip >= self.config.max_reservations_per_ip:
            return f"reservation limit per address reached ({self.config.max_reservations_per_ip})"
        return None

    async def handle_reserve(self, ctx: CallContext, ms: MessageStream) -> None:
        peer = ctx.remote_peer
        addr = ctx.remote_addr
        ip = (addr.host if addr is not None else None) or "?"
        why = self.reservation_refusal(peer, ip, addr is not None and addr.is_relayed)
        if why is not None:
            self.stats.reservations_refused += 1
            self.stats.refusals[why.split(" (")[0]] += 1
            logger.info("refusing reservation of %s: %s", peer, why)
            await ms.send({"ok": False, "reason": why})
            return
        old = self.reservations.get(peer)
        if old is not None:
            old.scope.cancel()
        ttl = self.config.reservation_ttl
        scope = trio.CancelScope(deadline=trio.current_time() + ttl)
        res = Reservation(peer, ip, trio.current_time() + ttl, scope)
        self.reservations[peer] = res
        try:
            with scope:
                await ms.send({"ok": True, "ttl": ttl, "limits": self._limits()})
                logger.debug("reservation for %s (%s s)", peer, ttl)
                async for _ in ms:  # nothing is expected; the stream's end ends the reservation
                    pass
        except (ConnectionClosed, ProtocolError, trio.BrokenResourceError):
            pass
        finally:
            if self.reservations.get(peer) is res:
                del self.reservations[peer]

    # ---- circuits --------------------------------------------------------------------------

    def circuit_refusal(self, src: PeerID, dst: PeerID, relayed: bool) -> str | None:
        """Why a circuit from ``src`` to ``dst`` is refused now, or None (pure bookkeeping)."""
        if not self.enabled:
            return "this node does not relay (not publicly reachable)"
        if relayed:
            return "circuits over a relayed connection are not accepted"
        if dst == src or dst == self.node.peer_id:
            return "a circuit must lead to another peer"
        if dst not in self.reservations:
            return f"no reservation for {dst}"
        if len(self.circuits) >= self.config.max_circuits:
            return f"circuit limit reached ({self.config.max_circuits} circuits)"
        for peer in (src, dst):
            if self._circuits_of(peer) >= self.config.max_circuits_per_peer:
                return (
                    f"circuit limit per peer reached ({self.config.max_circuits_per_peer}"
                    f" circuits of {peer})"
                )
        if self.node.connection_to(dst) is None:
            return f"{dst} is not connected to this relay"
        return None

    async def _refuse(self, ms: MessageStream, why: str) -> None:
        self.stats.circuits_refused += 1
        self.stats.refusals[why.split(" (")[0]] += 1
        logger.info("refusing circuit: %s", why)
        await ms.send({"ok": False, "reason": why})

    async def handle_hop(self, ctx: CallContext, ms: MessageStream) -> None:
        src = ctx.remote_peer
        with trio.move_on_after(self.config.request_timeout) as scope:
            request = await ms.receive()
        if scope.cancelled_caught:
            return
        dst = _peer_field(request, "target")
        relayed = ctx.remote_addr is not None and ctx.remote_addr.is_relayed
        why = self.circuit_refusal(src, dst, relayed)
        if why is not None:
            await self._refuse(ms, why)
            return
        circuit = Circuit(src, dst, trio.current_time())
        self.circuits.add(circuit)  # counted from now on, while we reach the target
        try:
            await self._connect(ms, circuit)
        finally:
            self.circuits.discard(circuit)

    def _limits(self) -> dict:
        return {
            "bytes": self.config.max_circuit_bytes,
            "duration": self.config.max_circuit_duration,
        }

    async def _connect(self, ms: MessageStream, circuit: Circuit) -> None:
        async with AsyncExitStack() as stack:
            try:
                with trio.fail_after(self.config.connect_timeout):
                    stop = await stack.enter_async_context(
                        self.node.open_stream(
                            circuit.dst, STOP, timeout=self.config.connect_timeout
                        )
                    )
                    await stop.send({"src": circuit.src.to_base58(), "limits": self._limits()})
                    answer = await stop.receive()
            except trio.TooSlowError:
                await self._refuse(ms, "target did not answer in time")
                return
            except P2PError as e:
                await self._refuse(ms, f"target unreachable: {e}")
                return
            if not isinstance(answer, dict) or answer.get("ok") is not True:
                reason = answer.get("reason") if isinstance(answer, dict) else None
                await self._refuse(ms, f"target refused: {str(reason)[:200]}")
                return
            await ms.send({"ok": True, "limits": self._limits()})
            self.stats.circuits_opened += 1
            await self._pipe(ms.stream, stop.stream, circuit)

    async def _pipe(self, a: MuxStream, b: MuxStream, circuit: Circuit) -> None:
        """Copy bytes both ways until both sides finished, or the circuit's budget ran out."""
        with trio.move_on_at(circuit.started + self.config.max_circuit_duration) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._copy, a, b, circuit, nursery.cancel_scope)
                nursery.start_soon(self._copy, b, a, circuit, nursery.cancel_scope)
        if scope.cancelled_caught and circuit.cut is None:
            circuit.cut = f"circuit duration limit ({self.config.max_circuit_duration} s) reached"
        if circuit.cut is not None:
            self.stats.circuits_cut += 1
            self.stats.cuts[circuit.cut.split(" (")[0]] += 1
            logger.info("cutting circuit %s -> %s: %s", circuit.src, circuit.dst, circuit.cut)
            a.reset(circuit.cut)
            b.reset(circuit.cut)

    async def _copy(
        self, source: MuxStream, sink: MuxStream, circuit: Circuit, cancel: trio.CancelScope
    ) -> None:
        limit = self.config.max_circuit_bytes
        try:
            while True:
                data = await source.receive_some(self.config.buffer_size)
                if not data:
                    await sink.send_eof()
                    return
                if circuit.bytes + len(data) > limit:
                    circuit.cut = f"circuit data limit ({limit} bytes) reached"
                    cancel.cancel()
                    return
                circuit.bytes += len(data)
                self.stats.bytes_relayed += len(data)
                await sink.send_all(self.observe(circuit, data))
        except (ConnectionClosed, trio.ClosedResourceError, trio.BrokenResourceError) as e:
            source.reset(f"other side of the circuit closed: {e}")
            sink.reset(f"other side of the circuit closed: {e}")
            cancel.cancel()

    def observe(self, circuit: Circuit, data: Any) -> Any:
        """Every chunk passes through here on its way across (a hook for metering and tests)."""
        return data
