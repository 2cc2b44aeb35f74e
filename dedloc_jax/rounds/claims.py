"""What a member may claim in its group registration: bandwidths and weight, bounded by the
others' before the leader sizes shares (pure).

Every figure in a join is the member's own word. The load-balancing LP gives a peer that claims
1e15 B/s up and down nearly the whole vector to reduce, and a weight of 2**53 samples made its
vector the whole mean. The leader bounds each other member's links
by the group's lower median in the same direction (its own figure, measured on its own links,
among them): the LP is that sensitive, since a member stating 3x the others' links already got
the whole vector (1.5x: half of it). A faster honest member reduces no more than an equal share
then. Weights are bounded by :data:`~dedloc_jax.progress.CLAIM_CAP` times their median, as the
progress estimate bounds samples: a liar weighs at most as much as a few typical members.
That bound never falls below ``CLAIM_CAP`` equal shares of the target among the peers expected
at the slot: a peer that honestly fed most of the target while the other compiled or joined
(64 samples against 12, two peers) counts whole, and a group of two cannot be defended by
weights anyway.

The leader bounds its own weight by the same rule, and a follower refuses a spec in which any
weight breaks it (:func:`excess_weight`): every member counts the spec's weights, and a lying
leader wrote 2**53 for itself (a plain mean, in a group of two or a private run, was then its
vector alone).

A peer's sample claims count toward the target only while its contribution weighs
(:func:`weightless`): one whose gradient the robust aggregation weighed at nothing (a -1000x
sign flip), or that registered or signed weight 0, still had its samples counted, and the
honest peers stepped with three quarters of a clean run's samples (bench.byzantine).

Only the members of that group saw it: each publishes its round's outcome in its progress
record (the senders it checked, those that weighed nothing), and a peer outside the group
marks a sender when the reporters of its newest round agree (:func:`reported_void`): at least
:data:`QUORUM` of them, more than half of those whose outcome names it. One liar's word,
however often repeated, marks nobody; the honest members of a group compute the same
weights from the same signed statements, so they agree. (Identities that average with the
run can outvote a group smaller than their number: the limit of any vote.) A marked peer's
registration weighs 0 in matchmaking: it counts nothing toward the target and gets weight 0
in its group's spec (:func:`zero_weightless`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from dedloc_jax.averaging.group import Member
from dedloc_jax.progress import CLAIM_CAP, claim_cap

log = logging.getLogger(__name__)


IMPLAUSIBLE_LINKS = 1000.0
"""A link claim this many times the group's lower median is no honest spread (fibre against a
1 Mbit/s line is 1000x; measured loopback figures differ up to 8x): logged at INFO."""


def bound_claims(members: Sequence[Member], me: str, *, share: float = 0.0) -> list[Member]:
    """``members`` with every other member's upload and download lowered to the group's lower
    median of that figure (ours kept as they are), and every weight, ours too, to ``CLAIM_CAP``
    times theirs (positive ones) or times ``share`` (an equal share of the target), whichever
    is larger. Logs each other member it bounds (at INFO a bounded weight or a link claim over
    :data:`IMPLAUSIBLE_LINKS` times its bound)."""
    up = claim_cap(m.upload_bps for m in members if m.mode != "client") / CLAIM_CAP
    down = claim_cap(m.download_bps for m in members) / CLAIM_CAP
    weight = max(claim_cap(m.weight for m in members if m.sends), CLAIM_CAP * share)
    out = []
    for m in members:
        if m.peer_id == me:  # our links are measured by us; our weight follows the rule
            out.append(dataclasses.replace(m, weight=min(m.weight, weight)))
            continue
        bounded = dataclasses.replace(
            m,
            upload_bps=min(m.upload_bps, up),
            download_bps=min(m.download_bps, down),
            weight=min(m.weight, weight),
        )
        if bounded != m:
            # A member faster than the median is bounded in every ordinary round (DEBUG); a
            # bounded weight or an implausible link claim is a liar's or a broken peer's (INFO).
            far = bounded.weight != m.weight or any(
                was > IMPLAUSIBLE_LINKS * now
                for was, now in ((m.upload_bps, up), (m.download_bps, down))
            )  # fmt: skip
            (log.info if far else log.debug)(
                "member %s claims %.3g B/s up, %.3g B/s down and weight %.3g: counted as "
                "%.3g, %.3g and %.3g (bounded by the group's medians)",
                m.peer_id[:8],
                m.upload_bps,
                m.download_bps,
                m.weight,
                bounded.upload_bps,
                bounded.download_bps,
                bounded.weight,
            )
        out.append(bounded)
    return out


SHARE_SLACK = 2.0
"""How far a follower's equal share of the target may be below the leader's (their views of
the peers expected at the slot may differ) before a weight over its bound is refused."""


def excess_weight(members: Sequence[Member], share: float = 0.0) -> str | None:
    """Why a spec's weights break :func:`bound_claims`'s rule (None: they keep it), checked by
    a follower with its own ``share`` (allowed :data:`SHARE_SLACK` below the leader's)."""
    weight = max(claim_cap(m.weight for m in members if m.sends), CLAIM_CAP * SHARE_SLACK * share)
    for m in members:
        if m.sends and m.weight > weight * (1 + 1e-9):
            return f"member {m.peer_id[:8]} weighs {m.weight:.3g}, over the bound {weight:.3g}"
    return None


MIN_KEPT = 0.5
"""A sender whose part weighed nothing over more than half of the values it sent in a verified
round counts no samples toward the target (:func:`weightless`). The robust weight of a part is
either its capped weight, never below ``WEIGHT_CAP`` medians (> 0: CenteredClip's clipping to
the radius, an honest part's bad luck, scales its pull, not this weight), or zero for a part
over ``verify.OUTLIER`` radii (ten upper medians of the chunk's norms). No honest gradient is
ten times its peers' (OUTLIER's premise) but in a chunk or two that its batch alone touched:
an honest sender keeps nearly all of its values, a -1000x one none; half is far from both."""


def weightless(kept: Mapping[str, float]) -> tuple[set[str], set[str]]:
    """From a verified round's :attr:`~dedloc_jax.averaging.AllReduceResult.kept`: the senders
    whose sample claims count for nothing from now on (they kept under :data:`MIN_KEPT`),
    and those that contributed with real weight (their claims count again)."""
    void = {peer for peer, fraction in kept.items() if fraction < MIN_KEPT}
    return void, set(kept) - void


QUORUM = 2
"""Reporters that must agree (and be more than half of those naming the sender at its newest
reported round) before a peer outside the group takes their verdict (:func:`reported_void`)."""

Outcome = tuple[int, Sequence[str], Sequence[str]]
"""A round's outcome as a member publishes it: (epoch, senders it checked, weightless ones)."""


def counting_reporters(
    outcomes: Iterable[tuple[str, Outcome]],
    trusted: Callable[[str], bool],
    void: Collection[str] = frozenset(),
) -> tuple[set[str], set[str]]:
    """Whose ``outcomes`` ((reporter, outcome) pairs: a reporter's last few rounds) count
    (:func:`reported_void`): the ``trusted`` reporters, and those a counting reporter's
    outcome counted (they averaged with it, weighing, as a fresh identity cannot), never
    those in ``void``; and every peer a counting outcome counted (worth remembering)."""
    by_reporter: dict[str, list[Outcome]] = defaultdict(list)
    for reporter, outcome in outcomes:
        by_reporter[reporter].append(outcome)
    counting = {r for r in by_reporter if r not in void and trusted(r)}
    named: set[str] = set()
    fresh = set(counting)
    while fresh:
        for r in fresh:
            for _, senders, gone in by_reporter[r]:
                named |= set(senders) - set(gone) - set(void)
        fresh = {r for r in named if r in by_reporter and r not in counting}
        counting |= fresh
    return counting, named


def reported_void(
    outcomes: Iterable[tuple[str, Outcome]], counting: Collection[str]
) -> dict[str, tuple[int, bool]]:
    """Per sender the published ``outcomes`` ((reporter, outcome) pairs) of the ``counting``
    reporters give a verdict on: the newest epoch with one, and whether it weighed nothing
    there. At an epoch, the verdict is the word of more than half of the counting reporters
    (other than the sender) whose outcome names it, at least :data:`QUORUM` (a tie, or one
    reporter, says nothing)."""
    words: dict[tuple[str, int], dict[str, bool]] = defaultdict(dict)
    for reporter, (epoch, senders, void) in outcomes:
        if reporter not in counting:
            continue
        gone = set(void)
        for peer in set(senders) - {reporter}:
            words[(peer, epoch)][reporter] = peer in gone
    verdicts: dict[str, tuple[int, bool]] = {}
    for (peer, epoch), by in words.items():
        said = list(by.values())
        accused = sum(said)
        side = accused if 2 * accused > len(said) else len(said) - accused
        if side < QUORUM or 2 * side <= len(said):
            continue
        if peer not in verdicts or verdicts[peer][0] < epoch:
            verdicts[peer] = (epoch, 2 * accused > len(said))
    return verdicts


def zero_weightless(
    members: Sequence[Member], me: str, weightless: Callable[[str], bool]
) -> list[Member]:
    """``members`` with every other member that ``weightless`` names at weight 0 (logged):
    its contribution weighed nothing in a round, ours or one a quorum reported."""
    out = []
    for m in members:
        if m.peer_id != me and m.weight > 0 and weightless(m.peer_id):
            log.info("member %s weighed nothing in a recent round: weight 0", m.peer_id[:8])
            m = dataclasses.replace(m, weight=0.0)
        out.append(m)
    return out
