"""AutoNAT: are we reachable? Ask a few peers to dial us back, then conclude.

A node cannot tell from inside whether a NAT or firewall sits in front of it. It sends a few
peers its candidate addresses (listen and observed ones); each tries a *fresh* connection to
them, with the full secure handshake expecting our peer ID, and says which one worked.
``public`` needs ``min_confirmations`` peers to have reached us, ``private`` that many to
have failed with none succeeding; anything else is ``unknown``.

Against abuse (using us to attack a third party): a server dials only addresses on the host
it observed the request coming from, at most ``max_addrs_per_request`` of them (dialed at
once, so the answer comes within one ``dial_timeout``), one request per peer at a time and
``max_concurrent_dialbacks`` in all.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import trio

from p2p.errors import MultiaddrError, P2PError, ProtocolError
from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr
from p2p.mux_frames import DIAL_BACK_PROBE, GOAWAY, encode_frame, reason_bytes
from p2p.rpc import CallContext
from p2p.secure import secure_outbound

if TYPE_CHECKING:
    from p2p.node import Node

logger = logging.getLogger(__name__)

DIAL_BACK = "nat.dialback"

PROBE_GOAWAY = encode_frame(GOAWAY, 0, reason_bytes(DIAL_BACK_PROBE))
"""What a dial-back sends once its handshake proved the address: a mux GOAWAY that processed
no stream. The dialed node runs a mux on every inbound connection and may already be using
this one (it can win the duplicate-connection tie-break against the node's own connection to
us); the GOAWAY tells it that whatever it opened here never reached us, so it retries on
another connection instead of failing. (CI caught a bootstrap ping lost on a dial-back.)"""
PROBE_LINGER = 2.0
"""Seconds a dial-back waits for the dialed node to close after the GOAWAY (it does at once):
closing first with its frames unread would reset the socket and could lose the GOAWAY."""


class Reachability(enum.StrEnum):
    """Whether other peers can open connections to us."""

    PUBLIC = "public"
    PRIVATE = "private"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class AutoNATConfig:
    """How reachability is probed, and how much dialing-back a node does for others."""

    peers_per_probe: int = 4
    """Peers asked to dial us back in one check."""
    min_confirmations: int = 2
    """Agreeing answers needed for a verdict (fewer if fewer peers answered at all)."""
    max_addrs_per_request: int = 8
    dial_timeout: float = 5.0
    """Server side: per address, transport dial plus handshake."""
    request_timeout: float = 20.0
    """Client side: waiting for one peer's verdict."""
    recheck_interval: float = 900.0
    """Re-check this often once settled (sooner when our observed addresses change)."""
    unknown_recheck_interval: float = 60.0
    max_concurrent_dialbacks: int = 8

    @classmethod
    def default(cls) -> AutoNATConfig:
        return cls()

    @classmethod
    def testing(cls) -> AutoNATConfig:
        """Short timeouts: simulator and loopback tests."""
        return cls(
            dial_timeout=2.0,
            request_timeout=8.0,
            recheck_interval=120.0,
            unknown_recheck_interval=20.0,
        )

    def replace(self, **changes: Any) -> AutoNATConfig:
        return replace(self, **changes)


@dataclass(frozen=True)
class DialBackAnswer:
    """One peer's verdict: ``ok`` (reached us at ``addr``), ``failed`` or ``refused``/error."""

    peer: PeerID
    status: str
    addr: Multiaddr | None = None
    reason: str = ""


def conclude(answers: Sequence[DialBackAnswer], min_confirmations: int) -> Reachability:
    """The verdict from several peers' answers (pure)."""
    ok = sum(1 for a in answers if a.status == "ok")
    failed = sum(1 for a in answers if a.status == "failed")
    need = max(1, min(min_confirmations, ok + failed))
    if ok >= need:
        return Reachability.PUBLIC
    if failed >= need and ok == 0:
        return Reachability.PRIVATE
    return Reachability.UNKNOWN


def eligible_addrs(requested: Any, observed: Multiaddr | None, limit: int) -> list[Multiaddr]:
    """The requested addresses a server may dial: on the requester's observed host only."""
    if observed is None or observed.is_relayed or observed.host is None:
        return []
    if not isinstance(requested, list):
        raise ProtocolError("dial-back request: addrs is not a list")
    out: list[Multiaddr] = []
    for text in requested[: limit * 4]:
        try:
            ma = Multiaddr.parse(text)
        except MultiaddrError:
            continue
        if ma.is_relayed or ma.host != observed.host or ma.port in (None, 0):
            continue
        if ma.components[0][0] != observed.components[0][0]:
            continue
        bare = ma.transport_part()
        if bare not in out:
            out.append(bare)
        if len(out) >= limit:
            break
    return out


@dataclass
class DialBackServer:
    """Dials peers back on request (the ``nat.dialback`` RPC)."""

    node: Node
    config: AutoNATConfig = field(default_factory=AutoNATConfig)
    _busy: set[PeerID] = field(default_factory=set)
    _limit: trio.CapacityLimiter | None = None

    def register(self) -> None:
        self._limit = trio.CapacityLimiter(self.config.max_concurrent_dialbacks)
        self.node.add_handler(DIAL_BACK, self.handle)

    async def handle(self, ctx: CallContext, request: Any) -> dict:
        if not isinstance(request, dict):
            raise ProtocolError("dial-back request is not a map")
        addrs = eligible_addrs(
            request.get("addrs"), ctx.remote_addr, self.config.max_addrs_per_request
        )
        if not addrs:
            return {"status": "refused", "reason": "no address on the host the request came from"}
        if ctx.remote_peer in self._busy:
            return {"status": "refused", "reason": "a dial-back for this peer is in progress"}
        assert self._limit is not None
        if self._limit.available_tokens == 0:
            return {"status": "refused", "reason": "too many dial-backs in progress"}
        self._busy.add(ctx.remote_peer)
        try:
            async with self._limit:
                reached, errors = await self._try_all(addrs, ctx.remote_peer)
        finally:
            self._busy.discard(ctx.remote_peer)
        if reached is not None:
            return {"status": "ok", "addr": str(reached)}
        return {"status": "failed", "reason": "; ".join(errors)[:900]}

    async def _try_all(
        self, addrs: Sequence[Multiaddr], peer: PeerID
    ) -> tuple[Multiaddr | None, list[str]]:
        """Dial ``addrs`` all at once, the first that proves to reach ``peer`` wins: the
        answer then comes within one ``dial_timeout`` (plus the linger), below the asker's
        ``request_timeout``. Tried one after the other, two silently dropped addresses took
        longer than the asker waited, and it heard an error instead of "failed"."""
        reached: list[Multiaddr] = []
        errors: list[str] = []

        async def one(addr: Multiaddr, cancel: trio.CancelScope) -> None:
            why = await self._try(addr, peer)
            if why is None:
                reached.append(addr)
                cancel.cancel()
            else:
                errors.append(f"{addr}: {why}")

        async with trio.open_nursery() as nursery:
            for addr in addrs:
                nursery.start_soon(one, addr, nursery.cancel_scope)
        return (reached[0] if reached else None), sorted(errors)

    async def _try(self, addr: Multiaddr, peer: PeerID) -> str | None:
        """None when a new connection to ``addr`` proved to reach ``peer``, else why not."""
        channel = None
        with trio.move_on_after(self.config.dial_timeout):
            try:
                raw = await self.node.transport.dial(addr)
            except (P2PError, OSError) as e:
                return str(e) or type(e).__name__
            try:
                channel = await secure_outbound(
                    raw, self.node.identity, peer, timeout=self.config.dial_timeout
                )
            except P2PError as e:
                return str(e) or type(e).__name__
            finally:
                if channel is None:  # failed or timed out mid-handshake
                    await trio.aclose_forcefully(raw)
        if channel is None:
            return "timed out"
        # Proven. Tell the dialed node before closing, and answer only once it has closed:
        # then nothing it sends us after our "ok" can land on this connection.
        try:
            with trio.move_on_after(PROBE_LINGER):
                try:
                    await channel.send_frame(PROBE_GOAWAY)
                    while True:
                        await channel.receive_frame()
                except P2PError:
                    pass
        finally:
            await trio.aclose_forcefully(channel)
        return None


async def ask_dial_back(
    node: Node, peer: PeerID, addrs: Sequence[Multiaddr], config: AutoNATConfig
) -> DialBackAnswer:
    """One peer's dial-back verdict on ``addrs``; errors become ``status="error"``."""
    try:
        reply = await node.call(
            peer, DIAL_BACK, {"addrs": [str(a) for a in addrs]}, timeout=config.request_timeout
        )
    except P2PError as e:
        return DialBackAnswer(peer, "error", reason=str(e) or type(e).__name__)
    if not isinstance(reply, dict) or reply.get("status") not in ("ok", "failed", "refused"):
        return DialBackAnswer(peer, "error", reason="malformed answer")
    status = reply["status"]
    reason = reply.get("reason") if isinstance(reply.get("reason"), str) else ""
    addr = None
    if status == "ok":
        try:
            addr = Multiaddr.parse(reply.get("addr", ""))
        except MultiaddrError:
            return DialBackAnswer(peer, "error", reason="bad address in answer")
        if addr.transport_part() not in [a.transport_part() for a in addrs]:
            return DialBackAnswer(peer, "error", reason="answer names an address we did not send")
    return DialBackAnswer(peer, status, addr, reason[:300])


async def probe(
    node: Node, peers: Sequence[PeerID], addrs: Sequence[Multiaddr], config: AutoNATConfig
) -> tuple[Reachability, list[DialBackAnswer]]:
    """Ask ``peers`` (in parallel) to dial back ``addrs``; the verdict and every answer."""
    answers: list[DialBackAnswer] = []
    if not addrs:
        return Reachability.UNKNOWN, answers

    async def one(peer: PeerID) -> None:
        answers.append(await ask_dial_back(node, peer, addrs, config))

    async with trio.open_nursery() as nursery:
        for peer in peers[: config.peers_per_probe]:
            nursery.start_soon(one, peer)
    answers.sort(key=lambda a: a.peer)
    verdict = conclude(answers, config.min_confirmations)
    logger.info(
        "reachability %s from %s",
        verdict.value,
        # a run's first peer has nobody to ask yet: say so rather than end on "from "
        ", ".join(f"{str(a.peer)[:8]}:{a.status}" for a in answers) or "no peer (none to ask yet)",
    )
    return verdict, answers
