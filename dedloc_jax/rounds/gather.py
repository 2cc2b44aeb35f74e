"""The all-gather of sparse DiLoCo payloads (:class:`dedloc_jax.TopK`) in one group.

Each sending member signs its packed payload (over the round's ID and the bytes) and every
member collects every other sender's: a reachable member's from that member itself (the
request carries the asker's own entry, so reachable members receive everyone's); a client's
(no inbound connections) from a reachable member it pushed to, the signature proving that
the relay did not change it. Every entry is untrusted: one from a non-member, with a bad
signature, the wrong size or a payload :func:`dedloc_jax.topk.unpack` rejects is logged and
dropped; a payload its sender signed that :func:`~dedloc_jax.topk.unpack` rejects excludes
that sender from the round (it signed junk: nobody waits for another payload of it). The mean
(:func:`dedloc_jax.topk.mean_of`, with its outlier rule in robust runs) sums the held payloads
in the spec's member order with the spec's weights, so members that hold the same senders hold
the same bits; a member missing some sender by the deadline steps with the others' mean and
reports the round incomplete (``keep_in_step`` then loads the run's state).
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import trio

from dedloc_jax.averaging import GroupSpec
from dedloc_jax.topk import Payload, PayloadError, TopK, mean_of, unpack
from p2p.errors import P2PError
from p2p.identity import PeerID, verify_signature
from p2p.node import Node
from p2p.rpc import CallContext

log = logging.getLogger(__name__)

GATHER = "collab.sparse/2"
"""The version names the payload format (/2: Elias-Fano offsets): a peer on another format is
an unknown protocol to us, not the signer of a malformed payload (excluded as hostile)."""
HOLD = 5.0
"""How long a request waits for the entries it asks for before answering with what is held."""
RETRY = 1.0


@dataclass
class _Gather:
    spec: GroupSpec
    cfg: TopK
    n: int
    senders: frozenset[str]
    held: dict[str, Payload] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    raw: dict[str, dict] = field(default_factory=dict)  # the signed entries, to relay
    # signed two payloads, or one that is junk: never counted, never waited for
    excluded: set[str] = field(default_factory=set)
    pushed: set[str] = field(default_factory=set)  # members known to hold our own entry
    changed: trio.Event = field(default_factory=trio.Event)

    def wake(self) -> None:
        """Wake the requests waiting for entries: what is held changed."""
        self.changed.set()
        self.changed = trio.Event()


@dataclass(frozen=True)
class Gathered:
    """The mean of the payloads held (dense float32) and who is in it."""

    mean: np.ndarray
    included: frozenset[str]
    complete: bool


class SparseGather:
    """One node's side of sparse all-gathers: its rounds in progress and the handler."""

    def __init__(
        self, node: Node, *, admit: Callable[[PeerID, str | None], Awaitable[None]] | None = None
    ) -> None:
        self.node = node
        self.admit = admit  # a private run's check of the caller
        self._rounds: dict[bytes, _Gather] = {}
        self._opened: dict[bytes, trio.Event] = {}
        # rounds that ended here, until HOLD after: late asks get what we held at once
        self._ended: dict[bytes, tuple[_Gather, float]] = {}

    def register(self) -> None:
        self.node.add_handler(GATHER, self._handle)

    def _opened_event(self, round_id: bytes) -> trio.Event:
        if len(self._opened) > 64:  # stale asks of rounds that never opened here
            for key in [k for k in self._opened if k not in self._rounds][:32]:
                del self._opened[key]
        return self._opened.setdefault(round_id, trio.Event())

    def _accept(self, g: _Gather, round_id: bytes, entry: Any) -> None:
        """Check one signed entry and hold it; a bad one is logged and dropped."""
        try:
            peer, weight, payload = _check(g, round_id, entry)
        except _Junk as e:
            log.warning(
                "sparse payload rejected in group %s: %s; signed by it: excluded from the round",
                g.spec.digest.hex()[:8],
                e,
            )
            if e.peer not in g.excluded:
                g.excluded.add(e.peer)
                for held in (g.held, g.weights, g.raw):
                    held.pop(e.peer, None)
                g.wake()
            return
        except (PayloadError, ValueError, TypeError, KeyError) as e:
            log.warning("sparse payload rejected in group %s: %s", g.spec.digest.hex()[:8], e)
            return
        if peer in g.excluded:
            return
        if peer in g.held:
            first = g.raw[peer]
            if (first["d"], first["w"]) != (entry["d"], entry["w"]):
                # Members holding different payloads of one sender would step apart: this
                # one drops the sender (an incomplete round) and logs both signed entries.
                log.warning(
                    "sparse gather: %s signed two different payloads for group %s; excluded "
                    "(signatures %s and %s)",
                    peer,
                    g.spec.digest.hex()[:8],
                    bytes(first["s"]).hex()[:16],
                    bytes(entry["s"]).hex()[:16],
                )
                g.excluded.add(peer)
                del g.held[peer], g.weights[peer], g.raw[peer]
                g.wake()
            return
        g.held[peer], g.weights[peer], g.raw[peer] = payload, weight, entry
        g.wake()

    async def _handle(self, ctx: CallContext, request: Any) -> Any:
        if not isinstance(request, dict) or not isinstance(request.get("r"), bytes):
            raise ValueError("a sparse gather request is a map with a round ID")
        want = request.get("w", [])
        if not isinstance(want, list) or len(want) > 1024:
            raise ValueError("a sparse gather request names at most 1024 peers")
        if not all(isinstance(p, str) for p in want):
            raise ValueError("a sparse gather request names peers by their IDs")
        want = list(dict.fromkeys(want))  # each payload at most once per answer
        round_id = request["r"]
        if self.admit is not None:
            await self.admit(ctx.remote_peer, None)
        ended = self._ended.get(round_id)
        if ended is not None and ended[1] > trio.current_time():
            # Over here: what we held, at once. A round that ended was never opened again,
            # so the wait below took HOLD (the asker's whole deadline) for nothing.
            return {"e": [ended[0].raw[p] for p in want if p in ended[0].raw], "h": True}
        with trio.move_on_after(HOLD):
            await self._opened_event(round_id).wait()
        g = self._rounds.get(round_id)
        if g is None:
            return {"e": []}
        if "e" in request:
            self._accept(g, round_id, request["e"])
        with trio.move_on_after(HOLD):
            while not all(p in g.held for p in want if p in g.senders - g.excluded):
                await g.changed.wait()
        me = str(self.node.peer_id)
        if me in want and me in g.raw:  # the asker gets ours in this answer: no push needed
            g.pushed.add(str(ctx.remote_peer))
        # "h": our round is open here, the asker's entry (if it carried one) held
        return {"e": [g.raw[p] for p in want if p in g.raw], "h": True}

    async def gather(
        self,
        spec: GroupSpec,
        cfg: TopK,
        data: bytes | None,
        n: int,
        weight: float,
        *,
        timeout: float,
        robust: bool = False,
    ) -> Gathered:
        """Swap ``data`` (this peer's packed payload of ``weight`` samples; None for a member
        that sends nothing) with the group until every sender's is held or ``timeout``
        passes. A sender's weight is the one it signed, at most its spec entry's.
        ``robust``: the mean drops outlying payloads (:func:`~dedloc_jax.topk.mean_of`)."""
        me = str(self.node.peer_id)
        round_id = spec.digest + b":sparse"
        senders = frozenset(m.peer_id for m in spec.members if m.sends)
        g = _Gather(spec, cfg, n, senders)
        own = None
        if data is not None:
            own = {
                "p": me,
                "k": self.node.identity.public_key,
                "w": float(weight),
                "s": self.node.identity.sign(_signed(round_id, float(weight), bytes(data))),
                "d": bytes(data),
            }
            self._accept(g, round_id, own)
        self._rounds[round_id] = g
        self._opened_event(round_id).set()
        # trainers that accept connections; aux members (no payload) do not gather
        nodes = [m.peer_id for m in spec.members if m.mode == "node"]
        reachable = [p for p in nodes if p != me]
        pushed_to_me = me in nodes
        try:
            with trio.move_on_after(timeout):
                await self._collect(g, round_id, own, reachable, pushed_to_me)
        finally:
            del self._rounds[round_id]
            self._opened.pop(round_id, None)
            now = trio.current_time()
            self._ended = {r: e for r, e in self._ended.items() if e[1] > now}
            self._ended[round_id] = (g, now + HOLD)
        order = [m for m in spec.members if m.peer_id in g.held]
        if not order:
            raise ValueError("no payload held, not even our own")
        weights = [g.weights[m.peer_id] for m in order]
        mean = mean_of(cfg, [g.held[m.peer_id] for m in order], weights, n, outliers=robust)
        included = frozenset(g.held)
        return Gathered(mean, included, included == senders)

    async def _collect(
        self,
        g: _Gather,
        round_id: bytes,
        own: dict | None,
        reachable: list[str],
        pushed_to_me: bool,
    ) -> None:
        """Ask until every sender's entry is held. Clients push their entries to reachable
        members, so a reachable member asks a relay for a client's only on a second try or
        ``RETRY`` into the round (the highest ID, with no one to ask, never tried).

        Of two reachable senders only the lower ID asks at first: its request carries its
        entry and the answer the other's, so one call moves both (when both asked, each
        payload crossed twice: at 40 members most of the round's bytes). The higher one asks
        the lower one only if its entry is still missing ``HOLD`` seconds into the round."""
        pushed = g.pushed
        me = str(self.node.peer_id)
        started = trio.current_time()
        attempt = 0
        ask_at = started
        while not g.senders - g.excluded <= set(g.held):
            if trio.current_time() < ask_at:
                # Between passes an entry brought to us only ends the round (it creates no
                # ask: missing shrinks, pushed grows); RETRY paces the asks, so relays are not
                # asked for clients whose pushes are on their way.
                with trio.move_on_at(ask_at):
                    await g.changed.wait()
                continue
            waited = trio.current_time() - started
            # a client or a member with nothing to send is asked by no one: it asks everyone
            first = {p for p in reachable if me < p or own is None or not pushed_to_me}
            if waited >= HOLD:
                first = set(reachable)
            asks: dict[str, list[str]] = {}
            for p in sorted(g.senders - g.excluded - set(g.held)):
                if p in reachable:  # a reachable sender is asked itself, a client via a relay
                    if p in first:  # else p asks us, and its request carries its entry
                        asks.setdefault(p, []).append(p)
                elif reachable and (attempt or not pushed_to_me or waited >= RETRY):
                    relay = reachable[(attempt + sorted(g.senders).index(p)) % len(reachable)]
                    asks.setdefault(relay, []).append(p)
            for p in reachable:  # everyone reachable gets our entry once
                if own is not None and p not in pushed and p in first:
                    asks.setdefault(p, [])
            if asks:
                async with trio.open_nursery() as nursery:
                    for p, want in asks.items():
                        nursery.start_soon(self._ask, g, round_id, p, want, own, pushed)
                attempt += 1
            ask_at = trio.current_time() + RETRY

    async def _ask(
        self,
        g: _Gather,
        round_id: bytes,
        peer: str,
        want: list[str],
        own: dict | None,
        pushed: set[str],
    ) -> None:
        request: dict = {"r": round_id, "w": want}
        if own is not None and peer not in pushed:
            request["e"] = own
        try:
            answer = await self.node.call(
                PeerID.from_base58(peer), GATHER, request, timeout=2 * HOLD + 5.0
            )
        except P2PError as e:
            log.info("sparse gather: %s did not answer: %s", peer, e)
            return
        entries = answer.get("e") if isinstance(answer, dict) else None
        if isinstance(answer, dict) and answer.get("h") is True:
            # (not from a peer whose round had not opened: our entry was not taken there)
            pushed.add(peer)
        if not isinstance(entries, list) or len(entries) > len(g.senders):
            log.warning("sparse gather: malformed answer from %s", peer)
            return
        for entry in entries:
            self._accept(g, round_id, entry)


def _signed(round_id: bytes, weight: float, data: bytes) -> bytes:
    return round_id + struct.pack("<d", weight) + data


class _Junk(PayloadError):
    """A payload whose sender's signature holds, which TopK with the run's settings never
    produces: proof that the sender sent junk."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"entry of {peer}: {reason}")
        self.peer = peer


def _check(g: _Gather, round_id: bytes, entry: Any) -> tuple[str, float, Payload]:
    if not isinstance(entry, dict):
        raise TypeError("an entry is a map")
    peer, key, sig, data, weight = entry["p"], entry["k"], entry["s"], entry["d"], entry["w"]
    if not isinstance(peer, str) or peer not in g.senders:
        raise ValueError(f"entry of {peer!r}, not a sending member")
    if not isinstance(weight, float) or not math.isfinite(weight) or weight < 0:
        raise ValueError(f"entry of {peer}: weight {weight!r} is not a finite number >= 0")
    if not isinstance(key, bytes) or not PeerID.from_base58(peer).matches(key):
        raise ValueError(f"entry of {peer}: key does not match the peer ID")
    if not isinstance(sig, bytes) or not isinstance(data, bytes):
        raise TypeError(f"entry of {peer}: signature and payload must be bytes")
    if len(data) > g.cfg.payload_bytes(g.n):  # (before hashing it for the signature)
        raise PayloadError(f"entry of {peer}: {len(data)} bytes, expected "
                           f"{g.cfg.payload_bytes(g.n)}")  # fmt: skip
    if not verify_signature(key, sig, _signed(round_id, weight, data)):
        raise ValueError(f"entry of {peer}: bad signature")
    try:  # signed by the sender: its own junk
        payload = unpack(g.cfg, data, g.n)
    except PayloadError as e:
        raise _Junk(peer, str(e)) from None
    bound = next(m.weight for m in g.spec.members if m.peer_id == peer)
    return peer, min(weight, bound), payload
