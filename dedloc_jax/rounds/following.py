"""The follower's side of forming a group: join the leader the plan names, follow a redirect
when the leader's view put us elsewhere, and check the spec it answers with."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dedloc_jax.averaging.errors import GroupError
from dedloc_jax.averaging.group import GroupSpec, Member
from dedloc_jax.rounds.claims import excess_weight
from dedloc_jax.rounds.context import PeerSide
from dedloc_jax.rounds.wire import JOIN, LEADER, Slot, member_to_wire
from p2p.errors import P2PError, RPCTimeout
from p2p.identity import PeerID
from p2p.node import Node

log = logging.getLogger(__name__)

MAX_REDIRECTS = 2
"""Hops a follower takes when the peer it took for leader follows another (views differ)."""


class LeaderGone(Exception):
    """The leader did not serve our join: unreachable, no ``collab.join`` or an error, a
    malformed answer or spec, a refusal other than a closed group, or no answer in time
    (``hung``). Its followers try the next member in group order, as they do for a dead one: a
    registered peer that serves no join and ranks first left its whole group alone."""

    def __init__(self, leader: str, *, hung: bool = False) -> None:
        super().__init__(leader)
        self.leader = leader
        self.hung = hung


class Misled(LeaderGone):
    """The leader redirected us to a peer that did not serve our join (``target``: gone, or
    a redirect again past :data:`MAX_REDIRECTS`, or not a peer ID; ``target_hung``: it held
    the join until the timeout). The leader counts as gone: a hostile one that redirects every
    join to a ghost sent every follower home alone."""

    def __init__(self, leader: str, target: str | None, *, target_hung: bool = False) -> None:
        super().__init__(leader)
        self.target = target
        self.target_hung = target_hung


class LeaderClosed(Exception):
    """``leader`` (the one we joined, or its redirect's target) refused us as its group closed:
    formed, full, or on another state. An honest race sends us home alone; whether it was one
    is for the caller to check (:meth:`~dedloc_jax.rounds.matchmaking.Matchmaker._follow`)."""

    def __init__(self, leader: str) -> None:
        super().__init__(leader)
        self.leader = leader


class FollowsGone(Exception):
    """The member we asked to lead in a gone leader's place still follows that leader
    (``target``; it has not found it gone yet, and will fall back as we did): ask it again a
    little later."""

    def __init__(self, leader: str, target: str) -> None:
        super().__init__(leader)
        self.target = target


async def ask_leader(
    node: Node, slot: Slot, peer: str, timeout: float, *, refused: str | None = None
) -> Any:
    """``peer``'s answer to whom it follows at ``slot`` (raises P2PError); ``refused``: the
    leader that refused us as its group closed, told to the member we ask."""
    request: dict[str, Any] = {"epoch": slot[0], "level": slot[1]}
    if refused is not None:
        request["refused"] = refused
    return await node.call(PeerID.from_base58(peer), LEADER, request, timeout=timeout)


async def leader_of(node: Node, slot: Slot, peer: str, timeout: float) -> str | None:
    """Whom ``peer`` follows at ``slot`` (None: undecided, alone, or unreachable)."""
    try:
        answer = await ask_leader(node, slot, peer, timeout)
    except P2PError as e:
        log.debug("%s did not say whom it follows at %s: %s", peer, slot, e)
        return None
    if not isinstance(answer, dict) or answer.get("decided") is not True:
        return None
    leader = answer.get("leader")
    return leader if isinstance(leader, str) else None


@dataclass(frozen=True)
class Joining:
    """One follower's join of a slot's group: what it sends and what it tells its matchmaker."""

    node: Node
    slot: Slot
    me: Member
    context: PeerSide
    timeout: float
    """The join call's: the leader may hold the group up to its longest wait."""
    learn: Callable[[str, Any], None]
    """``learn(peer, {"addrs": [...]})``: remember a peer's addresses."""
    choose: Callable[[str], None]
    """This peer now follows that leader (a redirect): a join waiting on us is redirected."""
    cross: Callable[[bool], None]
    """The leader's word on whether its view held other groups (the mean then goes across
    groups), told as soon as its spec checks out."""
    share: float = 0.0
    """An equal share of the target among the peers we expect at the slot: the spec's weights
    must keep the claims rule with it (:func:`~dedloc_jax.rounds.claims.excess_weight`)."""
    gone: frozenset[str] = frozenset()
    """Leaders of this slot we found gone: a redirect to one raises :class:`FollowsGone`."""


async def follow(j: Joining, leader: str, *, hops: int = 0) -> GroupSpec:
    """Join ``leader``'s group: its spec. Raises :class:`LeaderClosed` when it (or the leader
    it sent us to) refused us as its group closed, :class:`LeaderGone` when ``leader`` did not
    serve the join (:class:`Misled`: the peer it sent us to did not), :class:`FollowsGone` when
    it redirects us to a leader we found gone."""
    epoch, level = j.slot
    peer_id = j.me.peer_id
    request: dict[str, Any] = {
        "epoch": epoch,
        "level": level,
        "member": member_to_wire(j.me),
        "addrs": [str(a) for a in j.node.addrs],
    }
    state = j.context.state_of(epoch)
    if state is not None:
        request["state"] = state
    try:
        answer = await j.node.call(PeerID.from_base58(leader), JOIN, request, timeout=j.timeout)
    except P2PError as e:
        log.info("leader %s of epoch %d did not take us: %s", leader, epoch, e)
        raise LeaderGone(leader, hung=isinstance(e, RPCTimeout)) from e
    if not isinstance(answer, dict):
        log.warning("leader %s sent a malformed answer to our join", leader)
        raise LeaderGone(leader)
    if not answer.get("ok"):
        log.info("leader %s refused us at epoch %d: %.200s", leader, epoch, answer.get("reason"))
        target = answer.get("redirect")
        if target in j.gone:
            # (following it, we stepped alone while the member that sent us there led the
            # others a moment later: bench.chaos, 12 kills)
            raise FollowsGone(leader, target)
        if isinstance(target, str) and target != peer_id:
            if hops >= MAX_REDIRECTS:
                raise Misled(leader, target)
            j.learn(target, {"addrs": answer.get("redirect_addrs")})
            try:
                PeerID.from_base58(target)
            except P2PError as e:
                log.info("leader %s redirected us to a bad peer ID: %s", leader, e)
                raise Misled(leader, None) from e
            j.choose(target)
            try:
                return await follow(j, target, hops=hops + 1)
            except LeaderGone as e:
                raise Misled(leader, target, target_hung=e.hung) from e
        if answer.get("closed") is True:
            raise LeaderClosed(leader)
        raise LeaderGone(leader)  # it leads nothing: "not leading", or no reason at all
    try:
        spec = GroupSpec.from_bytes(answer["spec"])
        spec.index_of(peer_id)
    except (GroupError, KeyError, TypeError) as e:
        log.warning("leader %s sent a bad group spec: %s", leader, e)
        raise LeaderGone(leader) from e
    excess = excess_weight(spec.members, j.share)
    if excess is not None:
        log.warning("leader %s sent a group spec with an unbounded weight: %s", leader, excess)
        raise LeaderGone(leader)
    addrs = answer.get("addrs")
    if isinstance(addrs, dict):
        members = {m.peer_id for m in spec.members}
        for peer, listed in list(addrs.items())[: len(members)]:
            if peer in members and peer != peer_id:
                j.learn(peer, {"addrs": listed})
    j.cross(answer.get("cross") is True)
    if j.context.admit is not None:
        try:
            for m in spec.members:
                await j.context.admit(PeerID.from_base58(m.peer_id), m.mode)
        except (ValueError, P2PError) as e:
            log.warning("leader %s formed a group with an uninvited peer: %s", leader, e)
            raise LeaderGone(leader) from e
    return spec
