"""Lineages of the training state, and which one the collaboration follows (pure logic).

Every peer's state descends from the one before it; two lineages of one epoch exist after a
partition (each side averaged apart) or a group that missed the round across groups. They
never merge by themselves, since averaging gradients keeps parameters apart, so every peer
must agree which one goes on: the one more peers hold (:func:`fork_choice`). Peers name
their state with its ancestors' digests (its ``lineage``), so that a fork is counted at the
epoch where it happened, not only at the newest one.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dedloc_jax.progress import MAX_LINEAGE
from p2p.identity import PeerID

LINEAGE = MAX_LINEAGE
"""Ancestors an announcement names: a peer that checks its state a few epochs after the
others moved on still counts them for the lineage they descend from."""


@dataclass(frozen=True)
class Announcement:
    """One peer's announced state: its epoch and digest, and the digests of the states it
    descends from (its ``lineage``, newest first; empty when unknown, e.g. after a load).
    ``peer``: a PeerID read from the state key, or its text from the progress table."""

    peer: PeerID | str
    epoch: int
    digest: bytes
    lineage: tuple[bytes, ...] = ()
    votes: bool = True
    """False for a copy held by a peer that trains nothing (an aux peer, e.g. a coordinator
    serving its checkpoint): a donor, never a vote (see :func:`_voters`)."""
    vouched: bool = False
    """Another peer signed that it averaged with this peer (its averaging history,
    :mod:`dedloc_jax.state.vouching`): while any announcement is, only those vote."""
    endorsed: bool = False
    """The peers we joined through trust this peer (:meth:`VouchBook.endorse`): while any
    announcement is, only those vote, above the ones our own mates vouch for."""

    def digest_at(self, epoch: int) -> bytes | None:
        """The digest of this lineage's state at ``epoch`` (an ancestor's), if known."""
        back = self.epoch - epoch
        if back == 0:
            return self.digest
        return self.lineage[back - 1] if 0 < back <= len(self.lineage) else None


def _chain(a: Announcement) -> set[tuple[int, bytes]]:
    """The (epoch, digest) states an announcement names: its own and its known ancestors'."""
    return {(a.epoch - k, d) for k, d in enumerate((a.digest, *a.lineage))}


def _voters(announced: Sequence[Announcement]) -> list[Announcement]:
    """The announcements the fork choice counts: states their peer stepped to (they name
    their lineage), of peers that train.

    A copy (a state loaded from others: a restarted peer's, or a coordinator's checkpoint)
    repeats the choice made when it was loaded: counted, it voted again for a lineage the
    trainers may have left since, and with a killed peer's announcement (it lives until it
    expires) it outvoted the one live trainer of a pair. A state of epoch 0 names no lineage
    either (a newcomer whose download failed serves its own). With no such state (a run's
    first epoch, or only copies left), every announcement counts.

    Of those, only the ones of the highest :func:`_rank` vote: while any is vouched (another
    peer signed that it averaged with its peer), only the vouched: announcers that never
    averaged with the run (Sybil identities) cannot outvote it; and while any is endorsed (our
    roots trust its peer), only the endorsed: two groups that averaged apart, each vouching
    only for itself, then count the same voters (see :mod:`dedloc_jax.state.vouching`).
    Unvouched states vote only when none is vouched (a run of one, a run's first epoch)."""
    votes = [a for a in announced if a.votes]
    voters = [a for a in votes if a.lineage] or votes or list(announced)
    top = max(map(_rank, voters), default=0)
    return [a for a in voters if _rank(a) == top]


def _rank(a: Announcement) -> int:
    """How far a state's vote is proven: 2 our roots trust its peer, 1 a signer traced to our
    own mates vouched for it, 0 neither."""
    return 2 if a.endorsed else 1 if a.vouched else 0


def _copies(
    announced: Sequence[Announcement], voters: Sequence[Announcement]
) -> list[Announcement]:
    """The trainers' states that are no votes (copies: loaded, they name no lineage), vouched
    as the voters are: they break a tie between sides as many voters hold (see
    :func:`_copy_tally`), never outvote one."""
    counted = {id(a) for a in voters}
    top = max(map(_rank, voters), default=0)
    return [
        a
        for a in announced
        if id(a) not in counted and a.votes and not a.lineage and _rank(a) >= top
    ]


def _copy_tally(
    alive: Sequence[Announcement], copies: Sequence[Announcement], epoch: int
) -> Counter:
    """Digest at ``epoch`` -> how many ``copies`` hold a state of that side (one that a
    voter holding that digest at ``epoch`` holds or descends from). After a healed partition
    the majority's peers that stepped without the whole collaboration had loaded the state
    their fork check named, and held copies: the smaller side then tied on votes, won by
    digest, and the majority loaded its state (issue 46)."""
    tally: Counter = Counter()
    for c in copies:
        if c.epoch < epoch:
            continue
        sides = {a.digest_at(epoch) for a in alive if a.digest_at(c.epoch) == c.digest}
        for d in sides - {None}:
            tally[d] += 1
    return tally


def _winning_side(announced: Sequence[Announcement]) -> list[Announcement]:
    """The voters left after following, at every fork, the side more peers hold, then keeping
    the cluster (:func:`_clusters`) more of them are in; of as many, the newest.

    States further apart than a lineage names cannot be counted against each other at a
    fork: whether the older is an ancestor of the newer (a peer restarted, or still
    compiling, while another stepped alone) or another lineage (a long partition), more peers
    win, and of as many the newest, so that a peer alone and behind moves forward. The peers
    of the cluster that lost load its state, whatever its epoch (never waiting for the others
    to come to them: the others do not, and each side stepped alone forever)."""
    voters = _voters(announced)
    alive = _fork_walk(voters, _copies(announced, voters))
    if not alive:
        return alive
    return max(_clusters(alive), key=lambda c: (len(c), max(a.epoch for a in c)))


def _clusters(alive: Sequence[Announcement]) -> list[list[Announcement]]:
    """``alive`` cut, in epoch order, where two announced epochs are more than ``LINEAGE``
    apart (so that no lineage named in one names a state of the other)."""
    ordered = sorted(alive, key=lambda a: a.epoch)
    out = [[ordered[0]]]
    for a in ordered[1:]:
        if a.epoch - out[-1][-1].epoch > LINEAGE:
            out.append([])
        out[-1].append(a)
    return out


def _reached(alive: Sequence[Announcement]) -> int | None:
    """The newest epoch that at least as many peers reached as still announce older ones."""
    for newest in sorted({a.epoch for a in alive}, reverse=True):
        if sum(a.epoch >= newest for a in alive) >= sum(a.epoch < newest for a in alive):
            return newest
    return None


def _fork_walk(
    announced: Sequence[Announcement],
    copies: Sequence[Announcement] = (),
    cut: dict[int, int] | None = None,
) -> list[Announcement]:
    """The announcements left after following, at every fork, the side more peers hold (of
    as many, the side more ``copies`` hold, then the smaller digest); ``cut`` gets, for
    each one left behind (by ``id``), the epoch of the fork it lost at."""
    alive = list(announced)
    for e in sorted({e for a in alive for e, _ in _chain(a)}):
        counts = lineage_counts(alive, e)
        if len(counts) < 2:
            continue
        held = _copy_tally(alive, copies, e)
        keep = min(counts, key=lambda k: (-counts[k], -held[k[1]], k[1]))[1]
        # States of the losing sides, from the fork on: anyone holding one (a peer that
        # loaded it names no lineage) is on a losing side too.
        lost = {
            s for a in alive if a.digest_at(e) not in (None, keep) for s in _chain(a) if s[0] >= e
        }
        if cut is not None:
            cut.update((id(a), e) for a in alive if _chain(a) & lost)
        alive = [a for a in alive if not (_chain(a) & lost)]
    return alive


def fork_choice(announced: Sequence[Announcement]) -> tuple[int, bytes] | None:
    """The state a peer should train on: walk the announced states from the oldest epoch a
    lineage names to the newest; where they fork, follow the side more peers hold (themselves
    or as an ancestor), of as many the smaller digest; of states too far apart to be counted
    at a fork, keep the cluster more peers are in (of as many, the newest); answer the newest
    state left that at least as many of its peers reached as still announce older epochs.
    Every peer that reads the same announcements picks the same state, and one that lost
    loads it whatever its epoch: no two sides each wait for the other.

    Not the newest epoch: after a heal the smaller side may be ahead, and the first peer to
    step may have stepped alone; a peer that falls behind loads what this returns."""
    alive = _winning_side(announced)
    newest = _reached(alive)
    if newest is None:
        return None
    counts = Counter(a.digest for a in alive if a.epoch == newest)
    return newest, min(counts, key=lambda d: (-counts[d], d))


def losing_peers(announced: Sequence[Announcement]) -> set[str]:
    """The peers (as text) whose announced state is on a side :func:`fork_choice` leaves.

    Their epoch must not lead the collaboration: the side that lost may be ahead, and the
    winners, "behind" with nothing newer on their own lineage to load, would stop."""
    if len({(a.epoch, a.digest) for a in announced}) < 2:
        return set()  # everyone serves one state: no fork (the usual case, and cheap)
    voters = _voters(announced)
    side = _winning_side(announced)
    kept = {id(a) for a in side}
    out = {str(a.peer) for a in voters if id(a) not in kept}
    counted = {id(a) for a in voters}
    lost = _lost_states(voters, side)
    for a in announced:
        if id(a) not in counted and _copy_lost(side, lost, a):
            out.add(str(a.peer))
    return out


def _lost_states(voters: Sequence[Announcement], side: Sequence[Announcement]) -> set:
    """The (epoch, digest) states the voters the fork choice leaves hold or descend from."""
    kept = {id(a) for a in side}
    return {s for a in voters if id(a) not in kept for s in _chain(a)}


def _copy_lost(side: Sequence[Announcement], lost: set, copy: Announcement) -> bool:
    """Whether a state that has no vote (a copy, or unvouched) is on a side the choice
    leaves: a loser holds it or an ancestor it names, or a winner names another state of an
    epoch its lineage names."""
    chain = _chain(copy)
    if chain & lost:
        return True
    return any(a.digest_at(e) not in (None, d) for a in side for e, d in chain)


def on_minority_fork(
    others: Mapping[tuple[int, bytes], int],
    epoch: int,
    digest: bytes,
    copies: Mapping[bytes, int] | None = None,
) -> bool:
    """Whether our state (``digest`` at ``epoch``) lost to another state of the same epoch.

    Two lineages of one epoch exist after a partition (each side averaged apart) or a group
    split; they never merge by themselves, since averaging gradients keeps parameters apart.
    The one more peers hold wins; of two held by as many, the smaller digest, so exactly one
    side of a tie moves. ``others`` counts the other peers holding each (epoch, digest),
    themselves or as an ancestor of their state (:func:`lineage_counts`). ``copies``: digest
    -> the copies on that side (:func:`_copy_tally`), which decide a tie before the digest.
    """
    mine = others.get((epoch, digest), 0) + 1
    held = copies or {}
    ours = held.get(digest, 0)

    def wins_tie(d: bytes) -> bool:
        return held.get(d, 0) > ours or (held.get(d, 0) == ours and d < digest)

    return any(
        e == epoch and d != digest and (n > mine or (n == mine and wins_tie(d)))
        for (e, d), n in others.items()
    )


def lineage_counts(announcements: Iterable[Announcement], epoch: int) -> Counter:
    """(epoch, digest) -> how many announcing peers hold that state of ``epoch`` or a
    descendant of it. Peers that moved on replaced their announcement of ``epoch``: counting
    only announcements of ``epoch`` would make a late check lose to the few that have not, and
    a peer on a lost lineage win once the winners move on."""
    counts: Counter = Counter()
    for a in announcements:
        d = a.digest_at(epoch)
        if d is not None:
            counts[(epoch, d)] += 1
    return counts


def fork_verdict(
    announced: Sequence[Announcement],
    epoch: int,
    digest: bytes,
    lineage: Sequence[bytes] = (),
    vouched: bool = False,
    endorsed: bool = False,
) -> bool | None:
    """Whether our state (``digest`` at ``epoch``, descending from ``lineage``, newest first)
    lost to another lineage, or None when it cannot tell yet.

    Every epoch our lineage names, oldest first, where another peer holds a different state is a
    fork, decided as :func:`fork_choice`'s walk decides it (the side more voters hold, of as
    many the side more copies hold, then the smaller digest; a side that lost an earlier fork no
    longer counts): after a healed partition the sides forked epochs ago, and counting only at
    our epoch misses it while the other side is an epoch behind. It cannot tell while fewer
    peers (us included) hold a state of that epoch, or a descendant, than still announce older
    epochs: those are still averaging, and decide the count (a peer that stepped alone and asks
    at once sees nobody to lose to; one that sees the first of the others loses or wins a 1-1
    tie by digest). A state in a cluster of fewer peers than another (or as many, older) loses
    at once (:func:`_winning_side`). Only votes count (:func:`_voters`); a state of ours that is
    no vote (a copy, or unvouched while others are) loses with the side it copied
    (:func:`_copy_lost`); ``vouched``, ``endorsed``: whether ours is (see
    :class:`Announcement`)."""
    ours = Announcement(
        "us", epoch, digest, tuple(lineage)[:LINEAGE], vouched=vouched, endorsed=endorsed
    )
    everyone = [*announced, ours]
    voters = _voters(everyone)
    if not any(a is ours for a in voters):  # a copy: lost with the side it copied
        side = _winning_side(everyone)
        return _copy_lost(side, _lost_states(voters, side), ours)
    others = [a for a in voters if a is not ours]
    copies = _copies(everyone, voters)
    cut: dict[int, int] = {}
    alive = _fork_walk(voters, copies, cut)
    if any(a is ours for a in alive) and not any(a is ours for a in _winning_side(everyone)):
        return True  # too far from most peers to count at a fork, and fewer (or older)
    for e in range(epoch - len(ours.lineage), epoch + 1):
        mine = ours.digest_at(e)
        counts = lineage_counts(others, e)
        if e < epoch and all(d == mine for _, d in counts):
            continue  # no fork there
        if sum(counts.values()) + 1 < sum(a.epoch < e for a in others):
            return None
        # Lost where the fork choice's walk leaves our side: there, not by a count of every
        # announcement, which counted a side that had lost an earlier fork (the majority,
        # kept at the partition's fork by its copies, then lost to the minority's two
        # states at a later epoch its own groups had split).
        if cut.get(id(ours), math.inf) <= e:
            return True
    return id(ours) in cut
