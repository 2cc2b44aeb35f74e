import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dedloc_jax.averaging.errors import GroupError
from dedloc_jax.averaging.group import GroupSpec, Member
from dedloc_jax.averaging.load_balancing import equal_split, predicted_time, solve_shares
from dedloc_jax.averaging.partition import FRACTION_GRID

MBIT = 1e6 / 8


def _nodes(speeds):
    return [
        Member(f"p{i}", upload_bps=s * MBIT, download_bps=s * MBIT) for i, s in enumerate(speeds)
    ]


def test_equal_links_give_equal_shares_and_the_textbook_bound():
    members = _nodes([100] * 4)
    sol = solve_shares(members)
    assert all(abs(f - 0.25) < 1e-6 for f in sol.fractions)
    # each node moves (1 - 1/4) + 3/4 = 1.5 vectors each way
    assert sol.lower_bound(1_000_000) == pytest.approx(1.5e6 / (100 * MBIT), rel=1e-6)


def test_faster_links_get_bigger_shares_and_beat_the_equal_split():
    members = _nodes([10, 25, 50, 100, 100])
    sol = solve_shares(members)
    f = sol.fractions
    assert f[0] <= f[1] <= f[2] <= f[3] and f[3] == pytest.approx(f[4], abs=1e-6)
    assert predicted_time(members, equal_split(members), 10**6) > 1.2 * sol.lower_bound(10**6)


def test_upload_and_download_are_separate_constraints():
    # a node with a fast download but a thin upload must not reduce much: it uploads its results
    slow_up = Member("a", upload_bps=5 * MBIT, download_bps=1000 * MBIT)
    members = [slow_up, *_nodes([100, 100, 100])[1:]]
    sol = solve_shares(members)
    assert sol.fractions[0] < 0.05


def test_clients_own_nothing_aux_only_reduce_and_clients_count_in_the_bound():
    members = [
        *_nodes([100, 100]),
        Member("c", "client", upload_bps=1 * MBIT, download_bps=10 * MBIT),
        Member("x", "aux", upload_bps=100 * MBIT, download_bps=100 * MBIT),
    ]
    sol = solve_shares(members)
    assert sol.fractions[2] == 0 and sol.fractions[3] > 0
    assert sum(sol.parts) == FRACTION_GRID
    # the client must upload the whole vector over 1 Mbit/s
    assert sol.lower_bound(10**6) == pytest.approx(10**6 / MBIT, rel=1e-6)
    # ... but the others still share the reduction evenly rather than arbitrarily
    assert sol.fractions[0] == pytest.approx(sol.fractions[1], abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["node", "node", "client", "aux"]),
            st.floats(1, 1000),
            st.floats(1, 1000),
        ),
        min_size=1,
        max_size=16,
    )
)
def test_lp_optimum_is_no_worse_than_equal_split_and_deterministic(spec):
    members = [Member(f"p{i}", m, u * MBIT, d * MBIT) for i, (m, u, d) in enumerate(spec)]
    if not any(m.sends for m in members) or all(m.mode == "client" for m in members):
        with pytest.raises(GroupError):
            solve_shares(members)
        return
    sol = solve_shares(members)
    assert sol == solve_shares(members)
    assert all(f == 0 for f, m in zip(sol.fractions, members, strict=True) if m.mode == "client")
    assert math.isclose(sum(sol.fractions), 1.0)
    assert sol.lower_bound(10**6) <= predicted_time(members, equal_split(members), 10**6) * (
        1 + 1e-5
    )


def test_group_spec_canonical_bytes_digest_and_validation():
    members = tuple(_nodes([10, 20, 30])) + (Member("c", "client"),)
    spec = GroupSpec(members, b"g1")
    again = GroupSpec.from_bytes(spec.to_bytes())
    assert again == spec and again.digest == spec.digest
    assert GroupSpec(members, b"g2").digest != spec.digest
    led = spec.with_parts()
    assert led.parts == spec.share_parts() and led.digest != spec.digest
    assert GroupSpec.from_bytes(led.to_bytes()).reducers == spec.reducers
    assert spec.senders == (0, 1, 2, 3)
    with pytest.raises(GroupError):
        GroupSpec((Member("a"), Member("a")))
    with pytest.raises(GroupError):
        GroupSpec((Member("a", "client"),))
    with pytest.raises(GroupError):
        GroupSpec((Member("a", "aux"),))
    with pytest.raises(GroupError):
        GroupSpec(members, parts=(FRACTION_GRID, 0, 0, 1))
    with pytest.raises(GroupError):
        GroupSpec.from_bytes(b"\x93garbage")
    with pytest.raises(GroupError):
        Member("a", upload_bps=0)


@pytest.mark.parametrize("failing_call", [1, 2])
def test_a_failing_lp_solve_never_fails_the_round(monkeypatch, failing_call):
    """A 200-peer soak once saw HiGHS call the capped re-solve infeasible (within its
    tolerance) and the whole matchmaking crash. Now the re-solve's failure keeps the first
    optimum, and a failure of the first solve splits by link speed."""
    from dedloc_jax.averaging import load_balancing as lb

    # a thin node whose floor sets the optimum: the LP is re-solved with it frozen
    members = [Member("slow", upload_bps=1 * MBIT, download_bps=1 * MBIT), *_nodes([50, 100])]
    members.append(Member("fast", upload_bps=200 * MBIT, download_bps=200 * MBIT))
    calls = []
    real = lb._solve_lp

    def flaky(*args):
        calls.append(args[2].copy())
        if len(calls) == failing_call:
            raise lb.LoadBalancingError("load-balancing LP failed: The problem is infeasible.")
        return real(*args)

    monkeypatch.setattr(lb, "_solve_lp", flaky)
    sol = solve_shares(members)
    assert len(calls) == failing_call and sum(sol.parts) == FRACTION_GRID
    assert calls[-1] == {} or failing_call == 2
    if failing_call == 1:  # by speed: the 200 Mbit/s node reduces the most
        assert sol.fractions[3] == max(sol.fractions) and sol.fractions[0] < 0.01
    else:  # the first optimum: as fast as the full solve's
        monkeypatch.setattr(lb, "_solve_lp", real)
        assert sol.lower_bound(10**6) == pytest.approx(solve_shares(members).lower_bound(10**6))


def test_a_group_bound_is_the_lp_bound_and_a_leader_spec_needs_no_lp(monkeypatch) -> None:
    import dedloc_jax.averaging.load_balancing as lb

    members = _nodes([10, 50, 200])
    lp = solve_shares(members)
    spec = GroupSpec(members, b"g").with_parts()
    assert spec.lower_bound(10**6) == pytest.approx(lp.lower_bound(10**6), rel=1e-9)

    def no_lp(*args):
        raise AssertionError("the spec carries the parts: no LP")

    monkeypatch.setattr(lb, "_solve_lp", no_lp)
    received = GroupSpec(members, b"g", parts=spec.parts)  # as a member decodes it
    assert received.lower_bound(10**6) == pytest.approx(lp.lower_bound(10**6), rel=1e-9)
    # an equal split given by the leader is slower: the bound follows the spec's parts
    third = FRACTION_GRID // 3
    equal = GroupSpec(members, b"g", parts=(third, third, FRACTION_GRID - 2 * third))
    assert equal.lower_bound(10**6) > 1.2 * lp.lower_bound(10**6)
