"""The round's plan, from what one peer sees: whom it expects, whom its lineage leaves out, and
which group it is in. Pure: every peer computes it alone, so views that agree plan alike."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from dedloc_jax.progress import PeerProgress
from dedloc_jax.rounds.grouping import assign_groups, group_of


def expected_peers(
    records: Mapping[str, PeerProgress], mates: tuple[int, Collection[str]], me: str, epoch: int
) -> set[str]:
    """Who should register for ``epoch``: peers that join rounds and whose latest progress
    report is at ``epoch``, and ``mates`` (those that averaged with us into ``mates[0]``) whose
    report we read may still be of the epoch before. Without the mates, a peer that fills the
    target alone reads its mate's old report, expects nobody and steps alone.

    A peer that only follows the run (an aux peer that checkpoints, ``averages`` False) or
    left it (:meth:`~dedloc_jax.tracker.ProgressTracker.leave`) is not expected: a leader
    would wait for a peer that never joins. Nor is a mate whose report we lack: a table that
    lost records would hold every group for its mates."""
    peers = {pid for pid, r in records.items() if r.epoch == epoch and r.averages}
    into, averaged_with = mates
    if into == epoch:
        peers |= {
            p
            for p in averaged_with
            if p != me and p in records and records[p].epoch == into - 1 and records[p].averages
        }
    return peers


def same_state(a: bytes | None, b: bytes | None) -> bool:
    """Whether two peers may average together: both step from the same state, or one of
    them did not say (an aux peer holds none; a trainer may not have served its state yet).
    Peers on two lineages that average gradients stay apart, since each applies the mean to
    other parameters, and every such step counts one more peer for the wrong lineage."""
    return a is None or b is None or a == b


def state_to_follow(mine: bytes | None, states: Mapping[str, bytes | None]) -> bytes | None:
    """The state whose peers we group with: ours, or when we hold none (an aux peer) the one
    most registered peers step from (of as many, the smallest digest)."""
    if mine is not None:
        return mine
    counts = Counter(s for s in states.values() if s is not None)
    return min(counts, key=lambda s: (-counts[s], s)) if counts else None


def leader_order(
    group: Sequence[str],
    states: Mapping[str, bytes | None],
    modes: Mapping[str, str] | None = None,
) -> list[str]:
    """``group`` in the order its members try to lead: rank order, but peers that said which
    state they step from first (the leader is then one of them, so peers of one state that see
    a stateless peer, which may join any group, do not follow it into another state's group),
    and clients last within each (a client has no inbound path: its followers could not reach
    it)."""
    modes = modes or {}
    return sorted(group, key=lambda p: (states.get(p) is None, modes.get(p) == "client"))


def representatives(groups: Sequence[Sequence[str]], modes: Mapping[str, str]) -> set[str]:
    """Who carries each level-0 group's mean across groups: its first member that sends a
    vector (aux peers hold none)."""
    reps = set()
    for g in groups:
        rep = next((p for p in g if modes.get(p, "node") != "aux"), None)
        if rep is not None:
            reps.add(rep)
    return reps


@dataclass(frozen=True)
class Plan:
    """One peer's plan of a slot, from the registrations it read."""

    groups: list[list[str]]
    """The groups of the peers on our lineage, in rank order (the first member leads)."""
    mine: list[str]
    """Our group, in the order its members try to lead (:func:`leader_order`)."""
    late: frozenset[str]
    """Expected peers not registered yet that a leader of ours also waits for."""
    apart: frozenset[str]
    """Registered peers that step from another state: they average among themselves."""


def plan_groups(
    me: str,
    my_state: bytes | None,
    registered: Collection[str],
    states: Mapping[str, bytes | None],
    modes: Mapping[str, str],
    *,
    planned: Collection[str],
    expected: Collection[str],
    seed: int,
    cap: int,
    level: int,
) -> Plan:
    """Group ``me`` and the ``registered`` peers (``states``: the state each steps from;
    ``modes``: each one's mode, ours included) in groups of at most ``cap``.

    ``planned``: who the tracker saw at this epoch, ourselves included: groups are sized for
    all of them, so that a view that missed registrations counts as many groups as the
    others. ``expected`` (ourselves excluded) gives :attr:`Plan.late`: at level 1, every
    representative not registered yet (its group may still be averaging); at level 0, those
    that hash into our group (closing without them refused their joins and left them
    alone). At level 0 the groups are those of every planned and registered peer, each
    holding only its registered ones: a view that misses a registration plans every other
    peer into the group the full view does."""
    others = set(registered)
    follow = state_to_follow(my_state, states)
    apart = frozenset(p for p in others if not same_state(follow, states.get(p)))
    population = len(set(planned) | others)
    if apart:  # groups sized for our lineage's share of the peers
        population = -(-population * (len(others) + 1 - len(apart)) // (len(others) + 1))
    missing = set(expected) - others
    here = ({me} | others) - apart
    if level == 0 and missing:
        # Expected peers not registered yet keep their seats: each registered peer's group is
        # the one it has once they register. A group over the cap passes its highest ranks on
        # (assign_groups): every view, with the late peer or without it, must pass on the
        # same ones, or a leader fills the late peer's seat and refuses it as full.
        full = assign_groups(
            sorted((set(planned) | here) - apart),
            max_group_size=cap,
            seed=seed,
            population=population,
        )
        groups = [[p for p in g if p in here] for g in full]
        groups = [g for g in groups if g]
        late = frozenset(set(group_of(me, full) or []) & missing)
    else:
        groups = assign_groups(sorted(here), max_group_size=cap, seed=seed, population=population)
        late = frozenset(missing) if level == 1 else frozenset()
    known = {p: states.get(p) for p in others} | {me: my_state}
    ours = group_of(me, groups)
    assert ours is not None  # we are among the peers grouped
    mine = leader_order(ours, known, modes)
    return Plan(groups, mine, late, apart)
