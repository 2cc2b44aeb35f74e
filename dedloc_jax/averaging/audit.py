"""Verified averaging, the protocol half: gather statements, check every share, reveal, judge.

After a round's exchange, each member holding the result (every sender) derives the check seed
from the result (:func:`.verify.seed_of`), signs its :class:`~.verify.Statement` and swaps it
with every dialable sender (``STATEMENT_PROTOCOL``, one unary call each: a member answers at
once with its own; to a member asking for the statements it could not get directly (one it
could not reach; a client, which nobody can dial, asks :data:`RELAYS` members first, then the
others), with those the caller lacks as soon as it holds one (the caller asks again for the
rest) or its wait ends; a relayed statement is checked by its own signature). Then every member
checks every share it can (the figures of each chunk's contributors are in; a repaired share is
not checked). For a share that fails, the member asks each of its contributors to reveal its
chunk hashes and its encoded parts of the whole share: hashes that do not hash to its signed
root (:func:`.verify.parts_root`), a part that does not match its hash or (in the first failing
chunk) its stated projection or norm convict the sender; if all match, the reducer lied. An
:class:`Accusation` carries the signed statements, the revealed chunk hashes and bytes and the
share's result digests (the contributors signed their root), so a third party can redo the
check from the record alone (:func:`check_evidence`). Every member then **recomputes the
share** from the revealed parts, leaving out the convicted peer's (:func:`.verify.recompute`:
the parts are the committed bytes, so every member holds the same bits and no reducer is
trusted). A client, whom nobody can dial, pushes its parts of a failed share to the dialable
members, who relay them to other clients. If nobody is convicted (a contributor revealed
nothing: it left, or its push was lost) or a part is missing, the share is **dropped** (set to
zero on every member whose reveals came to the same). A share that cannot be checked because
its reducer stated nothing about the results we hold (no statement, or one of another seed: it
withheld it to hide a lie in its own share, or it left), or because another contributor stated
about other results (a reducer can make a member repair its share), is recomputed from the
revealed parts in the same way, those with no statement or no reveal left out, when at most
half its contributors lack one (more is our own exchange failing) and another member revealed
a part (else they all checked it and our view is the odd one): otherwise it is taken
unchecked, as is a share that a contributor with no statement at all keeps from being checked
(a member that left). At its check a member asks each member whose statement it lacks for it
once more; one still waiting for a reducer's results (which a liar can hold back until the
others' check is over) answers with the shares it waits for and its own, fixed on its first
such answer and listed in its statement (:func:`_declare`): every member, the namer too,
recomputes those from the revealed parts without the namer's (the namer still checks them
when it can, and convicts). A share we repaired while another member states figures for it
(its reducer committed it to them and failed our exchange) is recomputed the same way without
the reducer's part: the copy we repaired from is unchecked here. A contributor revealing to
some members and not to others can still make their shares differ; the fork choice then
mends it.

A reducer signs each result chunk (:func:`.verify.result_claim`: the round, the share, the
chunk and its digest in the clear) and sends every member the same one. A member whose
statement (of another seed) has another results root of a share than ours is asked for its
digests of it and the reducer's signatures it holds, and shown ours (a client, whom nobody
dials, shows the nodes its own when it asks for theirs): a chunk of which the reducer signed
two digests convicts it of equivocation (the evidence is the two signatures, 200 bytes;
:func:`_equivocations`), and the share is recomputed without its part as above; so are the
shares a member it sent other bits could not check, as the others recompute them. Only the
reducer's own signatures count: a member reporting other digests (a lie, a repair: repaired
chunks carry no signature) proves nothing.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from p2p.errors import IdentityError
from p2p.identity import PeerID, verify_signature
from p2p.rpc import MessageStream

from . import wire
from .chunk_codecs import get_codec, is_finite, rounding_bound
from .errors import FAILURES, BadContributionError, GroupError
from .group import GroupSpec
from .verify import (
    NO_HASH,
    ShareFigures,
    Statement,
    chunk_terms,
    clips,
    counted_weight,
    derived_tau,
    direction,
    hello_of,
    make_statement,
    parse_signed_hello,
    parse_statement,
    part_norm,
    parts_root,
    projection,
    recompute,
    residual,
    result_claim,
    result_digest,
    results_root,
    robust_weights,
    seed_of,
    statement_holds,
    tolerance,
)

if TYPE_CHECKING:
    from .butterfly import AllReduceState

logger = logging.getLogger(__name__)

VERIFY_PROTOCOL = "dedloc/allreduce-verify/6"  # 6: a member is asked its result digests
STATEMENT_PROTOCOL = "dedloc/allreduce-statement/3"  # 3: a root per share, compact hellos
"""A unary call: a member's statement in; the callee's own out (or, asked to wait, those the
caller lacks)."""


@dataclass(frozen=True)
class Accusation:
    """A peer caught lying in a round, with what proves it."""

    peer: str
    role: str
    """"reducer": its result is not the aggregate of the parts, or (reason "equivocation") it
    signed two results of one chunk; "sender": its revealed part contradicts its own signed
    statement."""
    reason: str
    round_id: bytes
    share: int
    chunk: int
    evidence: dict = field(repr=False)
    """msgpack-able: codec, seed, chunk range, radius, the contributors' signed statements,
    their revealed encoded parts, and the reducer's signed encoded result chunk."""


@dataclass(frozen=True)
class Verdict:
    """What a round's check found on this member."""

    dropped: frozenset[int]
    """Shares (reducer indices) whose check failed and that could not be recomputed: every
    member zeroed them."""
    recomputed: frozenset[int]
    """Shares whose check failed and that every member recomputed from the revealed parts,
    without the convicted peer's."""
    unverified: frozenset[int]
    """Shares not checked: repaired, or kept from being checked by missing statements that the
    module docstring's rule takes for our own exchange failing."""
    accusations: tuple[Accusation, ...]


@dataclass(frozen=True)
class Reveal:
    """A contributor's parts of one share as it revealed them: its chunk hashes (which must
    hash to the root it signed, :func:`.verify.parts_root`) and its encoded parts."""

    hashes: tuple[bytes, ...]
    parts: tuple[bytes, ...]

    def lie(self, fig: ShareFigures, k: int) -> str:
        """Why part ``k`` is not the one its sender committed to ("" when it is)."""
        return _commit_lie(fig, self.hashes, k, self.parts[k])


def _commit_lie(fig: ShareFigures, hashes: Sequence[bytes], k: int, data: bytes) -> str:
    """Why ``data``, revealed as part ``k`` with the chunk hashes ``hashes``, is not what the
    sender committed to in ``fig`` ("" when it is)."""
    if parts_root(hashes) != fig.parts:
        return "revealed chunk hashes do not match its committed root"
    if hashes[k] == NO_HASH or hashlib.sha256(data).digest() != hashes[k]:
        return "revealed part does not match its committed hash"
    return ""


def _own(rnd: AllReduceState, j: int) -> Reveal:
    """Our parts of share ``j``, as we committed to them."""
    n = len(rnd.chunks[j])
    return Reveal(tuple(rnd.part_hashes[j]), tuple(bytes(rnd.sent_part(j, k)) for k in range(n)))


async def _send_reveal(ms: MessageStream, got: Reveal) -> None:
    await ms.send({"t": "hashes", "d": b"".join(got.hashes)})
    for k, data in enumerate(got.parts):
        await ms.send(wire.part(k, data))


async def _figures(rnd: AllReduceState, seed: bytes) -> dict[int, ShareFigures]:
    """This sender's figures for every share: per chunk, its committed hash, ``q`` and norm
    (a checkpoint after each chunk: the node keeps serving while it computes)."""
    out: dict[int, ShareFigures] = {}
    if rnd.abstain or rnd.vec is None or rnd.out is None:
        return out
    for j in rnd.reducers:
        n = len(rnd.chunks[j])
        if j in rnd.repaired or len(rnd.taus[j]) < n:
            continue  # a repaired share is not checked (its reducer's results never all came)
        q = np.full(n, np.nan)
        norms = np.full(n, np.nan)
        results = []
        for k in range(n):
            a, b = rnd.share_slice(j, k)
            part = rnd.sent_values(j, k)
            z = direction(seed, a, b - a)
            q[k] = projection(z, part, rnd.out[a:b], rnd.taus[j][k])
            norms[k] = part_norm(part)
            results.append(_received(rnd, j, k))
            await trio.lowlevel.checkpoint()
        out[j] = ShareFigures(parts_root(rnd.part_hashes[j]), q, norms, results_root(results))
        rnd.received[j] = results
    return out


def _terms(rnd: AllReduceState, j: int, k: int) -> bytes:
    a, b = rnd.share_slice(j, k)
    cfg = rnd.config
    return chunk_terms(a, b, rnd.codec.at(a, b).name, cfg.robust_mode, cfg.robust_tau)


def _received(rnd: AllReduceState, j: int, k: int) -> bytes:
    """The :func:`.verify.result_digest` of result chunk ``k`` of share ``j`` as we received it
    (what its reducer signed, under the terms we hold): the one checked on receipt while we
    hold its bytes, mask and radius, else hashed here."""
    held = rnd.result_bytes.get(j, ())
    data = held[k] if k < len(held) else b""
    mask, tau = rnd.masks[j][k], rnd.taus[j][k]
    cached = rnd.result_digests.get(j, ())
    if k < len(held) and k < len(cached) and cached[k][:2] == (mask, tau):
        return cached[k][2]
    return result_digest(rnd.round_id, rnd.spec.digest, j, k, data, mask, tau, _terms(rnd, j, k))


def check_signed(
    rnd: AllReduceState,
    j: int,
    k: int,
    data: bytes,
    mask: frozenset[int],
    tau: float | None,
    sig: bytes | None,
    msg: dict,
) -> bytes:
    """Refuse (BadContributionError) result chunk ``k`` of share ``j`` (its message ``msg``)
    unless reducer ``j`` signed it: a chunk taken unsigned could never convict its reducer
    before a third party (:func:`check_evidence` redoes this very check). Its key comes with
    the first chunk and must be the one its peer ID names, and an aux reducer's statement too
    (the hellos it counted on: :func:`_judge_blank`). The refused exchange fails and the share
    is repaired without this reducer's result: a bad signature on our own stream proves
    nothing to others, so nobody is convicted for it. Returns the signed
    :func:`.verify.result_digest` (our statement's, not hashed again)."""
    who = rnd.name(j)
    if k == 0:
        key = wire.parse_key(msg)
        if key is None or not PeerID.from_base58(who).matches(key):
            raise BadContributionError(f"reducer {who} sent no key of its own with its result")
        rnd.reducer_keys[j] = key
        if not rnd.members[j].sends:
            raw = wire.statement_of(msg)
            st = _parse(rnd, raw) if raw is not None else None
            if st is None or st.sender != j or st.weight != 0.0 or st.shares:
                raise BadContributionError(f"aux reducer {who} sent no statement of its own")
            rnd.aux_statements[j] = st
    held = rnd.reducer_keys.get(j)
    if sig is None or held is None:
        raise BadContributionError(f"reducer {who} sent result chunk {k} unsigned")
    signed = result_digest(rnd.round_id, rnd.spec.digest, j, k, data, mask, tau, _terms(rnd, j, k))
    if not verify_signature(held, sig, result_claim(rnd.round_id, rnd.spec.digest, j, k, signed)):
        raise BadContributionError(f"reducer {who}'s signature of result chunk {k} does not verify")
    return signed


def _parse(
    rnd: AllReduceState, msg: Any, ours: bool = False, direct: int | None = None
) -> Statement:
    return parse_statement(
        msg,
        round_id=rnd.round_id,
        digest=rnd.spec.digest,
        members=[m.peer_id for m in rnd.members],
        chunks={j: len(c) for j, c in rnd.chunks.items()},
        ours=ours,
        direct=direct,
    )


def _verify_held(rnd: AllReduceState) -> bool:
    """Verify the signatures of the statements taken on their member's channel's word, before
    any is used as evidence; drop those that fail (their member sent us junk: it counts as
    having stated nothing, as when its statement was refused on receipt). Whether any was
    dropped."""
    dropped = False
    for i, st in list(rnd.statements.items()):
        if st.checked:
            continue
        if statement_holds(st):
            rnd.statements[i] = replace(st, checked=True)
        else:
            logger.warning("statement of %s refused: its signature does not verify", rnd.name(i))
            del rnd.statements[i]
            dropped = True
    return dropped


def _expected(rnd: AllReduceState) -> set[int]:
    return {i for i, m in enumerate(rnd.members) if m.sends}


def _add(rnd: AllReduceState, st: Statement) -> None:
    if st.sender not in rnd.statements:
        rnd.statements[st.sender] = st
        rnd.statement_changes.notify()


async def _wait_for_all(rnd: AllReduceState, until: float) -> None:
    while not _expected(rnd) <= set(rnd.statements) and trio.current_time() < until:
        await rnd.statement_changes.wait(until)


async def _wait_for_any(rnd: AllReduceState, wanted: set[int], until: float) -> None:
    """Until we hold one of ``wanted``'s statements (or none is wanted)."""
    while wanted and not wanted & set(rnd.statements) and trio.current_time() < until:
        await rnd.statement_changes.wait(until)


async def answer(rnd: AllReduceState, request: Any, remote: PeerID) -> dict:
    """A member's statement (``STATEMENT_PROTOCOL``): our own, at once; or, when it asks to
    wait (a member we could not reach, or a client: nobody dials a client, so it learns the
    others' statements only from answers), as soon as we hold one it does not list as held
    (bounded), every such one; it asks again for the rest (a member that left never sends
    its own, so waiting for them all would answer after the caller's check ended)."""
    names = [m.peer_id for m in rnd.members]
    if str(remote) not in names or not isinstance(request, dict):
        raise BadContributionError(f"{remote} is no member of this round, or no statement")
    who = names.index(str(remote))
    st = _parse(rnd, request.get("s"), direct=who)
    if st.sender != who:
        raise BadContributionError("a member may only push its own statement")
    _add(rnd, st)
    if request.get("p") is True:  # asked at the caller's check (:func:`_ask_at_check`)
        return await _own_or_pending(rnd)
    held = request.get("h")
    held = set(held) if isinstance(held, list) and len(held) <= len(names) else set()
    if request.get("w") is True:
        lacks = _expected(rnd) - held - {who}
        await _wait_for_any(rnd, lacks, trio.current_time() + rnd.verify_timeout)
        return {"l": [s.wire for i, s in rnd.statements.items() if i not in held | {who}]}
    # One call per pair of nodes (the lower calls the higher: :func:`_callees`), so the answer
    # waits for our own statement. A node that calls us gets every other node's statement
    # from that node's call, a client from its own call to that node: ours only, so each
    # statement crosses each link once (O(n) bytes per member); not even ours when it holds it.
    if rnd.me not in held:
        await _wait_for_any(rnd, {rnd.me}, trio.current_time() + rnd.verify_timeout)
    own = rnd.statements.get(rnd.me)
    return {"l": [] if own is None or rnd.me in held else [own.wire]}


async def _own_or_pending(rnd: AllReduceState) -> dict:
    """Our statement, or the shares whose results we still wait for (:func:`_declare`). Once
    every result is in, our statement is being made: it is waited for (bounded)."""
    if rnd.me not in rnd.statements and rnd.declared is None and all(rnd.ok.values()):
        await _wait_for_any(rnd, {rnd.me}, trio.current_time() + rnd.verify_timeout / 2)
    own = rnd.statements.get(rnd.me)
    if own is not None:
        return {"l": [own.wire]}
    return {"l": [], "p": sorted(_declare(rnd))}


def _declare(rnd: AllReduceState) -> frozenset[int]:
    """The shares we name, asked at a member's check before we could state: those whose
    exchange is still open (a reducer holding our results past the others' check), and our
    own (the others lack our figures of it, and recompute it as a withheld statement's).
    Fixed on the first answer (it only shrinks with time, and every member must hear the
    same); our statement lists them. Every member, us included, recomputes those shares from
    the revealed parts without ours, so none applies a share one of its members could not
    check."""
    if rnd.declared is None:
        waiting = {j for j in rnd.reducers if not rnd.settled[j].is_set()}
        rnd.declared = frozenset(waiting | ({rnd.me} & set(rnd.chunks)))
    return rnd.declared


def _named(rnd: AllReduceState, reply: Any) -> frozenset[int] | None:
    """The shares a member named in its answer (:func:`_own_or_pending`), if well formed."""
    named = reply.get("p") if isinstance(reply, dict) else None
    if not isinstance(named, list) or len(named) > len(rnd.members):
        return None
    if not all(isinstance(j, int) and not isinstance(j, bool) for j in named):
        return None
    return frozenset(j for j in named if j in rnd.chunks)


def _declarations(rnd: AllReduceState) -> dict[int, set[int]]:
    """Per share, the members that named it as one whose results they still waited for at a
    check: in their answer to us, in their statement, or us."""
    named: dict[int, frozenset[int]] = dict(rnd.notices)
    for i, st in rnd.statements.items():
        named[i] = named.get(i, frozenset()) | st.pending
    if rnd.declared:
        named[rnd.me] = rnd.declared
    out: dict[int, set[int]] = {}
    for i, shares in named.items():
        for j in shares & set(rnd.chunks):
            out.setdefault(j, set()).add(i)
    return out


async def _ask_at_check(rnd: AllReduceState, mine: dict) -> None:
    """At our check, ask each member whose statement we still lack (and that we still reach,
    :func:`_reachable`) for it, or for the shares it still waits for (a reducer can hold one
    member's results until the others' check is over; taken as it came, as a leaver's would
    be, its share's lie went through). A member that does not answer left: its shares are
    taken as they came."""

    async def one(i: int) -> None:
        peer = PeerID.from_base58(rnd.name(i))
        request = {"r": rnd.round_id, "s": mine, "p": True, "h": sorted(rnd.statements)}
        try:
            reply = await rnd.node.call(
                peer, STATEMENT_PROTOCOL, request, timeout=rnd.verify_timeout
            )
            _take_listed(rnd, reply, i)
        except FAILURES as e:
            logger.info("%s answered nothing at our check: %s", rnd.name(i), e)
            return
        named = _named(rnd, reply)
        if named is not None and i not in rnd.statements:
            rnd.notices[i] = named

    lacking = [
        i
        for i, m in enumerate(rnd.members)
        if m.sends and i != rnd.me and i not in rnd.statements and _reachable(rnd, i)
    ]
    with trio.move_on_after(rnd.verify_timeout):
        async with trio.open_nursery() as nursery:
            for i in lacking:
                nursery.start_soon(one, i)


def _reachable(rnd: AllReduceState, i: int) -> bool:
    """Whether we can ask member ``i`` at our check: we hold a usable connection to it (a
    client opened one to each reducer; the statement swap dialed every node). A member whose
    connection is gone left, and is not dialed again: a crashed host's dial would hold the
    check up for its whole timeout."""
    return rnd.node.connection_to(PeerID.from_base58(rnd.name(i))) is not None


def _take_listed(rnd: AllReduceState, reply: Any, i: int) -> None:
    """The statements member ``i`` listed in its answer (each refused alone if malformed)."""
    listed = reply.get("l") if isinstance(reply, dict) else None
    if not isinstance(listed, list) or len(listed) > len(rnd.members):
        raise BadContributionError("malformed statement list")
    known = {st.wire["b"] for st in rnd.statements.values()}
    for raw in listed:
        if isinstance(raw, dict) and raw.get("b") in known:
            continue  # the same bytes as one we hold (each comes ~n times)
        try:
            _add(rnd, _parse(rnd, raw, direct=i))
        except BadContributionError as e:
            logger.warning("statement relayed by %s refused: %s", rnd.name(i), e)


async def serve(rnd: AllReduceState, ms: MessageStream, remote: PeerID) -> None:
    """Answer a reveal request, a client's push or a relay request."""
    names = [m.peer_id for m in rnd.members]
    if str(remote) not in names:
        raise BadContributionError(f"{remote} is no member of this round")
    who = names.index(str(remote))
    msg = await ms.receive()
    if not isinstance(msg, dict):
        raise BadContributionError("expected a map")
    if msg.get("t") == "reveal":  # our parts of one share, once per member and share
        j = msg.get("j")
        if j not in rnd.chunks or (who, j) in rnd.reveals:
            raise BadContributionError("reveal of a share that does not exist, or again")
        rnd.reveals.add((who, j))
        if rnd.vec is None or rnd.abstain:
            raise BadContributionError("nothing to reveal")
        await _send_reveal(ms, _own(rnd, j))
    elif msg.get("t") == "push":  # a client's parts of a failed share, once per share
        j = msg.get("j")
        if j not in rnd.chunks or (who, j) in rnd.pushed or rnd.members[who].mode != "client":
            raise BadContributionError("push of a share that does not exist, again or by a node")
        rnd.pushed[(who, j)] = await _receive_parts(rnd, ms, j)
        rnd.push_changes.notify()
    elif msg.get("t") == "relay":  # a client asks for another client's pushed parts
        i, j = msg.get("i"), msg.get("j")
        if not isinstance(i, int) or not 0 <= i < len(rnd.members) or j not in rnd.chunks:
            raise BadContributionError("relay of a share that does not exist")
        if (who, i, j) in rnd.reveals:
            raise BadContributionError("relay asked again")
        rnd.reveals.add((who, i, j))
        got = await _pushed(rnd, i, j)
        if got is None:
            raise BadContributionError("nothing pushed to relay")
        await _send_reveal(ms, got)
    elif msg.get("t") == "results":  # ours of one share for theirs, once per member and share
        j = msg.get("j")
        if j not in rnd.received or ("results", who, j) in rnd.reveals:
            raise BadContributionError("results of a share we stated nothing about, or again")
        rnd.reveals.add(("results", who, j))
        rnd.shown[(who, j)] = _parse_results(msg, len(rnd.chunks[j]))
        rnd.push_changes.notify()
        await ms.send(_results_msg(rnd, j))
    else:
        raise BadContributionError("unexpected verify message")


async def _swap(rnd: AllReduceState, i: int, mine: dict, wait: bool, unreached: set[int]) -> bool:
    """Push our statement to member ``i`` and take the ones it lists (``unreached`` gets ``i``
    when the call fails); whether it brought one we lacked (a relay listing only junk or
    repeats is not asked again)."""
    peer = PeerID.from_base58(rnd.name(i))
    request = {"r": rnd.round_id, "s": mine, "w": wait, "h": sorted(rnd.statements)}
    before = len(rnd.statements)
    try:
        timeout = rnd.config.stall_timeout + (rnd.verify_timeout if wait else 0.0)
        reply = await rnd.node.call(peer, STATEMENT_PROTOCOL, request, timeout=timeout)
        _take_listed(rnd, reply, i)
        return len(rnd.statements) > before
    except FAILURES as e:
        unreached.add(i)
        logger.info("statement swap with %s failed: %s", rnd.name(i), e)
    return False


async def _receive_parts(rnd: AllReduceState, ms: MessageStream, j: int) -> Reveal:
    """A member's chunk hashes of share ``j``, then its encoded parts of every chunk, in
    order, of the codec's sizes."""
    n = len(rnd.chunks[j])
    msg = await ms.receive()
    hashes = msg.get("d") if isinstance(msg, dict) and msg.get("t") == "hashes" else None
    if not isinstance(hashes, bytes) or len(hashes) != 32 * n:
        raise BadContributionError("malformed chunk hashes")
    parts = []
    for k in range(n):
        a, b = rnd.share_slice(j, k)
        parts.append(
            wire.parse_chunk(await ms.receive(), k, rnd.codec.at(a, b).encoded_size(b - a))
        )
    return Reveal(tuple(hashes[32 * k : 32 * k + 32] for k in range(n)), tuple(parts))


async def _pushed(rnd: AllReduceState, i: int, j: int) -> Reveal | None:
    """Client ``i``'s parts of share ``j`` as it pushed them to us (waiting a while)."""
    until = trio.current_time() + rnd.verify_timeout
    while (i, j) not in rnd.pushed and trio.current_time() < until:
        await rnd.push_changes.wait(until)
    return rnd.pushed.get((i, j))


@asynccontextmanager
async def _verify_call(rnd: AllReduceState, i: int) -> AsyncIterator[MessageStream]:
    """A ``VERIFY_PROTOCOL`` stream to member ``i``, opened with the round's hello (the
    caller bounds it in time)."""
    peer = PeerID.from_base58(rnd.name(i))
    async with rnd.node.open_stream(peer, VERIFY_PROTOCOL, timeout=rnd.config.stall_timeout) as ms:
        await ms.send({"t": "vhello", "r": rnd.round_id})
        yield ms


async def _ask(rnd: AllReduceState, peer_index: int, request: dict, j: int) -> Reveal | None:
    try:
        with trio.move_on_after(2 * rnd.verify_timeout):
            async with _verify_call(rnd, peer_index) as ms:
                await ms.send(request)
                return await _receive_parts(rnd, ms, j)
    except FAILURES as e:
        logger.info("%s revealed nothing: %s", rnd.name(peer_index), e)
    return None


def _callees(rnd: AllReduceState) -> list[int]:
    """Whom we call with our statement: of each pair of nodes the lower one calls (the answer
    brings the callee's: one call a pair, each end's CPU per call is that of a round's
    hashing of a chunk); a client, whom nobody dials, calls every node."""
    client = rnd.members[rnd.me].mode == "client"
    return [i for i in _dialable(rnd) if client or i > rnd.me]


def _dialable(rnd: AllReduceState) -> list[int]:
    """Members that verify and that anyone can dial."""
    return [i for i, m in enumerate(rnd.members) if m.sends and m.mode != "client"]


async def _reveal(rnd: AllReduceState, i: int, j: int) -> Reveal | None:
    """Member ``i``'s encoded parts of every chunk of share ``j`` (None if it revealed
    nothing in time or a malformed part). A client, whom nobody can dial, pushes them to the
    dialable members (:func:`_push`); a client asks one of those to relay another's."""
    if i == rnd.me:
        return _own(rnd, j)
    if rnd.members[i].mode != "client":
        return await _ask(rnd, i, {"t": "reveal", "j": j}, j)
    if rnd.members[rnd.me].mode != "client":
        return await _pushed(rnd, i, j)
    for relay in _dialable(rnd):  # each relayed part is checked against i's commitments
        got = await _ask(rnd, relay, {"t": "relay", "i": i, "j": j}, j)
        if got is not None:
            return got
    return None


async def _push(rnd: AllReduceState, j: int) -> None:
    """As a client, hand our parts of failed share ``j`` to every dialable member."""
    if rnd.vec is None or rnd.abstain:
        return
    own = _own(rnd, j)

    async def one(i: int) -> None:
        try:
            with trio.move_on_after(rnd.verify_timeout):
                async with _verify_call(rnd, i) as ms:
                    await ms.send({"t": "push", "j": j})
                    await _send_reveal(ms, own)
        except FAILURES as e:
            logger.info("could not push our parts to %s: %s", rnd.name(i), e)

    async with trio.open_nursery() as nursery:
        for i in _dialable(rnd):
            if i != rnd.me:
                nursery.start_soon(one, i)


@dataclass(frozen=True)
class ChunkCheck:
    """The figures of one chunk's check."""

    ok: bool
    why: str
    residual: float = 0.0
    tolerance: float = 0.0


def check_chunk(
    codec_name: str,
    result: np.ndarray,
    statements: dict[int, Statement],
    contributors: frozenset[int],
    j: int,
    k: int,
    tau: float | None,
    robust: bool,
    fixed_tau: float | None,
    member_weights: Sequence[float],
) -> ChunkCheck:
    """Whether chunk ``k`` of share ``j`` is the aggregate its contributors' figures imply.
    A sender counts for its weight in the group spec (``member_weights``) where that is
    finite, as reducers count it (:func:`.verify.counted_weight`)."""
    order = sorted(contributors)
    figs = []
    for i in order:
        f = statements[i].shares.get(j)
        if f is None or not math.isfinite(f.q[k]) or statements[i].weight <= 0:
            return ChunkCheck(False, f"member {i} is counted but stated no contribution")
        figs.append(f)
    raw = [counted_weight(statements[i].weight, float(member_weights[i])) for i in order]
    robust = clips(robust, fixed_tau, len(order))
    norms = [float(f.norms[k]) for f in figs]
    weights = list(robust_weights(raw, norms, fixed_tau)) if robust else raw
    if robust:
        want = fixed_tau or derived_tau(norms)
        if tau is None or abs(tau - want) > 1e-6 * want:
            return ChunkCheck(False, f"CenteredClip radius {tau} is not the rule's {want:.6g}")
    elif tau is not None:
        return ChunkCheck(False, "a CenteredClip radius on a plain mean")
    # Any weighted mean or CenteredClip point of the parts is no longer than the longest part
    # (the codec's rounding adds at most 7%: int8); a longer result also hides in its own
    # rounding bound, so it is refused first.
    longest = max(norms, default=0.0)
    length = part_norm(result)
    if length > 1.1 * longest + 1e-30:
        return ChunkCheck(False, f"result norm {length:.3g} > every part's")
    bound = rounding_bound(get_codec(codec_name), result, longest, length)
    tol = tolerance(bound, norms, weights, tau)
    res = residual([float(f.q[k]) for f in figs], weights)
    if abs(res) > tol:
        return ChunkCheck(False, f"off its aggregate: residual {res:.3g} > {tol:.3g}", res, tol)
    return ChunkCheck(True, "", res, tol)


async def _check_shares(
    rnd: AllReduceState, stated: dict[int, Statement], declared: dict[int, set[int]]
) -> tuple[set[int], dict[int, tuple[int, ChunkCheck]], dict[int, set[int]]]:
    """Every share's chunks checked against the statements: the shares that could not be
    (repaired), per failed share its first failed chunk and why, and per share that a
    contributor's missing statement (or one about other results: another seed) keeps from
    being checked, those contributors. A share a member named as still awaited
    (``declared``, :func:`_declare`) is recomputed without the namers on every member,
    repaired or not (the namer checks it too when it can: a failure convicts)."""
    assert rnd.out is not None
    unverified: set[int] = set()
    failures: dict[int, tuple[int, ChunkCheck]] = {}
    silent: dict[int, set[int]] = {}
    for j in rnd.reducers:
        if j in declared:
            silent[j] = (set().union(*rnd.masks[j]) - set(stated)) | declared[j]
            if j not in rnd.repaired and all(mask <= set(stated) for mask in rnd.masks[j]):
                failed = await _first_failure(rnd, stated, j)
                if failed is not None:
                    failures[j] = failed
            continue
        if j in rnd.repaired:
            # Another member states figures for it: its reducer committed it to them and
            # failed our exchange, and the copy we repaired from is theirs, which nothing
            # checked here (a liar that reset our stream had its lie relayed to us as is).
            others = [st for i, st in rnd.statements.items() if i != rnd.me]
            if any(j in st.shares for st in others):
                silent[j] = {rnd.me}
            else:
                unverified.add(j)
            continue
        for mask in rnd.masks[j]:
            if not mask <= set(stated):
                # Recomputed, unless most contributors lack a statement of our seed (our own
                # exchange failed: late, cut off, other results), when the missing one hides
                # a lie: the reducer's own (withheld to hide one in its share), or one of
                # other results (a reducer can make a member repair its share). A member with
                # no statement at all in another reducer's share left (churn): taken as it
                # came on every member, so one leaver costs no reveals (a member still waiting
                # for a reducer names it when asked at our check: ``declared``).
                contributors = set().union(*rnd.masks[j])
                missing = contributors - set(stated)
                hiding = {j} | set(rnd.statements)
                if missing & hiding and 2 * len(missing) <= len(contributors):
                    silent[j] = missing
                else:
                    unverified.add(j)
                break
        else:
            failed = await _first_failure(rnd, stated, j)
            if failed is not None:
                failures[j] = failed
    return unverified, failures, silent


async def _first_failure(
    rnd: AllReduceState, stated: dict[int, Statement], j: int
) -> tuple[int, ChunkCheck] | None:
    """Share ``j``'s first chunk that fails its check, and why (None: every chunk passes)."""
    assert rnd.out is not None
    cfg = rnd.config
    for k, mask in enumerate(rnd.masks[j]):
        a, b = rnd.share_slice(j, k)
        chk = check_chunk(
            rnd.codec.at(a, b).name,
            rnd.out[a:b],
            stated,
            mask,
            j,
            k,
            rnd.taus[j][k],
            cfg.robust_mode,
            cfg.robust_tau,
            [m.weight for m in rnd.members],
        )
        await trio.lowlevel.checkpoint()
        if not chk.ok:
            return k, chk
    return None


async def _unchecked(
    rnd: AllReduceState,
    j: int,
    silent: set[int],
    liar: int | None = None,
    namers: set[int] = frozenset(),  # type: ignore[assignment]
) -> str | None:
    """Share ``j``, which ``silent`` contributors' statements (none, or about other results)
    keep from being checked, recomputed from the revealed parts of those that stated
    anything, whichever results it was about (its commitments are seed-free). Unchecked, a
    reducer that withheld its own statement, or sent other bits to some members, had its
    result taken as it came: -1000 x the mean went through (the test pins it). Nobody is
    convicted (nothing signed tells who lies); a contributor with no statement or that
    reveals nothing is left out. Returns why not ("" when done), or None when no other
    member revealed a part: they all checked their results and kept no parts, so ours are
    the odd ones (our view of the round differs), and the share is taken unchecked as they
    took it; dropping it on this member alone set it apart from the whole group. ``liar``: a
    reducer convicted of equivocating about this share, whose part is left out too;
    ``namers``: members that named it as still awaited (:func:`_declare`), left out too (a
    share one of them could not check is never taken as it came: dropped if nobody
    reveals)."""
    shares: dict[int, Reveal] = {}
    contributors = set().union(*rnd.masks[j])

    async def one(i: int) -> None:
        got = await _reveal(rnd, i, j)
        if got is not None:
            shares[i] = got

    # Only those that stated figures for it: another's part matches no commitment (it
    # repaired the share, or states none), and is left out.
    figured = {i for i, st in rnd.statements.items() if j in st.shares}
    async with trio.open_nursery() as nursery:
        for i in sorted(contributors & figured):  # the others: nothing to ask
            nursery.start_soon(one, i)
    if not set(shares) - {rnd.me} and namers:
        return "no other member revealed its parts"
    if not set(shares) - {rnd.me}:
        logger.warning(
            "round %s: share of reducer %s unchecked (%s stated nothing about our results) and "
            "no other member revealed its parts: taken as it came",
            rnd.round_id.hex()[:8],
            rnd.name(j),
            [rnd.name(i) for i in sorted(silent)],
        )
        return None
    left_out = (contributors - set(shares)) | ({liar} & contributors) | set(namers)
    logger.warning(
        "round %s: share of reducer %s unchecked (%s stated nothing about our results); "
        "every member recomputes it from the revealed parts%s",
        rnd.round_id.hex()[:8],
        rnd.name(j),
        [rnd.name(i) for i in sorted(silent)],
        f" without {[rnd.name(i) for i in sorted(left_out)]}" if left_out else "",
    )
    return _recompute(rnd, dict(rnd.statements), j, shares, left_out)


def _results_msg(rnd: AllReduceState, j: int) -> dict:
    """Our result digests of share ``j`` (our statement's root's) and the reducer's
    signatures we hold of them (b"" where none)."""
    sigs = rnd.result_sigs.get(j, [])
    n = len(rnd.received[j])
    return {
        "t": "results",
        "j": j,
        "d": b"".join(rnd.received[j]),
        "s": [(sigs[k] if k < len(sigs) else None) or b"" for k in range(n)],
    }


def _parse_results(msg: Any, n: int) -> tuple[list[bytes], list[bytes]]:
    """A member's ``n`` result digests and signatures (BadContributionError if malformed)."""
    d = msg.get("d") if isinstance(msg, dict) else None
    sigs = msg.get("s") if isinstance(msg, dict) else None
    if not isinstance(d, bytes) or len(d) != 32 * n or not isinstance(sigs, list):
        raise BadContributionError("malformed result digests")
    if len(sigs) != n or not all(isinstance(x, bytes) and len(x) <= 64 for x in sigs):
        raise BadContributionError("malformed result signatures")
    return [d[32 * k : 32 * k + 32] for k in range(n)], sigs


async def _shown(rnd: AllReduceState, i: int, j: int) -> tuple[list[bytes], list[bytes]] | None:
    """Client ``i``'s result digests of share ``j`` as it sent them asking for ours (waiting
    a while: it asks us when its root differs from ours, as ours does from its)."""
    until = trio.current_time() + rnd.verify_timeout
    while (i, j) not in rnd.shown and trio.current_time() < until:
        await rnd.push_changes.wait(until)
    return rnd.shown.get((i, j))


async def _results_of(
    rnd: AllReduceState, i: int, j: int
) -> tuple[list[bytes], list[bytes]] | None:
    """Member ``i``'s result digests of share ``j`` (those its statement's root is over) and
    the reducer's signatures it holds of them (b"" where none), or None. We send ours with
    the request (a client shows us its own so)."""
    n = len(rnd.chunks[j])
    if rnd.members[i].mode == "client":
        return await _shown(rnd, i, j)
    try:
        with trio.move_on_after(2 * rnd.verify_timeout):
            async with _verify_call(rnd, i) as ms:
                await ms.send(_results_msg(rnd, j))
                return _parse_results(await ms.receive(), n)
    except FAILURES as e:
        logger.info("%s sent no result digests: %s", rnd.name(i), e)
    return None


def _claimed(rnd: AllReduceState, j: int, k: int, rdigest: bytes, sig: bytes) -> bool:
    """Whether reducer ``j`` signed ``rdigest`` as result chunk ``k`` of its share (its key
    as proven on receipt; a repaired chunk or an aux path's relay carries no such signature)."""
    key = rnd.reducer_keys.get(j)
    if key is None or not sig:
        return False
    return verify_signature(key, sig, result_claim(rnd.round_id, rnd.spec.digest, j, k, rdigest))


async def _equivocations(rnd: AllReduceState) -> list[Accusation]:
    """Reducers that signed two results of one chunk: a member whose statement's results root
    of a share is not ours is asked for its digests of it, and a chunk whose digest differs
    from ours, both signed by the share's reducer, convicts it (:func:`_results_evidence`).
    Only the reducer's own signatures count, so a member reporting other digests (a lie, a
    repair) convicts nobody."""
    own = rnd.statements.get(rnd.me)
    if own is None:
        return []
    disputes: dict[int, list[int]] = {}  # share -> members whose root differs from ours
    client = rnd.members[rnd.me].mode == "client"
    for i, st in sorted(rnd.statements.items()):
        # Two results of a chunk make the seeds differ (it hashes every result): a member of
        # our seed that states another root lies about its own, and waiting on it would only
        # let it stall the round. Two clients cannot reach each other.
        if i == rnd.me or st.seed == own.seed or (client and rnd.members[i].mode == "client"):
            continue
        for j, fig in st.shares.items():
            mine = own.shares.get(j)
            if mine is not None and fig.results != mine.results:
                disputes.setdefault(j, []).append(i)
    found: dict[int, Accusation] = {}

    async def one(j: int, i: int) -> None:
        got = await _results_of(rnd, i, j)
        if got is None or j in found:
            return
        digests, sigs = got
        if results_root(digests) != rnd.statements[i].shares[j].results:
            return  # not what it signed: its word against ours, proof of nothing
        for k, (theirs, sig) in enumerate(zip(digests, sigs, strict=True)):
            held = rnd.result_sigs.get(j, [])
            ours, our_sig = rnd.received[j][k], (held[k] if k < len(held) else None) or b""
            if theirs == ours or not _claimed(rnd, j, k, ours, our_sig):
                continue
            if not _claimed(rnd, j, k, theirs, sig):
                continue
            evidence = {
                "kind": "results",
                "round": rnd.round_id,
                "group": rnd.spec.digest,
                "share": j,
                "chunk": k,
                "reducer_key": rnd.reducer_keys[j],
                "digests": [ours, theirs],
                "sigs": [our_sig, sig],
            }
            logger.warning(
                "round %s: reducer %s lied: signed two results of chunk %d (ours and %s's)",
                rnd.round_id.hex()[:8],
                rnd.name(j),
                k,
                rnd.name(i),
            )
            found[j] = Accusation(
                rnd.name(j), "reducer", "equivocation", rnd.round_id, j, k, evidence
            )
            return

    async with trio.open_nursery() as nursery:
        for j, others in disputes.items():
            for i in others:
                nursery.start_soon(one, j, i)
    return [found[j] for j in sorted(found)]


async def _convict_equivocators(
    rnd: AllReduceState,
    stated: dict[int, Statement],
    failures: dict[int, tuple[int, ChunkCheck]],
    unverified: set[int],
    silent: dict[int, set[int]],
) -> list[Accusation]:
    """A reducer that signed two results of one chunk (members' roots differ) is convicted on
    its signatures; its share is recomputed without its part, like a failed one (``failures``,
    ``unverified`` and ``silent`` are updated in place)."""
    accusations: list[Accusation] = await _equivocations(rnd)
    for a in accusations:
        failures.pop(a.share, None)
        unverified.discard(a.share)
        silent.setdefault(a.share, set())
    if accusations:
        # The statements of other seeds are the equivocator's doing, not our exchange failing:
        # the members it sent other bits recompute the shares they could not check, as the
        # others do for want of their statements, so every member ends with the same bits.
        for j in sorted(unverified - rnd.repaired):
            contributors = set().union(*rnd.masks[j])
            if rnd.me in contributors:
                unverified.discard(j)
                silent[j] = contributors - set(stated)
    return accusations


async def audit(rnd: AllReduceState) -> Verdict:
    """Check every share of ``rnd`` with the group (see the module docstring)."""
    assert rnd.out is not None
    until = trio.current_time() + rnd.verify_timeout
    seed = seed_of(
        rnd.round_id,
        rnd.spec.digest,
        [
            (rnd.out[rnd.bounds[j] : rnd.bounds[j + 1]], rnd.masks[j], rnd.taus[j])
            for j in rnd.reducers
        ],
    )
    weight = 0.0 if rnd.abstain else rnd.weight
    mine = make_statement(
        rnd.node.identity,
        rnd.round_id,
        rnd.spec.digest,
        rnd.me,
        weight,
        seed,
        await _figures(rnd, seed),
        # as a reducer, the signed hellos we counted on (checked when a share is disputed)
        list(rnd.holdings.hellos.values()) if rnd.me in rnd.chunks else [],
        sorted(rnd.declared or ()),  # read once the figures are done: a later ask sees ours
    )
    _add(rnd, _parse(rnd, mine, ours=True))
    await _exchange(rnd, mine, until)
    await _ask_at_check(rnd, mine)
    dropped: set[int] = set()
    declared = _declarations(rnd)
    stated = {i: st for i, st in rnd.statements.items() if st.seed == seed}
    unverified, failures, silent = await _check_shares(rnd, stated, declared)
    other_seed = any(st.seed != seed for st in rnd.statements.values())
    if (failures or silent or other_seed) and _verify_held(rnd):
        # a statement that would be evidence was junk: judge as if it never came
        stated = {i: st for i, st in rnd.statements.items() if st.seed == seed}
        unverified, failures, silent = await _check_shares(rnd, stated, declared)
    if unverified:
        logger.warning(
            "round %s: shares of %s not verified (repaired, or a contributor's statement of our "
            "results missing)",
            rnd.round_id.hex()[:8],
            [rnd.name(j) for j in sorted(unverified)],
        )
    accusations = await _convict_equivocators(rnd, stated, failures, unverified, silent)
    equivocated = {a.share: int(a.share) for a in accusations}
    recomputed: set[int] = set()
    if failures or silent:
        rnd.keep_vec = True  # the others will ask us to reveal our parts
    if (failures or silent) and rnd.members[rnd.me].mode == "client":
        async with trio.open_nursery() as nursery:
            for j in {*failures, *silent}:
                nursery.start_soon(_push, rnd, j)
    for j, (k, chk) in failures.items():
        logger.warning(
            "round %s: share of reducer %s failed its check at chunk %d (%s); every member "
            "recomputes it from the revealed parts",
            rnd.round_id.hex()[:8],
            rnd.name(j),
            k,
            chk.why,
        )
        accused, parts = await _judge(rnd, seed, stated, j, k, chk)
        if accused is not None:
            accusations.append(accused)
        why = _after_judging(rnd, stated, j, parts, accused, declared.get(j))
        _settle(rnd, j, why, dropped, recomputed)
    why_not: dict[int, str | None] = {}

    async def unchecked(j: int) -> None:
        # (a share we repaired while others hold it from its reducer: without the reducer)
        liar = j if j in rnd.repaired and j not in declared else equivocated.get(j)
        why_not[j] = await _unchecked(rnd, j, silent[j], liar, declared.get(j, set()))

    async with trio.open_nursery() as nursery:  # at once: a silent peer's reveals time out
        for j in silent:
            if j not in failures:
                nursery.start_soon(unchecked, j)
    for j, why in why_not.items():
        if why is None:
            unverified.add(j)
        else:
            _settle(rnd, j, why, dropped, recomputed)
    failed = dropped | recomputed
    caught = {a.peer for a in accusations}
    for j in rnd.reducers:
        if j not in rnd.repaired and j not in silent and rnd.name(j) not in caught:
            readmitted = _readmitted(rnd, stated, j)
            if readmitted is not None:
                accusations.append(readmitted)
    return Verdict(
        frozenset(dropped),
        frozenset(recomputed),
        frozenset(unverified - failed),
        tuple(accusations),
    )


def _after_judging(
    rnd: AllReduceState,
    stated: dict[int, Statement],
    j: int,
    parts: dict[int, Reveal],
    accused: Accusation | None,
    namers: set[int] | None,
) -> str:
    """Failed share ``j`` recomputed from the revealed ``parts`` (why not: "" when done):
    without its convicted liar, or, when members named it as still awaited (``namers``), as
    the members that could not check it recompute it: without the namers."""
    if namers:
        left_out = namers | (set().union(*rnd.masks[j]) - set(parts))
        return _recompute(rnd, dict(rnd.statements), j, parts, left_out)
    if accused is None:
        return "nobody was convicted"
    liar = [m.peer_id for m in rnd.members].index(accused.peer)
    return _recompute(rnd, stated, j, parts, {liar})


RELAYS = 2
"""Members a client first asks to relay the statements it lacks (each lists all it lacks):
few, so that relays to clients do not grow as n**3 a round; two, so that one withholding
member only delays it. The others are asked if some are still missing after them."""


async def _exchange(rnd: AllReduceState, mine: dict, until: float) -> None:
    """Swap statements with the group until ``until``: one unary call per pair of nodes (the
    lower calls, :func:`_callees`), answered with the callee's statement as soon as it has it,
    so a clean round's check costs one round trip (decisions.md has the figures). A member
    that has not called us within half the check's time, or one we could not reach, gets
    relayed, by members asked to answer once they hold one we lack (:func:`_relayed`). Nobody
    calls a client: it asks :data:`RELAYS` members at once, then the others."""
    client = rnd.members[rnd.me].mode == "client"

    def missing() -> set[int]:
        return _expected(rnd) - set(rnd.statements)

    with trio.move_on_at(until):
        unreached: set[int] = set()
        await _swap_all(rnd, mine, False, unreached, _callees(rnd))
        if missing() and not client and not unreached & missing():
            # A lower member calls us with its statement once it has it; one that has not
            # within half the check's time is asked of the others (relayed) too.
            await _wait_for_all(rnd, trio.current_time() + rnd.verify_timeout / 2)
        reached = [i for i in _dialable(rnd) if i not in unreached]
        if missing() and client:
            at = rnd.me % len(reached) if reached else 0  # clients spread over the members
            first = (reached[at:] + reached[:at])[:RELAYS]
            await _relayed(rnd, mine, unreached, first)
            reached = [i for i in reached if i not in first]
        if missing():
            await _relayed(rnd, mine, unreached, reached)
        await _wait_for_all(rnd, until)


async def _relayed(
    rnd: AllReduceState, mine: dict, unreached: set[int], members: Sequence[int]
) -> None:
    """Ask each of ``members`` (but us) to relay the statements we lack, again after each
    answer that brought some, until we hold them all or none has more to give."""

    async def ask(i: int) -> None:
        while _expected(rnd) - set(rnd.statements) and i not in unreached:
            if not await _swap(rnd, i, mine, True, unreached):
                return

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:

            async def until_all() -> None:
                await _wait_for_all(rnd, math.inf)
                scope.cancel()

            nursery.start_soon(until_all)
            async with trio.open_nursery() as asks:
                for i in members:
                    if i != rnd.me:
                        asks.start_soon(ask, i)
            scope.cancel()


async def _swap_all(
    rnd: AllReduceState, mine: dict, wait: bool, unreached: set[int], members: Sequence[int]
) -> None:
    """:func:`_swap` with each of ``members`` (but us) at once."""
    async with trio.open_nursery() as nursery:
        for i in members:
            if i != rnd.me and i not in unreached:
                nursery.start_soon(_swap, rnd, i, mine, wait, unreached)


def _settle(rnd: AllReduceState, j: int, why: str, dropped: set[int], recomputed: set[int]) -> None:
    """Reducer ``j``'s failed share: recomputed (``why`` empty), or dropped by every member
    (zeroed here) for the reason ``why``."""
    if not why:
        recomputed.add(j)
        return
    logger.warning(
        "round %s: share of reducer %s not recomputed (%s); every member drops it",
        rnd.round_id.hex()[:8],
        rnd.name(j),
        why,
    )
    dropped.add(j)
    rnd.out[rnd.bounds[j] : rnd.bounds[j + 1]] = 0.0


def _recompute(
    rnd: AllReduceState,
    stated: dict[int, Statement],
    j: int,
    parts: dict[int, Reveal],
    left_out: set[int],
) -> str:
    """Share ``j`` aggregated here from its contributors' revealed parts, ``left_out``'s not,
    chunk by chunk with the contributors' signed weights and norms (the same inputs on every
    member, :func:`.verify.recompute`), then rounded by the codec as a reducer's result is;
    written into the result with its new masks. Returns why not ("" when done)."""
    assert rnd.out is not None
    cfg = rnd.config
    values, masks, taus = [], [], []
    # Members that signed, in their statements, that they abstained are left out too (a
    # reducer convicted of counting one of them: the same on every member).
    abstained = {i for i, st in stated.items() if not st.weight > 0 and j not in st.shares}
    for k, mask in enumerate(rnd.masks[j]):
        keep = sorted(mask - left_out - abstained)
        if not keep:
            return f"chunk {k} had no contributor left"
        a, b = rnd.chunks[j][k]
        codec = rnd.codec.at(*rnd.share_slice(j, k))  # the chunk's own (segments across leaves)
        xs, raw, norms = [], [], []
        for i in keep:
            st, data = stated.get(i), parts.get(i)
            fig = st.shares.get(j) if st is not None else None
            if fig is None or data is None:
                return f"{rnd.name(i)} stated or revealed nothing"
            if data.lie(fig, k):
                return f"{rnd.name(i)} revealed a part it did not commit to"
            x = codec.decode(data.parts[k], b - a)
            norm = float(fig.norms[k])
            if not is_finite(x) or abs(part_norm(x) - norm) > 1e-6 * norm + 1e-30:
                return f"{rnd.name(i)} stated a norm its part does not have"
            xs.append(x)
            raw.append(counted_weight(st.weight, float(rnd.members[i].weight)))
            norms.append(norm)
        if not sum(raw) > 0:
            return f"chunk {k} had no weight left"
        agg, tau = recompute(xs, raw, norms, cfg.robust_mode, cfg.robust_tau, cfg.robust_iters)
        values.append(codec.decode(codec.encode(agg), b - a))
        masks.append(frozenset(keep))
        taus.append(tau)
    a = rnd.bounds[j]
    for (x, y), v in zip(rnd.chunks[j], values, strict=True):
        rnd.out[a + x : a + y] = v
    rnd.masks[j], rnd.taus[j] = masks, taus
    logger.warning(
        "round %s: share of reducer %s recomputed without %s",
        rnd.round_id.hex()[:8],
        rnd.name(j),
        [rnd.name(i) for i in sorted(left_out)],
    )
    return ""


async def _judge(
    rnd: AllReduceState, seed: bytes, stated: dict[int, Statement], j: int, k: int, chk: ChunkCheck
) -> tuple[Accusation | None, dict[int, Reveal]]:
    """Who lied about chunk ``k`` of share ``j``, from the parts of the whole share its
    contributors reveal (returned, for the recomputation)."""
    assert rnd.out is not None
    mask = sorted(rnd.masks[j][k])
    a, b = rnd.share_slice(j, k)
    shares: dict[int, Reveal] = {}
    async with trio.open_nursery() as nursery:

        async def one(i: int) -> None:
            got = await _reveal(rnd, i, j)
            if got is not None:
                shares[i] = got

        for i in sorted(frozenset().union(*rnd.masks[j])):
            nursery.start_soon(one, i)
    revealed = {i: shares.get(i) for i in mask}
    codec_name = rnd.codec.at(a, b).name  # the chunk's own (segments, when it spans leaves)
    blank = [i for i in mask if stated[i].shares.get(j) is None]
    if blank:
        return _judge_blank(rnd, stated, j, k, blank, codec_name), shares
    evidence = _chunk_evidence(rnd, j, k, codec_name) | {
        "seed": seed,
        "statements": [stated[i].wire for i in mask],
        # each contributor's part of this chunk and its chunk hashes (its signed root's)
        "parts": [got.parts[k] if got else b"" for got in revealed.values()],
        "hashes": [b"".join(got.hashes) if got else b"" for got in revealed.values()],
        # the digests of the share's result chunks we received (the contributors' roots')
        "results": b"".join(_received(rnd, j, kk) for kk in range(len(rnd.chunks[j]))),
        # the reducer's key (proven against its peer ID on receipt, an aux reducer's too)
        "reducer_key": rnd.reducer_keys.get(j, b""),
    }
    z = direction(seed, a, b - a)
    silent = []
    for i in mask:
        got = revealed[i]
        if got is None:
            silent.append(i)
            continue
        why = _part_lie(
            codec_name, got.hashes, got.parts[k], stated[i], j, k, z, rnd.out[a:b], rnd.taus[j][k]
        )
        if why:
            logger.warning("round %s: sender %s lied: %s", rnd.round_id.hex()[:8], rnd.name(i), why)
            return Accusation(rnd.name(i), "sender", why, rnd.round_id, j, k, evidence), shares
    if silent:
        logger.warning(
            "round %s: %s revealed nothing; the liar about share %s stays unknown",
            rnd.round_id.hex()[:8],
            [rnd.name(i) for i in silent],
            rnd.name(j),
        )
        return None, shares
    why = f"result is not the aggregate of the committed parts ({chk.why})"
    logger.warning("round %s: reducer %s lied: %s", rnd.round_id.hex()[:8], rnd.name(j), why)
    return Accusation(rnd.name(j), "reducer", why, rnd.round_id, j, k, evidence), shares


def _judge_blank(
    rnd: AllReduceState,
    stated: dict[int, Statement],
    j: int,
    k: int,
    blank: list[int],
    codec_name: str,
) -> Accusation | None:
    """Members counted in chunk ``k`` of share ``j`` that signed no figures for it: the signed
    hellos decide. Reducer ``j`` counted one whose signed contribution it does not list in its
    statement: the reducer lied (an honest one counts a sender only on that hello). It lists
    one, and the member's statement says it abstained: the member signed both. It lists one and
    the member states a weight (its side of the share was repaired): nobody is convicted."""
    rst = stated.get(j) or rnd.aux_statements.get(j)
    names = [m.peer_id for m in rnd.members]
    why, liar, evidence = "", -1, {}
    for i in blank:
        key = stated[i].wire["pk"]  # member i's own (its statement's signature is checked)
        hello = hello_of(rst, names, i, key) if rst is not None else None
        if rst is not None and (hello is None or not hello.weight > 0):
            why = f"counted {rnd.name(i)}, which signed no contribution to the round"
            liar = j
            evidence = _chunk_evidence(rnd, j, k, codec_name) | {
                "kind": "hello",
                "member": i,
                "member_key": key,
                "statements": [rst.wire],
            }
            break
        if hello is not None and not stated[i].weight > 0:
            why, liar = "signed a contribution at the round's start, then stated none", i
            evidence = {
                "kind": "equivocation",
                "member": i,
                "hello": hello.wire,
                "statements": [stated[i].wire],
                "members": [m.peer_id for m in rnd.members],
            }
            break
    if liar < 0:
        # Its side of the share was repaired (or the reducer stated nothing):
        # nothing signed tells who lies, so nobody is convicted and the share is dropped.
        logger.warning(
            "round %s: %s counted in share %s but stated no figures for it: nobody convicted",
            rnd.round_id.hex()[:8],
            [rnd.name(i) for i in blank],
            rnd.name(j),
        )
        return None
    role = "reducer" if liar == j and evidence["kind"] == "hello" else "sender"
    logger.warning("round %s: %s %s lied: %s", rnd.round_id.hex()[:8], role, rnd.name(liar), why)
    return Accusation(rnd.name(liar), role, why, rnd.round_id, j, k, evidence)


def _chunk_evidence(rnd: AllReduceState, j: int, k: int, codec_name: str) -> dict:
    """What every conviction about result chunk ``k`` of share ``j`` names: its terms (codec,
    place, rule), radius and contributors, the reducer's encoded bytes and its signature of
    them (checked on receipt), and the group (its spec's weights bound the stated ones)."""
    a, b = rnd.share_slice(j, k)
    return {
        "codec": codec_name,
        "start": a,
        "stop": b,
        "share": j,
        "chunk": k,
        "tau": rnd.taus[j][k],
        "robust": rnd.config.robust_mode,
        "fixed_tau": rnd.config.robust_tau,
        "mask": sorted(rnd.masks[j][k]),
        "encoded": rnd.result_bytes[j][k] if k < len(rnd.result_bytes.get(j, ())) else b"",
        "result_sig": rnd.result_sigs[j][k] or b"",
        "members": [m.peer_id for m in rnd.members],
        "spec": rnd.spec.to_bytes(),
    }


def _readmitted(rnd: AllReduceState, stated: dict[int, Statement], j: int) -> Accusation | None:
    """A member left out of a chunk of share ``j`` and counted again in a later one: an honest
    reducer excludes a sender from a chunk on (:meth:`.reducer.Reducer.exclude`) and never
    takes it back, so a reducer that does picks, chunk by chunk, whose part counts. Both
    masks are its signed word (its statement gives its key; an aux reducer's came with its
    result)."""
    rst = stated.get(j) or rnd.aux_statements.get(j)
    if rst is None:
        return None
    left: dict[int, int] = {}  # member -> the first chunk it was left out of
    for k, mask in enumerate(rnd.masks[j]):
        back = mask.intersection(left)
        if back:
            i, k0 = min(back), left[min(back)]
            sigs = (rnd.result_sigs[j][k0], rnd.result_sigs[j][k])
            held = rnd.result_bytes.get(j, [])
            if None in sigs or len(held) <= k:
                return None
            results = []
            for kk, sig in zip((k0, k), sigs, strict=True):
                a, b = rnd.share_slice(j, kk)
                results.append(
                    [kk, a, b, rnd.codec.at(a, b).name, held[kk], sorted(rnd.masks[j][kk])]
                    + [rnd.taus[j][kk], sig]
                )
            if not statement_holds(rst):
                return None  # its key's word only to us: no evidence for anyone else
            why = f"left {rnd.name(i)} out of chunk {k0}, then counted it in chunk {k}"
            logger.warning(
                "round %s: reducer %s lied: %s", rnd.round_id.hex()[:8], rnd.name(j), why
            )
            evidence = {
                "kind": "readmitted",
                "member": i,
                "share": j,
                "results": results,
                "robust": rnd.config.robust_mode,
                "fixed_tau": rnd.config.robust_tau,
                "statements": [rst.wire],
                "members": [m.peer_id for m in rnd.members],
                "spec": rnd.spec.to_bytes(),
            }
            return Accusation(rnd.name(j), "reducer", why, rnd.round_id, j, k, evidence)
        for i in rnd.plan.senders - mask:
            left.setdefault(i, k)
    return None


def _hello_evidence(ev: dict, accused: str) -> bool:
    """Redo a conviction on signed hellos (:func:`_judge_blank`) from its evidence alone."""
    members = [str(m) for m in ev["members"]]
    i = int(ev["member"])
    if not 0 <= i < len(members):
        return False
    (raw,) = ev["statements"]
    rid, digest = parse_round(raw), parse_digest(raw)
    spec = GroupSpec.from_bytes(ev["spec"]) if ev["kind"] != "equivocation" else None
    if spec is not None and (spec.digest != digest or [m.peer_id for m in spec.members] != members):
        return False
    counts = {jj: len(_fig_count(raw, jj)) for jj in _shares_of(raw)}
    if ev["kind"] == "equivocation":  # the member's own two signatures disagree
        st = parse_statement(raw, round_id=rid, digest=digest, members=members, chunks=counts)
        hello = parse_signed_hello(ev["hello"], round_id=rid, digest=digest, members=members)
        return (
            st.sender == hello.sender == i
            and hello.weight > 0
            and not st.weight > 0
            and members[i] == accused
        )
    if ev["kind"] == "readmitted":
        return _readmitted_evidence(ev, accused, raw, members, counts)
    if ev["kind"] != "hello":
        return False
    j, k = int(ev["share"]), int(ev["chunk"])
    a, b = int(ev["start"]), int(ev["stop"])
    mask = frozenset(int(m) for m in ev["mask"])
    st = parse_statement(raw, round_id=rid, digest=digest, members=members, chunks=counts)
    if st.sender != j or i not in mask or members[j] != accused:
        return False
    terms = chunk_terms(a, b, ev["codec"], bool(ev["robust"]), ev["fixed_tau"])
    signed = result_digest(rid, digest, j, k, ev["encoded"], mask, ev["tau"], terms)
    key = raw["pk"]  # the reducer's own (its statement's signature was checked with it)
    if not verify_signature(key, ev["result_sig"], result_claim(rid, digest, j, k, signed)):
        return False
    key = ev["member_key"]  # the listed hello's signer: checked against its peer ID
    if not isinstance(key, bytes) or not PeerID.from_base58(members[i]).matches(key):
        return False
    hello = hello_of(st, members, i, key)
    return hello is None or not hello.weight > 0


def _results_evidence(ev: dict, accused: str) -> bool:
    """Redo an equivocation conviction (:func:`_equivocations`): two valid signatures by the
    accused's key of one chunk of one round (same round, group, share and chunk) over
    different result digests. Anything else convicts nobody."""
    key, digests, sigs = ev["reducer_key"], ev["digests"], ev["sigs"]
    rid, group, j, k = ev["round"], ev["group"], ev["share"], ev["chunk"]
    if not all(isinstance(v, bytes) for v in (key, rid, group)):
        return False
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (j, k)):
        return False
    if not isinstance(digests, list) or not isinstance(sigs, list):
        return False
    if len(digests) != 2 or len(sigs) != 2:
        return False
    if not all(isinstance(v, bytes) and len(v) == 32 for v in digests):
        return False
    if digests[0] == digests[1] or not all(isinstance(v, bytes) for v in sigs):
        return False
    if PeerID.from_public_key(key) != PeerID.from_base58(accused):
        return False
    return all(
        verify_signature(key, sig, result_claim(rid, group, j, k, d))
        for d, sig in zip(digests, sigs, strict=True)
    )


def _readmitted_evidence(
    ev: dict, accused: str, raw: dict, members: list[str], counts: dict[int, int]
) -> bool:
    """Redo a conviction for taking back an excluded member (:func:`_readmitted`)."""
    rid, digest = parse_round(raw), parse_digest(raw)
    j, i = int(ev["share"]), int(ev["member"])
    st = parse_statement(raw, round_id=rid, digest=digest, members=members, chunks=counts)
    if st.sender != j or members[j] != accused:
        return False
    (k0, *first), (k1, *second) = ev["results"]
    masks = []
    for k, (a, b, codec, encoded, mask, tau, sig) in ((k0, first), (k1, second)):
        terms = chunk_terms(int(a), int(b), codec, bool(ev["robust"]), ev["fixed_tau"])
        signed = result_digest(rid, digest, j, int(k), encoded, frozenset(mask), tau, terms)
        if not verify_signature(raw["pk"], sig, result_claim(rid, digest, j, int(k), signed)):
            return False
        masks.append(frozenset(int(m) for m in mask))
    return int(k0) < int(k1) and i not in masks[0] and i in masks[1]


def _part_lie(
    codec_name: str,
    hashes: Sequence[bytes],
    data: bytes,
    st: Statement,
    j: int,
    k: int,
    z: np.ndarray,
    result: np.ndarray,
    tau: float | None,
) -> str:
    """Why a revealed part contradicts its sender's statement ("" when it does not)."""
    fig = st.shares.get(j)
    if fig is None:
        return "stated nothing for this share"
    if not st.weight > 0:  # it sent a part (its hash below) and says it contributed nothing
        return "stated no weight for a part it sent"
    if len(hashes) <= k:
        return "revealed too few chunk hashes"
    why = _commit_lie(fig, hashes, k, data)
    if why:
        return why
    codec = get_codec(codec_name)
    try:
        part = codec.decode(data, result.size)
    except ValueError as e:
        return f"revealed part does not decode: {e}"
    q = projection(z, part, result, tau)
    if abs(q - fig.q[k]) > 1e-6 * (abs(q) + float(np.linalg.norm(z)) * part_norm(part - result)):
        return f"stated projection {fig.q[k]:.6g}, its part gives {q:.6g}"
    if abs(part_norm(part) - fig.norms[k]) > 1e-6 * part_norm(part) + 1e-30:
        return "stated norm differs from its part's"
    return ""


def check_evidence(acc_evidence: dict, accused: str) -> bool:
    """Redo an accusation's check from its evidence alone: True when it convicts ``accused``
    (signatures, commitments and arithmetic all hold). Used by peers that were not there;
    malformed evidence convicts nobody.

    A sender is convicted by its own signed statement and the part it revealed; a reducer by
    its signature of the result chunk, the contributors' signed statements and their revealed
    parts (all of them, matching their commitments)."""
    try:
        if acc_evidence.get("kind") == "results":  # two signed results of one chunk
            return _results_evidence(acc_evidence, accused)
        if acc_evidence.get("kind") is not None:  # a conviction on signed hellos
            return _hello_evidence(acc_evidence, accused)
        return _chunk_evidence_convicts(acc_evidence, accused)
    except (
        AttributeError,
        IndexError,
        KeyError,
        TypeError,
        ValueError,
        BadContributionError,
        IdentityError,
        GroupError,
    ):
        return False


def _chunk_evidence_convicts(acc_evidence: dict, accused: str) -> bool:
    """:func:`check_evidence` of a conviction on a chunk's figures (:func:`_judge`)."""
    try:
        members = list(acc_evidence["members"])
        spec = GroupSpec.from_bytes(acc_evidence["spec"])
        if [m.peer_id for m in spec.members] != members:
            return False
        j, k = int(acc_evidence["share"]), int(acc_evidence["chunk"])
        a, b = int(acc_evidence["start"]), int(acc_evidence["stop"])
        mask = frozenset(int(i) for i in acc_evidence["mask"])
        codec = get_codec(acc_evidence["codec"])
        encoded = acc_evidence["encoded"]
        result = codec.decode(encoded, b - a)
        if result.size != b - a:
            return False
        n_chunks = {j: k + 1}
        stmts = []
        for raw in acc_evidence["statements"]:
            st = parse_statement(
                raw,
                round_id=parse_round(raw),
                digest=parse_digest(raw),
                members=members,
                chunks=n_chunks | {jj: len(_fig_count(raw, jj)) for jj in _shares_of(raw)},
            )
            stmts.append(st)
    except (KeyError, TypeError, ValueError, BadContributionError, GroupError):
        return False
    if not stmts or len({(s.round_id, s.digest, s.seed) for s in stmts}) != 1:
        return False
    if stmts[0].digest != spec.digest:
        return False
    if {s.sender for s in stmts} != mask or len(stmts) != len(mask):
        return False
    key, sig = acc_evidence["reducer_key"], acc_evidence["result_sig"]
    terms = chunk_terms(
        a, b, acc_evidence["codec"], bool(acc_evidence["robust"]), acc_evidence["fixed_tau"]
    )
    signed = result_digest(
        stmts[0].round_id, stmts[0].digest, j, k, encoded, mask, acc_evidence["tau"], terms
    )
    # Only signed facts count: every contributor signed (in its results root) the digest of
    # the result chunk it received under these terms (codec, place, rule), so none of them is
    # the accuser's word.
    results = acc_evidence["results"]
    listed = [results[i : i + 32] for i in range(0, len(results), 32)]
    if k >= len(listed) or listed[k] != signed:
        return False
    for st in stmts:
        fig = st.shares.get(j)
        if fig is not None and (len(fig.q) != len(listed) or fig.results != results_root(listed)):
            return False
    try:
        reducer_signed = PeerID.from_public_key(key) == PeerID.from_base58(
            members[j]
        ) and verify_signature(
            key, sig, result_claim(stmts[0].round_id, stmts[0].digest, j, k, signed)
        )
    except (TypeError, ValueError, IdentityError):
        reducer_signed = False
    seed = stmts[0].seed
    if seed != acc_evidence["seed"]:
        return False
    z = direction(seed, a, b - a)
    tau = acc_evidence["tau"]
    stated = {s.sender: s for s in stmts}
    if any(s.shares.get(j) is None for s in stmts):
        return False  # counted by the reducer, no figures signed: nothing tells who lied
    revealed = zip(stmts, acc_evidence["hashes"], acc_evidence["parts"], strict=True)
    for st, hashes, data in revealed:
        chunk_hashes = [hashes[i : i + 32] for i in range(0, len(hashes), 32)]
        why = _part_lie(acc_evidence["codec"], chunk_hashes, data, st, j, k, z, result, tau)
        if why:
            return members[st.sender] == accused
    chk = check_chunk(
        acc_evidence["codec"],
        result,
        stated,
        frozenset(stated),
        j,
        k,
        tau,
        bool(acc_evidence["robust"]),
        acc_evidence["fixed_tau"],
        [m.weight for m in spec.members],
    )
    return reducer_signed and not chk.ok and members[j] == accused


def _body(raw: dict) -> dict:
    import msgpack

    return msgpack.unpackb(raw["b"], raw=False, strict_map_key=False)


def parse_round(raw: dict) -> bytes:
    return _body(raw)["r"]


def parse_digest(raw: dict) -> bytes:
    return _body(raw)["g"]


def _shares_of(raw: dict) -> list[int]:
    return list(_body(raw)["j"])


def _fig_count(raw: dict, j: int) -> range:
    return range(len(_body(raw)["j"][j][1]) // 8)
