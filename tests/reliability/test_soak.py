"""Simulator soak (``bench.soak``): short plans of peers, churn, a healing partition and slow links.

Each peer trains on the simulated network in virtual time (MockClock): it accumulates
micro-batches until the collaboration reaches the target, averages, and applies the average
to the parameters it serves, keeping in step with the library's policy (keep_in_step_async).
During the run peers leave (some gracefully at an epoch boundary, some killed at a random
moment, mid-averaging included), new peers join and download the state, a partition splits
the network and heals, and a few hosts have slow uplinks. The
checks: the collaboration keeps stepping (the epochs are done, most of them averaged in a
group), members of one group end the epoch with bit-identical finite averages, every peer
holds the same parameters outside the partition (capped groups average across groups), and
nothing hangs (the run has a virtual-time bound).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import trio

from bench.soak import SoakPlan, check_soak, plan_for, run_soak
from bench.soak_figures import partial_figures
from p2p.dht import DHTConfig
from p2p.node import NodeConfig
from p2p.testing import SimNetwork, run_sim

SEED = int(os.environ.get("SOAK_SEED", "0"))
"""The default suite's seed; ``SOAK_SEED=S pytest tests/reliability/test_soak.py`` replays
another (the slow suite runs seeds 1-9 of the capped plan in both orders)."""


@pytest.mark.parametrize(
    ("group", "sorted_shuffle"),
    [(64, False), (3, False), pytest.param(3, True, marks=pytest.mark.slow)],
    ids=["one-group", "capped", "capped-hypothesis-order"],
)
def test_soak_small(group: int, sorted_shuffle: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Capped: groups of at most 3, whose means are averaged across groups every epoch. The
    figures reported as the run goes are those of the run so far: each report's epochs are
    the epochs the bootstrap peer reached, and the final figures extend the last report's.

    Importing hypothesis (any fuzz test in the process) switches trio's scheduler to another
    order (trio's hypothesis plugin sorts and shuffles each batch), so a run repeats only for
    its order: both are run, each set explicitly. In hypothesis's order the capped soak split
    a peer at epoch 5 (a healed partition's minority trusted no vouch of the majority's; see
    test_a_vouch_counts_wherever_it_is_carried)."""
    _soak_small(group, sorted_shuffle, SEED, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("sorted_shuffle", [False, True], ids=["default-order", "hypothesis-order"])
@pytest.mark.parametrize("seed", range(1, 10))
def test_soak_small_capped_seeds(
    seed: int, sorted_shuffle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The capped plan at seeds 1-9, in both scheduling orders (10-30 s each). Before issue
    46's fixes seed 8 held a peer apart after epoch 5 (alone in its group, it averaged across
    groups but named no mates, so it trusted no signer left in the run and counted itself the
    only vouched vote: test_a_peer_alone_in_its_group_names_the_representatives_it_averaged_with)
    and seed 6 ended the bootstrap at epoch 4 (behind the healed minority, it loaded the
    minority's state, its own vote left out of the choice:
    test_the_state_a_peer_behind_loads_counts_its_own_vote); after those, seed 9 (both
    orders) ended it at epoch 4 the same way, the majority's peers holding copies or
    lineages that began at their last load (test_copies_break_a_tie_between_sides_as_many_
    voters_hold and the two tests after it in test_lineage.py)."""
    _soak_small(3, sorted_shuffle, seed, monkeypatch, reports_checked=False)


def _soak_small(
    group: int,
    sorted_shuffle: bool,
    seed: int,
    monkeypatch: pytest.MonkeyPatch,
    *,
    reports_checked: bool = True,
) -> None:
    """The plan at ``seed``: the soak's check, the joiners' loads and (``reports_checked``)
    the figures reported as the run goes. Those hold for seed 0; at other seeds the bootstrap
    may report an epoch twice (it averaged it again after a step whose lineage lost), and a
    row that settles after a report may add a version inside the partition's window."""
    monkeypatch.setattr(trio._core._run, "_ALLOW_DETERMINISTIC_SCHEDULING", sorted_shuffle)
    plan = SoakPlan(
        peers=6,
        joiners=2,
        epochs=6,
        graceful_leavers=1,
        killed=1,
        slow=1,
        partition=2,
        max_group_size=group,
        seed=seed,
    )
    reports: list[tuple[int, dict]] = []

    def report(epoch: int, logs: list, events: dict) -> None:
        reports.append((epoch, partial_figures(plan, logs, events)))

    logs, events = run_soak(plan, report)
    final = check_soak(plan, logs, events)
    # Each joiner's keep_in_step loaded the run's state at its first call (it joined after
    # epoch 0 and began at the run's epoch, not at 0).
    joiners = logs[plan.peers :]
    assert all(log.keeper.loads >= 1 and (log.joined_at or 0) > 0 for log in joiners)
    assert final["state_loads"] == sum(log.keeper.loads for log in logs)
    if not reports_checked:
        return
    assert [e for e, _ in reports] == list(range(1, plan.epochs + 1))
    times = [r["virtual_seconds"] for _, r in reports]
    assert times == sorted(times) and times[0] > 0
    for epoch, r in reports:
        assert r["epochs"] == epoch and r["params_apart"] == []
        assert r["params_agreed"] <= final["params_agreed"]
        assert r["state_loads"] <= final["state_loads"]
    assert reports[-1][1]["params_agreed"] >= final["params_agreed"] - 1


def test_each_grouped_row_names_the_group_it_averaged_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """With matchmaking ahead of the target a group forms in ``join_group``, not
    ``form_group``, which the soak used to watch for its specs: every grouped row then named no
    group, and at the partition's first epoch the two sides' groups (each holding its own
    average) counted as one group with two averages (``test_soak_small[one-group]``'s
    "divergent averages at epochs [2]"). Each row names the group the round averaged in."""
    monkeypatch.setattr(trio._core._run, "_ALLOW_DETERMINISTIC_SCHEDULING", False)
    plan = SoakPlan(
        peers=4,
        joiners=0,
        epochs=3,
        graceful_leavers=0,
        killed=0,
        slow=0,
        partition=2,
        size=64,
        match_early=True,
    )
    logs, _ = run_soak(plan)
    rows = [(i, r) for i, log in enumerate(logs) for r in log.rows if r["group"] > 1]
    assert rows and all(r["digest"] is not None for _, r in rows)
    members: dict[tuple[int, bytes], set[int]] = {}
    for i, r in rows:
        members.setdefault((r["epoch"], r["digest"]), set()).add(i)
    # every member of a group (nobody leaves here) names it, and a peer is in one group an epoch
    sizes = {(r["epoch"], r["digest"]): r["group"] for _, r in rows}
    assert all(len(members[k]) == n for k, n in sizes.items()), (members, sizes)
    # the partition's sides averaged apart at some epoch: two groups, two averages
    split = [e for e in {e for e, _ in members} if sum(k[0] == e for k in members) > 1]
    assert split, members


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_soak_200_peers() -> None:
    """The plan of ``python -m bench.soak --peers 200 --epochs 20``: groups of at most 16
    (averaged across groups every epoch), 20 joiners, 10 graceful leavers, 10 killed, 40
    partitioned, 20 slow. A run repeats exactly for its seed, so a failure can be replayed
    with ``plan_for(..., seed=S)``. At 0124875 seeds 0, 1 and 2 passed; seed 0 passes at
    620889b, seed 1 at 7df79e2 and seed 2 at c3419ec (versions differ only while the
    partition lasts; 0 divergences, 0 NaN). Seed 2 failed before 0124875 after epoch 17: a
    slow peer that heard from no holder for 30 s let its progress table lapse, took itself
    for the only peer left and kept its own parameters. The 200-epoch plan (``python -m
    bench.soak``, seed 0) passed its check at 09ce8a4: 12,437 s of wall time, 3,189 virtual
    s, 0 divergences, parameters apart only inside the partition's window (66-104)."""
    plan = plan_for(200, 20, group=16, size=1000, seed=0)
    logs, events = run_soak(plan)
    check_soak(plan, logs, events)


def test_a_row_whose_peer_went_back_an_epoch_names_no_parameters() -> None:
    """A row of epoch ``e`` names the parameters its peer trains ``e + 1`` on. A peer of a
    healed partition's minority that stepped ``e`` apart, lost and loaded the majority's state
    of ``e`` trains ``e`` again: its row named that state, which no other row of ``e`` holds
    (capped seed 6, both orders: "parameters apart after epochs [5]", masked on main by the
    joiners' check before it). Like a peer that fell behind, it names none."""
    from bench.soak import Log, settle

    for keeper_epoch, named in [(6, True), (5, False), (7, False)]:
        log = Log()
        log.rows.append({"epoch": 5, "settled": False, "params": None})
        log.keeper.epoch, log.keeper.checked = keeper_epoch, True
        settle(log, np.zeros(3, np.float32))
        assert log.rows[-1]["settled"] and (log.rows[-1]["params"] is not None) == named


def test_dht_closing_during_a_value_lookup_does_not_crash() -> None:
    from p2p.dht import open_dht
    from p2p.dht.records import Record, pack_value
    from p2p.dht.traverse import LookupResult
    from p2p.testing import open_sim_nodes

    async def main() -> None:
        net = SimNetwork(seed=0)
        answered = trio.Event()
        async with (
            open_sim_nodes(net, 1, config=NodeConfig.testing()) as (node,),
            trio.open_nursery() as outer,
        ):
            async with open_dht(node, config=DHTConfig.fast()) as dht:
                record = Record("k", None, pack_value(1), dht.now() + 60, None)

                async def lookup_answered_as_the_dht_closes(*args, **kwargs):
                    await answered.wait()
                    return LookupResult([], records={node.peer_id: [record]})

                dht.find_nearest = lookup_answered_as_the_dht_closes
                outer.start_soon(dht.get, "k")
                await trio.sleep(1)
                answered.set()  # the lookup's answer arrives just as the DHT closes
            outer.cancel_scope.cancel()

    try:
        run_sim(main)
    except BaseExceptionGroup as group:  # unwrap what escaped the nurseries
        leaves = []
        stack = [group]
        while stack:
            g = stack.pop()
            for e in g.exceptions:
                (stack if isinstance(e, BaseExceptionGroup) else leaves).append(e)
        raise leaves[0] from None
