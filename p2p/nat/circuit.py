"""Relayed connections as a transport: dial ``RELAY/p2p-circuit/p2p/TARGET``, accept circuits.

A circuit is a stream through the relay that carries raw bytes once the relay said ok
(:mod:`p2p.nat.relay`). :class:`CircuitStream` presents it as a ``trio.abc.Stream``, so the
node runs its usual secure handshake inside it: the dialer expects the target's peer ID, so
whoever answers must hold the target's private key. A relayed address claimed by the wrong
peer, or a relay that forwards to someone else, therefore fails with ``PeerIDMismatch``.

The listening side (``listen(RELAY_ADDR, handler)``) keeps a reservation on one relay, renews
it when it ends, and hands arriving circuits to ``handler`` exactly like a TCP listener does;
circuits are accepted only from relays we hold a reservation on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import AsyncExitStack
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from p2p.errors import ConnectionClosed, DialError, MultiaddrError, P2PError
from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr
from p2p.mux import MuxStream
from p2p.nat.errors import RelayRefused
from p2p.nat.relay import HOP, RESERVE, STOP, _peer_field
from p2p.rpc import CallContext, MessageStream
from p2p.transport import ConnHandler

if TYPE_CHECKING:
    from p2p.node import Node

logger = logging.getLogger(__name__)


class CircuitStream(trio.abc.HalfCloseableStream):
    """The byte stream of one circuit end (a mux stream whose relay handshake is done).

    It counts the bytes it carries both ways (what the relay counts against the circuit's
    budget) and calls ``on_worn`` once, when ``renew_bytes`` were carried or at
    ``renew_time``, whichever comes first (checked as bytes pass).
    """

    def __init__(
        self,
        stream: MuxStream,
        stack: AsyncExitStack | None = None,
        *,
        renew_bytes: float = math.inf,
        renew_time: float = math.inf,
        on_worn: Callable[[CircuitStream], None] | None = None,
    ) -> None:
        self._stream = stream
        self._stack = stack
        self.bytes = 0
        self._renew_bytes = renew_bytes
        self._renew_time = renew_time
        self._on_worn = on_worn

    def _carried(self, n: int) -> None:
        self.bytes += n
        if self._on_worn is not None and (
            self.bytes >= self._renew_bytes or trio.current_time() >= self._renew_time
        ):
            on_worn, self._on_worn = self._on_worn, None
            on_worn(self)

    @property
    def ended(self) -> bool:
        """Whether the circuit is over (closed by us, or finished or reset by the relay)."""
        return self._stream.finished

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self._stream.send_all(data)
        except ConnectionClosed as e:
            raise trio.BrokenResourceError(str(e)) from e
        self._carried(len(data))

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        try:
            await self._stream.send_eof()
        except ConnectionClosed as e:
            raise trio.BrokenResourceError(str(e)) from e

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        try:
            data = await self._stream.receive_some(max_bytes)
        except ConnectionClosed as e:
            raise trio.BrokenResourceError(str(e)) from e
        self._carried(len(data))
        return data

    async def aclose(self) -> None:
        self._stream.reset("circuit closed")
        if self._stack is not None:
            stack, self._stack = self._stack, None
            with trio.CancelScope(shield=True):
                await stack.aclose()
        await trio.lowlevel.checkpoint()


def circuit_addr(relay: Multiaddr, target: PeerID) -> Multiaddr:
    """``RELAY/p2p-circuit/p2p/TARGET`` for a relay's full address (ending in its /p2p/ ID)."""
    if relay.peer_id is None or relay.is_relayed:
        raise MultiaddrError(f"a relay address ends in /p2p/<relay> and is direct: {relay}")
    return Multiaddr.parse(f"{relay}/p2p-circuit/p2p/{target.to_base58()}")


class CircuitTransport:
    """Dials and listens on relayed addresses on behalf of ``node`` (see :func:`attach`).

    Circuits we dial are renewed before the relay cuts them: once one carried ``renew_at``
    of the relay's byte budget, or lived that share of its duration limit, a new circuit to
    the same peer is dialed in the background; it takes the peer's new streams and the old
    one drains (its streams finish on it), so a long-lived connection outlives any one
    circuit. ``renew_at=None`` never renews.
    """

    def __init__(
        self,
        node: Node,
        *,
        renew_backoff: float = 5.0,
        max_backoff: float = 300.0,
        renew_at: float | None = 0.5,
    ) -> None:
        if renew_at is not None and not 0 < renew_at < 1:
            raise ValueError("renew_at must be in (0, 1) (None: never renew)")
        self.node = node
        self.renew_backoff = renew_backoff
        self.max_backoff = max_backoff
        self.renew_at = renew_at
        self.renewed = 0
        """Circuits replaced before their relay's limits (see ``renew_at``)."""
        self._listeners: dict[PeerID, tuple[Multiaddr, ConnHandler]] = {}
        self.reservations: dict[PeerID, Multiaddr] = {}
        """Relay -> our relayed address through it, for every reservation held now."""
        self._changed = trio.Event()
        self._on_dialed: Callable[[PeerID], None] | None = None

    def notify_dials(self, on_dialed: Callable[[PeerID], None]) -> None:
        """Call ``on_dialed(target)`` after each successful relayed dial (hole punching upgrades
        the connection). A method, not a constructor argument: the transport is one per node
        (:func:`attach`) and may predate the NAT manager that punches holes."""
        self._on_dialed = on_dialed

    # ---- dialing -------------------------------------------------------------------------

    async def dial(self, addr: Multiaddr) -> trio.abc.Stream:
        """A raw stream to the target of a relayed address (RelayRefused names the reason)."""
        try:
            parts = Multiaddr.parse(addr).relay_parts()
        except MultiaddrError as e:
            raise DialError(str(e)) from None
        if parts is None:
            raise DialError(f"not a relayed address: {addr}")
        relay, target = parts
        if relay.is_relayed:
            raise DialError(f"circuits over circuits are not supported: {addr}")
        if target == self.node.peer_id:
            raise DialError("cannot dial ourselves through a relay")
        stack = AsyncExitStack()
        try:
            ms: MessageStream = await stack.enter_async_context(
                self.node.open_stream(relay, HOP, timeout=self.node.config.dial_timeout)
            )
            await ms.send({"target": target.to_base58()})
            answer = await ms.receive()
        except P2PError as e:
            await stack.aclose()
            if isinstance(e, DialError):
                raise
            raise DialError(f"relay {relay.peer_id}: {e}") from e
        except BaseException:
            await stack.aclose()
            raise
        if not isinstance(answer, dict) or answer.get("ok") is not True:
            await stack.aclose()
            reason = answer.get("reason") if isinstance(answer, dict) else None
            raise RelayRefused(str(reason or "malformed answer")[:300])
        if self._on_dialed is not None:
            self._on_dialed(target)
        if self.renew_at is None:
            return CircuitStream(ms.stream, stack)
        budget, duration = _limits(answer.get("limits"))
        return CircuitStream(
            ms.stream,
            stack,
            renew_bytes=budget * self.renew_at,
            renew_time=trio.current_time() + duration * self.renew_at,
            on_worn=partial(self.node.start_soon, self._renew, addr),
        )

    async def _renew(self, addr: Multiaddr, worn: CircuitStream) -> None:
        """Replace the connection over a circuit near its limits by one over a new circuit
        (not when the peer's connection is direct by now: a hole punched meanwhile). A refused
        renewal (the relay's per-peer limit, while a replaced circuit still drains) is retried
        with backoff while the worn circuit lasts."""
        parts = Multiaddr.parse(addr).relay_parts()
        for attempt in range(6):
            current = self.node.connection_to(parts[1]) if parts is not None else None
            if current is not None and not (current.remote_addr and current.remote_addr.is_relayed):
                return
            logger.info("renewing the circuit to %s before its relay's limits", addr)
            try:
                await self.node.redial(addr)
            except P2PError as e:
                logger.info("renewing the circuit to %s failed: %s", addr, e)
            else:
                self.renewed += 1
                return
            await trio.sleep(min(2.0 * 2**attempt, 60.0))
            if worn.ended:
                return

    # ---- listening -----------------------------------------------------------------------

    async def listen(
        self, addr: Multiaddr, handler: ConnHandler, *, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Keep a reservation on the relay at ``addr`` and serve circuits arriving over it.

        Reports our relayed address once the first reservation is granted (raising
        RelayRefused/DialError if it is not); later losses are retried with backoff.
        """
        relay = Multiaddr.parse(addr)
        if relay.is_relayed:  # accept "RELAY/p2p-circuit" as well
            relay = Multiaddr(
                relay.components[: [p for p, _ in relay.components].index("p2p-circuit")]
            )
        rid = relay.peer_id
        if rid is None:
            raise DialError(f"a relay address must end in /p2p/<relay>: {addr}")
        if rid in self._listeners:
            raise DialError(f"already listening through {rid}")
        mine = circuit_addr(relay, self.node.peer_id)
        self._listeners[rid] = (relay, handler)
        backoff = self.renew_backoff
        started = False
        try:
            while True:
                granted_at: float | None = None
                try:
                    await self._direct_to(relay, rid)
                    async with self.node.open_stream(relay, RESERVE) as ms:
                        answer = await ms.receive()
                        if not isinstance(answer, dict) or answer.get("ok") is not True:
                            reason = answer.get("reason") if isinstance(answer, dict) else None
                            raise RelayRefused(str(reason or "malformed answer")[:300])
                        granted_at = trio.current_time()
                        if rid not in self.reservations:
                            self.reservations[rid] = mine
                            self._notify()
                            logger.info("reservation on %s held", rid)
                        if not started:
                            started = True
                            task_status.started(mine)
                        async for _ in ms:
                            pass
                    # The relay ended it (its TTL): renew at once, keeping our address meanwhile;
                    # a relay that keeps ending reservations quickly is treated as failing.
                    if trio.current_time() - granted_at >= self.renew_backoff:
                        backoff = self.renew_backoff
                        continue
                except P2PError as e:
                    if not started:
                        raise
                    logger.info("reservation on %s lost: %s", rid, e)
                if self.reservations.pop(rid, None) is not None:
                    self._notify()
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff)
        finally:
            del self._listeners[rid]
            if self.reservations.pop(rid, None) is not None:
                self._notify()

    async def _direct_to(self, relay: Multiaddr, rid: PeerID) -> None:
        """Make our connection to the relay a direct one: a relay grants reservations only
        over those (a circuit inside a circuit would carry nothing), and a peer it reached
        through another relay (it dialed our relayed address) would otherwise be refused."""
        current = self.node.connection_to(rid)
        if current is not None and current.relayed:
            logger.info("dialing relay %s directly for a reservation (connected via a relay)", rid)
            await self.node.redial(relay)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        """Return the next time a reservation is gained or lost."""
        await self._changed.wait()

    async def handle_stop(self, ctx: CallContext, ms: MessageStream) -> None:
        """A relay brings us a circuit: accept it only over a reservation we hold."""
        relay = ctx.remote_peer
        if relay not in self.reservations or relay not in self._listeners:
            await ms.send({"ok": False, "reason": "no reservation with this relay"})
            return
        with trio.move_on_after(self.node.config.header_timeout) as scope:
            request = await ms.receive()
        if scope.cancelled_caught:
            return
        src = _peer_field(request, "src")
        relay_addr, handler = self._listeners[relay]
        await ms.send({"ok": True})
        observed = circuit_addr(relay_addr, src)  # informative only: the handshake proves src
        raw = CircuitStream(ms.stream)
        try:
            await handler(raw, observed)
        except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            logger.debug("circuit from %s via %s ended: %r", src, relay, e)
        finally:
            await trio.aclose_forcefully(raw)


def _limits(limits: Any) -> tuple[float, float]:
    """(bytes, seconds) a relay announced for a circuit; unbounded where it said nothing."""
    out = []
    for key in ("bytes", "duration"):
        value = limits.get(key) if isinstance(limits, dict) else None
        ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        out.append(float(value) if ok else math.inf)
    return out[0], out[1]


def attach(node: Node) -> CircuitTransport:
    """Let ``node`` dial relayed addresses and accept circuits (idempotent)."""
    existing = getattr(node, "circuit_transport", None)
    if isinstance(existing, CircuitTransport):
        return existing
    transport = CircuitTransport(node)
    node.use_circuit_transport(transport)
    node.add_stream_handler(STOP, transport.handle_stop)
    return transport


__all__ = ["CircuitStream", "CircuitTransport", "attach", "circuit_addr"]
