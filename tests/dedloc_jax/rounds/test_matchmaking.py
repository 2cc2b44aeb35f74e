from __future__ import annotations

import pytest
import trio

from dedloc_jax.config import CollaborationConfig
from dedloc_jax.rounds.context import PeerSide
from dedloc_jax.rounds.matchmaking import register
from dedloc_jax.rounds.wire import JOIN, LEADER, group_key, member_for, member_to_wire
from p2p.testing import SimNetwork, host_of, run_sim
from tests.dedloc_jax.simcollab import matchmakers, open_sim_dhts


def _form_all(n: int, cap: int, seed: int = 0) -> list:
    async def main() -> list:
        net = SimNetwork(seed=seed)
        config = CollaborationConfig.local_demo()
        config = config.replace(rounds=config.rounds.replace(max_group_size=cap))
        async with open_sim_dhts(net, n, latency=0.01) as peers:
            specs: list = [None] * n
            makers = matchmakers(peers, max_group_size=config.rounds.max_group_size)

            async def one(i: int) -> None:
                me = member_for(str(peers[i][0].peer_id), "node", 1e6, 1e6, 8.0)
                specs[i] = await makers[i].form_group(3, me)

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
            ids = [str(node.peer_id) for node, _ in peers]
            return list(zip(ids, specs, strict=True))

    return run_sim(main, seed=seed)


def _check_partition(results: list, cap: int) -> None:
    by_digest: dict[bytes, set[str]] = {}
    for pid, spec in results:
        assert spec is not None, f"{pid} got no group"
        members = {m.peer_id for m in spec.members}
        assert pid in members
        by_digest.setdefault(spec.digest, set()).add(pid)
    # Everyone in a group holds the same spec, and the groups partition the peers.
    all_members = [p for group in by_digest.values() for p in group]
    assert sorted(all_members) == sorted(pid for pid, _ in results)
    for digest, holders in by_digest.items():
        spec = next(s for _, s in results if s.digest == digest)
        assert holders == {m.peer_id for m in spec.members}
        assert len(spec.members) <= cap


def test_every_peer_lands_in_exactly_one_group_with_one_spec() -> None:
    _check_partition(_form_all(12, cap=5), cap=5)


def test_32_peers_with_a_cap_of_8_form_disjoint_groups() -> None:
    """Through the DHT and real matchmaking on the simulated network: four full groups.
    ~8 s of CPU (3 of them starting 32 DHT nodes); 50 peers took ~21 s, too long here."""
    _check_partition(_form_all(32, cap=8), cap=8)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_200_peers_with_a_cap_of_32_form_disjoint_groups() -> None:
    """The issue's figure: 200 peers, groups of at most 32 (seven of 28-29 here). ~145 s of
    CPU, 40 of them starting 200 DHT nodes, hence slow."""
    _check_partition(_form_all(200, cap=32), cap=32)


def test_peers_that_step_from_other_states_average_apart() -> None:
    """Two lineages of one epoch (a group whose round failed, a peer that stepped alone): a
    group mixing them would average gradients that each side applies to other parameters.
    Each peer registers the state it steps from; 4 peers on state A and 3 on state B form
    groups of one state each, and a peer that says nothing (an aux peer, a trainer that has
    not served its state yet) may join either."""
    states = [b"A" * 32] * 4 + [b"B" * 32] * 3 + [None]

    async def main() -> list:
        net = SimNetwork(seed=3)
        async with open_sim_dhts(net, len(states), latency=0.01) as peers:
            contexts = [
                PeerSide(state_of=lambda epoch, state=state: state if epoch == 3 else None)
                for state in states
            ]
            makers = matchmakers(peers, max_group_size=8, contexts=contexts)
            specs: list = [None] * len(states)

            async def one(i: int) -> None:
                me = member_for(str(peers[i][0].peer_id), "node", 1e6, 1e6, 8.0)
                specs[i] = await makers[i].form_group(3, me)

            async with trio.open_nursery() as nursery:
                for i in range(len(states)):
                    nursery.start_soon(one, i)
            return [str(node.peer_id) for node, _ in peers], specs

    ids, specs = run_sim(main, seed=3)
    groups = {}
    for pid, spec in zip(ids, specs, strict=True):
        assert spec is not None, f"{pid} got no group"
        groups.setdefault(spec.digest, {m.peer_id for m in spec.members})
    a, b = set(ids[:4]), set(ids[4:7])
    for members in groups.values():
        assert members <= a | {ids[7]} or members <= b | {ids[7]}, members
    assert a | b <= set().union(*groups.values())  # nobody left out


def test_a_leader_refuses_a_member_that_steps_from_another_state() -> None:
    """The leader's check, for a follower whose view missed that the leader is on another
    lineage: it is refused while one on the leader's state joins. No member of its group is in
    the leader's group when it asks (the leader waits for it), so the refusal counts as a gone
    leader: it falls back to the next member in rank, one of its lineage."""
    state = {0: b"A" * 32, 1: b"B" * 32, 2: b"A" * 32}

    async def lead(makers, ids, out) -> None:
        out["ids"] = ids
        me = member_for(ids[0], "node", 1e6, 1e6, 8.0)
        out["leader"] = await makers[0]._lead((5, 0), me, 1.0, 8, expected={ids[1], ids[2]})

    async def follow(makers, ids, out) -> None:
        await trio.sleep(0.1)

        async def one(i: int) -> None:
            me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
            makers[i]._choose((5, 0), ids[0])
            try:
                out[i] = await makers[i]._follow((5, 0), me, ids[0], members=ids[:3])
            except LeaderGone:
                out[i] = "gone"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 1)
            nursery.start_soon(one, 2)

    from dedloc_jax.rounds.following import LeaderGone

    contexts = [PeerSide(state_of=lambda epoch, i=i: state[i]) for i in range(3)]
    out = _two_at_once(3, 7, lambda makers, ids: None, lead, follow, contexts=contexts)
    assert out[1] == "gone"  # refused: another state, and nobody of ours is in that group
    assert out[2] is not None and out[2] == out["leader"]
    assert {m.peer_id for m in out[2].members} == {out["ids"][0], out["ids"][2]}


def test_a_lonely_peer_gets_no_group_without_hanging() -> None:
    results = _form_all(1, cap=4)
    assert results[0][1] is None


def _late_peer(leader_is_late: bool) -> tuple[float, float, object]:
    """Peer A averages an epoch alone; B registers for it after that, sees A's registration
    and puts both in one group, led by the smaller peer ID: B (``leader_is_late``) or A.
    Returns B's simulated wait, B's max_wait and B's spec."""

    async def main() -> tuple[float, float, object]:
        net = SimNetwork(seed=5)
        async with open_sim_dhts(net, 2, latency=0.01) as peers:
            ids = [str(node.peer_id) for node, _ in peers]
            first, second = sorted(ids)
            a, b = (second, first) if leader_is_late else (first, second)
            seen: set[str] = set()  # the peers B's tracker saw at the next epoch
            contexts = [
                PeerSide(moved_on=lambda peer, epoch: peer in seen and epoch < 4)
                if pid == b
                else PeerSide()
                for pid in ids
            ]
            makers = dict(
                zip(ids, matchmakers(peers, max_group_size=8, contexts=contexts), strict=True)
            )
            assert await makers[a].form_group(3, member_for(a, "node", 1e6, 1e6, 8.0)) is None
            seen.add(a)  # B's tracker has seen A's record for the next epoch.
            start = trio.current_time()
            spec = await makers[b].form_group(3, member_for(b, "node", 1e6, 1e6, 8.0), expected={a})
            return trio.current_time() - start, makers[b].max_wait, spec

    return run_sim(main, seed=5)


@pytest.mark.parametrize("leader_is_late", [True, False])
def test_a_late_peer_does_not_wait_for_one_that_averaged_the_epoch_already(
    leader_is_late: bool,
) -> None:
    """As leader it stops waiting for the member that moved on; as follower its join is
    refused at once (the leader is done with the epoch). Before, both waited ``max_wait``."""
    waited, max_wait, spec = _late_peer(leader_is_late)
    assert spec is None
    assert waited < 3.0 < max_wait  # a window (1 s) and a few DHT round trips


def test_peers_short_of_the_target_do_not_wait_once_everyone_expected_registered() -> None:
    """Both peers decided on an estimate that overshot: together they hold 16 of 100 samples.
    Registered peers accumulate nothing more, so once both are in they average what they have
    (before, each waited ``max_wait`` for samples nobody could add)."""

    async def main() -> tuple[list, float, float]:
        net = SimNetwork(seed=3)
        async with open_sim_dhts(net, 2, latency=0.01) as peers:
            makers = matchmakers(peers, max_group_size=8)
            ids = [str(node.peer_id) for node, _ in peers]
            specs: list = [None, None]

            async def one(i: int) -> None:
                me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
                specs[i] = await makers[i].form_group(2, me, target=100.0, expected={ids[1 - i]})

            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(one, i)
            return specs, trio.current_time() - start, makers[0].max_wait

    specs, waited, max_wait = run_sim(main, seed=3)
    assert all(s is not None and len(s.members) == 2 for s in specs)
    assert specs[0].digest == specs[1].digest
    assert waited < 3.0 < max_wait


def test_the_leader_tells_each_member_the_others_addresses() -> None:
    """A reader polls only some of the registry's holders, so a member may not have read
    another's registration (and addresses) before the round: the leader's answer carries the
    addresses every joiner sent, and the member can dial the whole group."""

    async def main() -> tuple[list, list[dict]]:
        net = SimNetwork(seed=5)
        async with open_sim_dhts(net, 5, latency=0.01) as peers:
            makers = matchmakers(peers, max_group_size=8)
            ids = [str(node.peer_id) for node, _ in peers]
            answers: list[dict] = []
            for node, _ in peers:
                call = node.call

                async def spy(peer, name, request, _call=call, **kwargs):
                    answer = await _call(peer, name, request, **kwargs)
                    if name == "collab.join":
                        answers.append({"me": request, "answer": answer})
                    return answer

                node.call = spy
            specs: list = [None] * len(peers)

            async def one(i: int) -> None:
                me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
                specs[i] = await makers[i].form_group(4, me, expected=set(ids) - {ids[i]})

            async with trio.open_nursery() as nursery:
                for i in range(len(peers)):
                    nursery.start_soon(one, i)
            addrs = {str(node.peer_id): sorted(str(a) for a in node.addrs) for node, _ in peers}
            return specs, [dict(a, addrs=addrs) for a in answers]

    specs, answers = run_sim(main, seed=5)
    assert all(s is not None and len(s.members) == 5 for s in specs)
    assert len(answers) == 4  # every follower joined the one leader
    leader = specs[0].members[0].peer_id
    for a in answers:
        answer, addrs = a["answer"], a["addrs"]
        me = next(p for p, listed in addrs.items() if listed == sorted(a["me"]["addrs"]))
        others = {m.peer_id for m in specs[0].members} - {me, leader}
        assert set(answer["addrs"]) == others
        for peer in others:
            assert sorted(answer["addrs"][peer]) == addrs[peer]


def test_a_leader_stops_waiting_for_a_member_that_follows_someone_else() -> None:
    """Views of the registrations differ, so a member the leader counted on may have gone to
    another leader: asked, it says so, and the leader closes at once instead of waiting
    ``member_wait``. A member still gathering registrations says it has not decided, and the
    leader keeps waiting for it."""

    async def main() -> tuple[float, float, object, list]:
        net = SimNetwork(seed=4)
        async with open_sim_dhts(net, 3, latency=0.01) as peers:
            makers = matchmakers(peers, max_group_size=8)
            ids = [str(node.peer_id) for node, _ in peers]
            me = member_for(ids[0], "node", 1e6, 1e6, 8.0)
            makers[1]._choose((5, 0), "someone-else")  # decided: follows another leader
            start = trio.current_time()
            spec = await makers[0]._lead((5, 0), me, 1.0, 8, expected={ids[1]})
            closed_after = trio.current_time() - start
            # member 2 is undecided for 2.5 s, then follows us: the leader waits for it
            specs: list = []

            async def late_member() -> None:
                await trio.sleep(2.5)
                makers[2]._choose((6, 0), ids[0])
                specs.append(
                    await makers[2]._follow(
                        (6, 0), member_for(ids[2], "node", 1e6, 1e6, 8.0), ids[0]
                    )
                )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(late_member)
                specs.append(await makers[0]._lead((6, 0), me, 1.0, 8, expected={ids[2]}))
            return closed_after, makers[0].member_wait, spec, specs

    closed_after, member_wait, spec, specs = run_sim(main, seed=4)
    assert spec is None  # nobody joined
    assert closed_after < 1.5 < member_wait, (closed_after, member_wait)
    assert len(specs) == 2 and all(s is not None and len(s.members) == 2 for s in specs)
    assert specs[0].digest == specs[1].digest


def test_a_peer_the_collaboration_left_behind_stops_looking_for_a_group_at_once() -> None:
    """Everyone else averaged the epoch and moved on (the tracker's estimate is newer) and
    nobody it expects is still at it: no group can form, so it goes alone after one poll
    instead of waiting out the windows (which made a late joiner late for the next epoch too).
    With a member still expected at the epoch, it keeps waiting for it."""

    async def main() -> tuple[float, float, float]:
        net = SimNetwork(seed=6)
        async with open_sim_dhts(net, 2, latency=0.01) as peers:
            ids = [str(node.peer_id) for node, _ in peers]
            contexts = [PeerSide(epoch_over=lambda epoch: epoch < 4), PeerSide()]
            makers = matchmakers(peers, max_group_size=8, contexts=contexts)
            late = makers[0]
            me = member_for(ids[0], "node", 1e6, 1e6, 8.0)
            start = trio.current_time()
            assert await late.form_group(3, me, target=64.0) is None
            alone = trio.current_time() - start
            # An expected peer still at epoch 3 (it has not moved on): keep waiting for it.
            start = trio.current_time()
            assert await late.form_group(3, me, target=64.0, expected={ids[1]}) is None
            return alone, trio.current_time() - start, late.window

    alone, waiting, window = run_sim(main, seed=6)
    assert alone < window / 4  # it does not even register (it waited 2 windows before)
    assert waiting >= 2 * window  # the expected peer's two windows


def _two_at_once(n: int, seed: int, setup, first, second, *, contexts=None) -> dict:
    """``n`` matchmakers that know each other's addresses (with ``contexts``, see
    :func:`matchmakers`): ``setup(makers, ids)``, then
    ``first`` and ``second`` (each ``async (makers, ids, out)``) run side by side."""

    async def main() -> dict:
        net = SimNetwork(seed=seed)
        async with open_sim_dhts(net, n, latency=0.01) as peers:
            makers = matchmakers(peers, max_group_size=8, contexts=contexts)
            ids = [str(node.peer_id) for node, _ in peers]
            for node, _ in peers:  # as after reading each other's registrations
                for other, _ in peers:
                    node.peerstore.add_addrs(other.peer_id, other.addrs)
            setup(makers, ids)
            out: dict = {}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(first, makers, ids, out)
                nursery.start_soon(second, makers, ids, out)
            return out

    return run_sim(main, seed=seed)


def test_a_follower_sent_to_a_peer_that_follows_another_is_redirected_there() -> None:
    """Views differ: a follower took peer 1 for the leader, but peer 1 saw a lower-ranked
    peer 2 and follows it. Peer 1 answers with its leader and the follower joins peer 2's
    group instead of averaging alone."""

    async def lead(makers, ids, out) -> None:
        me = member_for(ids[2], "node", 1e6, 1e6, 8.0)
        out["leader"] = await makers[2]._lead((5, 0), me, 1.0, 8, expected={ids[0]})

    async def follow(makers, ids, out) -> None:
        await trio.sleep(0.1)
        me = member_for(ids[0], "node", 1e6, 1e6, 8.0)
        out["follower"] = await makers[0]._follow((5, 0), me, ids[1])

    def setup(makers, ids) -> None:
        makers[1]._choose((5, 0), ids[2])  # peer 1 follows peer 2

    out = _two_at_once(3, 5, setup, lead, follow)
    assert out["follower"] is not None and out["follower"] == out["leader"]
    assert len(out["follower"].members) == 2  # peers 2 and 0


def test_a_peer_that_registered_late_joins_the_leader_the_others_follow() -> None:
    """Peer 0 ranks first in its view but registered after the others had decided: peer 2,
    next in rank, already follows peer 1. Peer 0 joins peer 1's group instead of leading a
    second one (which nobody would join)."""

    async def lead(makers, ids, out) -> None:  # peer 1 waits for peer 3, which never comes
        me = member_for(ids[1], "node", 1e6, 1e6, 8.0)
        out["leader"] = await makers[1]._lead((5, 0), me, 1.0, 8, expected={ids[3]})

    async def late(makers, ids, out) -> None:
        await trio.sleep(0.5)
        me = member_for(ids[0], "node", 1e6, 1e6, 8.0)
        out["late"] = await makers[0]._lead_or_join((5, 0), me, [ids[0], ids[2]], 1.0, 8)

    def setup(makers, ids) -> None:
        makers[2]._choose((5, 0), ids[1])  # peer 2 follows peer 1

    out = _two_at_once(4, 6, setup, lead, late)
    assert out["late"] is not None and out["late"] == out["leader"]
    assert len(out["late"].members) == 2  # peers 1 and 0


def test_a_late_peer_joins_the_leader_a_member_behind_an_undecided_one_follows() -> None:
    """Two peers finished compiling after the other two had begun the epoch's round: peer 0
    ranks first in its view, peer 3 (next in rank) registered late as well and is undecided,
    and peer 2 (third) already follows peer 1, whose group waits for peer 3. Peer 0 joins
    peer 1's group. Before, it asked only the next in rank (undecided) and led a second group
    of the late peers: the real-process runs of bench.byzantine split 2+2 at epoch 0 so, and
    the two pairs, each vouching only for itself, never joined (here: peer 0 alone)."""

    async def lead(makers, ids, out) -> None:  # peer 1 waits for peer 3, which never comes
        me = member_for(ids[1], "node", 1e6, 1e6, 8.0)
        out["leader"] = await makers[1]._lead((5, 0), me, 1.0, 8, expected={ids[3]})

    async def late(makers, ids, out) -> None:
        await trio.sleep(0.5)
        me = member_for(ids[0], "node", 1e6, 1e6, 8.0)
        mine = [ids[0], ids[3], ids[2], ids[1]]
        out["late"] = await makers[0]._lead_or_join((5, 0), me, mine, 1.0, 8)

    def setup(makers, ids) -> None:
        makers[1]._choose((5, 0), ids[1])  # peer 1 leads
        makers[2]._choose((5, 0), ids[1])  # peer 2 follows peer 1

    out = _two_at_once(4, 6, setup, lead, late)
    assert out["late"] is not None and out["late"] == out["leader"]
    assert len(out["late"].members) == 2  # peers 1 and 0


def test_one_members_word_alone_does_not_take_a_peer_from_its_group() -> None:
    """Peer 2, third in rank, says it leads, but nobody follows it (a hostile member would
    say so in every round, to lead or strand every group it ranks in; it does not lead
    here). Peer 0, first in rank, leads its group instead of following peer 2."""

    async def late(makers, ids, out) -> None:
        me = member_for(ids[0], "node", 1e6, 1e6, 8.0)
        mine = [ids[0], ids[3], ids[2]]
        await makers[0]._lead_or_join((5, 0), me, mine, 0.5, 8)
        out["leader"], out["me"] = makers[0].slots[(5, 0)].leader, ids[0]

    async def idle(makers, ids, out) -> None:
        pass

    def setup(makers, ids) -> None:
        makers[2]._choose((5, 0), ids[2])  # peer 2 says it leads (and never does)

    out = _two_at_once(4, 6, setup, late, idle)
    assert out["leader"] == out["me"]  # it led (nobody came: its group was the others')


def test_a_peer_that_registers_after_its_group_mate_decided_still_joins_it() -> None:
    """A decides after two windows without having read B's registration (B is still
    computing). B is expected and hashes into A's group, so A leads and waits for it (bounded)
    instead of averaging alone; B, registering late, joins A. Before, A went alone and
    refused B's join ("not leading ... (alone)"), so both stepped alone."""

    async def main() -> list:
        net = SimNetwork(seed=6)
        async with open_sim_dhts(net, 2, latency=0.01) as peers:
            ids = [str(node.peer_id) for node, _ in peers]
            makers = matchmakers(peers, max_group_size=8)
            specs: list = [None, None]

            async def one(i: int, delay: float) -> None:
                await trio.sleep(delay)
                me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
                specs[i] = await makers[i].form_group(5, me, expected={ids[1 - i]})

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 0, 0.0)
                nursery.start_soon(one, 1, 2.5)  # two windows and a half late
            return specs

    specs = run_sim(main, seed=6)
    assert all(s is not None and len(s.members) == 2 for s in specs), specs
    assert specs[0].digest == specs[1].digest


def _newcomer_epochs(
    delay: float, *, runs_matchmaker: bool, join=None, epochs: int = 5, hanger: bool = False
) -> list[tuple[list[int], list[float]]]:
    """Peers 0 and 1 averaged with each other (proven to each other); peer 2 never did, and
    registers ``delay`` seconds after them at every epoch (``runs_matchmaker``: as a volunteer
    does, then joining; else it only stores its registration, a ghost, that answers joins
    with ``join``, if given; ``hanger``: with ``join(id, addrs)``'s handler, given a fourth
    peer that holds every join and registers nothing). Per epoch: each peer's group size (1:
    alone) and how long peers 0 and 1 took to form their group."""

    async def main() -> list:
        net = SimNetwork(seed=7)
        async with open_sim_dhts(net, 4 if hanger else 3, latency=0.01) as peers:
            ids = [str(node.peer_id) for node, _ in peers]
            new = ids[2]
            ctx = [PeerSide(proven=lambda p: p != new) for _ in range(2)] + [PeerSide()]
            makers = matchmakers(peers[:3], max_group_size=8, contexts=ctx)
            handler = join
            if hanger:
                peers[3][0].add_handler(JOIN, _hang)
                handler = join(ids[3], [str(a) for a in peers[3][0].addrs])
            if not runs_matchmaker:
                peers[2][0].remove_handler(JOIN)
                peers[2][0].remove_handler(LEADER)
                if handler is not None:
                    peers[2][0].add_handler(JOIN, handler)
            out = []
            for epoch in range(3, 3 + epochs):
                sizes, took = [0, 0, 0], [0.0, 0.0]

                async def one(i: int, epoch: int = epoch, sizes=sizes, took=took) -> None:
                    me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
                    if i == 2:
                        await trio.sleep(delay)
                        if not runs_matchmaker:
                            ttl = makers[2].deadlines.registration_ttl
                            key = group_key("run", epoch, 0)
                            await register(
                                peers[2][1],
                                peers[2][0].peer_id,
                                key,
                                {"member": member_to_wire(me)},
                                ttl,
                            )
                            return
                    start = trio.current_time()
                    others = {p for p in ids if p != ids[i]}
                    spec = await makers[i].form_group(epoch, me, target=24.0, expected=others)
                    sizes[i] = 1 if spec is None else len(spec.members)
                    if i < 2:
                        took[i] = trio.current_time() - start

                async with trio.open_nursery() as nursery:
                    for i in range(3):
                        nursery.start_soon(one, i)
                out.append((sizes, took))
                await trio.sleep(5.0)
            return out

    return run_sim(main, seed=7)


def test_a_newcomer_that_registered_late_once_is_grouped_from_the_next_round_on() -> None:
    """A newcomer is not waited for before it registers or averages (a fresh identity's
    progress record costs nothing), so one registering 0.3 s after two proven peers missed
    their group, and, as they read registrations only before they plan, every later one too:
    alone in 5 of 5 epochs. Now they read the slot once more after the round and wait for a
    peer that registered late and took part in the matchmaking: it misses the first round only."""
    epochs = _newcomer_epochs(0.3, runs_matchmaker=True)
    print([sizes for sizes, _ in epochs])
    assert all(sizes == [3, 3, 3] for sizes, _ in epochs[1:]), epochs


def test_a_ghost_that_registers_late_at_every_epoch_is_never_waited_for() -> None:
    """A peer that only stores a registration after the others planned, and takes no part in
    the matchmaking (it answers no question, joins no group), earns no wait: the two proven
    peers form their group at every epoch without it, in less than a window (a leader that
    planned with it would wait a window before asking it whom it follows)."""
    epochs = _newcomer_epochs(0.3, runs_matchmaker=False)
    print(epochs)
    assert all(sizes[:2] == [2, 2] and max(took) < 1.0 for sizes, took in epochs), epochs


async def _refuse(ctx, request) -> dict:
    return {"ok": False, "reason": "not today"}


async def _hang(ctx, request) -> dict:
    await trio.sleep_forever()


@pytest.mark.parametrize("join", [None, _refuse, _hang], ids=["no-join", "refuses", "hangs"])
def test_a_ghost_that_registers_in_time_and_serves_no_join_never_leaves_the_others_alone(
    join,
) -> None:
    """A peer that registers in time but serves no join (no handler, a refusal that is not a
    closed group, or no answer) and ranks first in its group left the whole group alone (no
    fallback: groups of 1 + 1 in 3 of 5 epochs, 1.4 s stalls in the others). Now its
    followers fall back to the next member in rank, as for a dead leader: the two honest
    peers group at every epoch; a ghost that held a join until the timeout is skipped as
    leader in the next epochs, and one that served nothing is not waited for as a member."""
    epochs = _newcomer_epochs(0.0, runs_matchmaker=False, join=join, epochs=8)
    print(epochs)
    assert all(sizes[:2] == [2, 2] for sizes, _ in epochs), epochs
    took = [max(t) for _, t in epochs]
    # A fallback costs a round trip, waiting for it as a member a window (then it is not
    # waited for); a join held until the timeout (31 s) happens once, then it is not tried.
    slow = [t for t in took if t >= 2.0]
    assert len(slow) == (1 if join is _hang else 0), took


@pytest.mark.parametrize(
    "answer, gone",
    [
        ({"ok": False, "reason": "group already formed", "closed": True}, False),
        ({"ok": False, "reason": "group full", "closed": True}, False),
        ({"ok": False, "reason": "not leading epoch 3 at level 0 (alone)"}, True),
        ({"ok": False}, True),
        ("junk", True),
        ({"ok": True, "spec": b"junk"}, True),
    ],
)
def test_only_a_closed_group_sends_a_follower_home_without_a_fallback(answer, gone) -> None:
    """A leader whose group closed without us (an honest race) sends us home alone, as ever,
    so followers do not split into more groups (once a member of ours confirms that the group
    formed, see the hostile leader's test); any other answer that is not a group (it leads
    nothing, a malformed answer or spec) counts as a gone leader: the follower tries the next
    member in rank."""
    from dedloc_jax.rounds.following import Joining, LeaderClosed, LeaderGone, follow

    class Node:
        addrs: list = []

        async def call(self, *args, **kwargs):
            return answer

    me = member_for("22222222222222222222222222222222", "node", 1e6, 1e6, 8.0)
    j = Joining(
        Node(),  # type: ignore[arg-type]
        (3, 0),
        me,
        PeerSide(),
        1.0,
        learn=lambda p, r: None,
        choose=lambda p: None,
        cross=lambda c: None,
    )
    if gone:
        with pytest.raises(LeaderGone):
            trio.run(follow, j, "11111111111111111111111111111111")
    else:
        with pytest.raises(LeaderClosed):
            trio.run(follow, j, "11111111111111111111111111111111")


def _late_then_in_step(first: float, then: float, epochs: int = 5) -> list[list[int]]:
    """Four peers; peers 2 and 3 finish compiling ``first`` seconds after peers 0 and 1 began
    epoch 0 (whose samples fill the target alone), then register ``then`` seconds after them
    at every later epoch (within the two windows an expected peer gets). Each peer expects the
    three others. Per epoch: each peer's group size (1: alone)."""

    async def main() -> list[list[int]]:
        net = SimNetwork(seed=8)
        async with open_sim_dhts(net, 4, latency=0.01) as peers:
            ids = [str(node.peer_id) for node, _ in peers]
            makers = matchmakers(peers, max_group_size=8)
            out = []
            for epoch in range(epochs):
                sizes = [0] * 4

                async def one(i: int, epoch: int = epoch, sizes=sizes) -> None:
                    if i >= 2:
                        await trio.sleep(first if epoch == 0 else then)
                    me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
                    others = set(ids) - {ids[i]}
                    spec = await makers[i].form_group(epoch, me, target=16.0, expected=others)
                    sizes[i] = 1 if spec is None else len(spec.members)

                async with trio.open_nursery() as nursery:
                    for i in range(4):
                        nursery.start_soon(one, i)
                out.append(sizes)
                await trio.sleep(5.0)
            return out

    return run_sim(main, seed=8)


@pytest.mark.parametrize("first", [3.0, 9.0], ids=["joined-while-waited", "after-it-formed"])
def test_peers_that_compiled_late_at_epoch_0_are_waited_for_once_they_take_part(
    first: float,
) -> None:
    """Two of four peers miss the first registration window (compiling): the others mark them
    no-shows and stop waiting for them. At 3 s the leader still waits for them and they join
    the first group; at 9 s they join after it formed, are refused and step alone. Either way
    they took part, then register 1.5 s after the others at every epoch (an expected peer
    gets two windows): they must be grouped with the others from epoch 1 on. Before, the
    no-show mark of a peer never seen registered lasted 32 epochs although it joined: they
    averaged apart at every epoch ([2, 2, 1, 1] or [2, 2, 2, 2] in two groups); then, at
    9 s, they went alone at epoch 1 too (their refused joins came after the others' late
    read), until the join or question of a peer we planned without counted as taking part."""
    epochs = _late_then_in_step(first, 1.5)
    print(epochs)
    if first < 5.0:
        assert epochs[0] == [4, 4, 4, 4], epochs
    assert all(sizes == [4, 4, 4, 4] for sizes in epochs[1:]), epochs


async def _closed(ctx, request) -> dict:
    return {"ok": False, "reason": "group already formed", "closed": True}


async def _to_stranger(ctx, request) -> dict:
    from p2p.identity import Identity

    ghost = str(Identity.from_seed(b"a ghost nobody can dial").peer_id)
    return {"ok": False, "reason": "not leading (following)", "redirect": ghost}


async def _to_itself(ctx, request) -> dict:  # a loop: it ends at the hop limit
    return {"ok": False, "reason": "not leading (following)", "redirect": str(ctx.node.peer_id)}


def _to_itself_then_hang():
    asked: set = set()

    async def join(ctx, request) -> dict:
        key = (str(ctx.remote_peer), request.get("epoch"))
        if key in asked:  # the redirect's target holds the join until the timeout
            await trio.sleep_forever()
        asked.add(key)
        return await _to_itself(ctx, request)

    return join


@pytest.mark.parametrize(
    "join, slow",
    [(_closed, 0), (_to_stranger, 0), (_to_itself, 0), (_to_itself_then_hang(), 1)],
    ids=["closed", "to-a-stranger", "to-itself", "to-itself-then-hangs"],
)
def test_a_hostile_leader_whose_refusals_lead_nowhere_never_leaves_the_others_alone(
    join, slow: int
) -> None:
    """A registered peer that ranks first and answers every join with a closed group that
    nobody is in, or with a redirect to a peer that serves no join (a stranger, a loop, a
    peer that holds the join), sent its whole group home alone in every epoch it led (groups
    of 1 + 1 in 3 of 8 epochs here). Now a closed refusal counts only when another member of
    our group says it is in that leader's group, a redirect whose target fails counts as a
    gone leader, and the followers fall back to the next member in rank; a leader whose
    refusals led nowhere in two epochs in a row is not tried again for a while, and a join
    held until the timeout happens once."""
    epochs = _newcomer_epochs(0.0, runs_matchmaker=False, join=join, epochs=8)
    print(epochs)
    assert all(sizes[:2] == [2, 2] for sizes, _ in epochs), epochs
    took = [max(t) for _, t in epochs]
    assert len([t for t in took if t >= 2.0]) == slow, took


def test_a_hostile_leader_that_redirects_to_a_peer_that_holds_joins_stalls_one_round() -> None:
    """The hostile leader sends every join to a fourth peer that holds it until the timeout:
    the first time costs the timeout (31 s) and marks that peer; after that the redirect goes
    to a peer found gone, which the followers asked the redirector about again (it would
    fall back too, if honest) and then went home alone, in every epoch it led. Now a
    redirector that keeps sending us to a peer we shun counts as gone: its followers fall
    back to the next in rank, and skip it while its refusals keep leading nowhere."""

    def join(target: str, addrs: list[str]):
        async def redirect(ctx, request) -> dict:
            return {"ok": False, "redirect": target, "redirect_addrs": addrs}

        return redirect

    epochs = _newcomer_epochs(0.0, runs_matchmaker=False, join=join, epochs=8, hanger=True)
    print(epochs)
    assert all(sizes[:2] == [2, 2] for sizes, _ in epochs), epochs
    took = [max(t) for _, t in epochs]
    assert len([t for t in took if t >= 30.0]) == 1, took  # one join timeout (31 s)
    assert max(t for t in took if t < 30.0) < 5.0, took  # (asking again: a window; the ghost
    # was expected at the first epoch, missed and was not waited for after two windows)


def test_peers_refused_by_a_group_that_formed_without_them_go_home_alone() -> None:
    """The honest race that keeps "alone" after a closed refusal: peers 0 and 1 formed their
    group, and peers 2 and 3, late, plan the same group and are refused. Peer 1 says it holds
    peer 0's spec, so both believe the refusal. Falling back to the next in rank would have
    made a group of the late two (a second group of one state forks the run)."""
    from dedloc_jax.rounds.deadlines import Deadlines

    async def formed(makers, ids, out) -> None:
        async def follower() -> None:
            await trio.sleep(0.1)
            makers[1]._choose((5, 0), ids[0])
            out[1] = await makers[1]._follow(
                (5, 0), member_for(ids[1], "node", 1e6, 1e6, 8.0), ids[0]
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(follower)
            me = member_for(ids[0], "node", 1e6, 1e6, 8.0)
            out[0] = await makers[0]._lead((5, 0), me, 1.0, 8, expected={ids[1]})

    async def late(makers, ids, out) -> None:
        await trio.sleep(1.5)

        async def one(i: int) -> None:
            me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
            mine = [ids[0], ids[2], ids[3], ids[1]]  # the late two next in rank
            out[i] = await makers[i]._lead_or_follow((5, 0), me, mine, set(), Deadlines(window=1.0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 2)
            nursery.start_soon(one, 3)

    out = _two_at_once(4, 6, lambda makers, ids: None, formed, late)
    assert out[0] is not None and out[1] == out[0] and len(out[0].members) == 2
    assert out[2] is None and out[3] is None, out


def test_the_leader_asks_an_expected_peer_that_never_registered_at_once() -> None:
    """A peer that left the run leaves its progress record behind, so the others still expect
    it: each waits two windows for its registration (it may have noticed the target late),
    and then the leader waited a third before asking it (19 s of a 40-peer epoch, blocking
    PowerSGD). Having never registered, it is asked as the leader opens: unreachable, it is
    not waited for, and the three that remain average within the gathering's two windows."""

    async def main() -> tuple[list, float, float]:
        net = SimNetwork(seed=3)
        async with open_sim_dhts(net, 4, latency=0.01) as peers:
            makers = matchmakers(peers, max_group_size=8, window=4.0)
            ids = [str(node.peer_id) for node, _ in peers]
            net.kill(host_of(net, peers[3][0]))  # left: its record still names it
            specs: list = [None] * 3

            async def one(i: int) -> None:
                me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
                expected = set(ids) - {ids[i]}
                specs[i] = await makers[i].form_group(2, me, target=24.0, expected=expected)

            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
            return specs, trio.current_time() - start, makers[0].window

    specs, waited, window = run_sim(main, seed=3)
    assert all(s is not None and len(s.members) == 3 for s in specs)
    assert len({s.digest for s in specs}) == 1
    assert waited < 2.5 * window, waited  # (three windows and more before)


def test_the_gathering_does_not_wait_for_an_expected_peer_it_cannot_reach() -> None:
    """A peer that left the run keeps its "computing" progress record, so the others expect
    it: each gathering waited its two windows for the registration, then longer for the
    samples the record claimed (5.3 s of a 40-peer epoch against 1.4 s, blocking PowerSGD).
    Asked as soon as it is one of the few still missing, it cannot be reached and is not
    waited for: the three that remain group within half a window. A slow peer that answers
    is still waited for (the test beside it)."""

    async def main() -> tuple[list, float, float]:
        net = SimNetwork(seed=3)
        async with open_sim_dhts(net, 4, latency=0.01) as peers:
            makers = matchmakers(peers, max_group_size=8, window=4.0, eager=True)
            ids = [str(node.peer_id) for node, _ in peers]
            net.kill(host_of(net, peers[3][0]))  # left: its record still names it
            specs: list = [None] * 3

            async def one(i: int) -> None:
                me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
                expected = set(ids) - {ids[i]}
                specs[i] = await makers[i].form_group(2, me, target=32.0, expected=expected)

            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
            return specs, trio.current_time() - start, makers[0].window

    specs, waited, window = run_sim(main, seed=3)
    assert all(s is not None and len(s.members) == 3 for s in specs)
    assert len({s.digest for s in specs}) == 1
    assert waited < window / 2, waited  # (two windows and more before; half a window before
    # it was asked as one of the few missing)


def test_the_gathering_waits_for_an_expected_peer_that_answers() -> None:
    """An expected peer that is reachable but registers late (a slow micro-step) still gets
    the gathering's two windows: asking it whom it follows keeps it waited for, so it is
    grouped with the others."""

    async def main() -> list:
        net = SimNetwork(seed=4)
        async with open_sim_dhts(net, 3, latency=0.01) as peers:
            makers = matchmakers(peers, max_group_size=8, window=4.0, eager=True)
            ids = [str(node.peer_id) for node, _ in peers]
            specs: list = [None] * 3

            async def one(i: int) -> None:
                if i == 2:
                    await trio.sleep(1.5 * makers[i].window)  # noticed the target late
                me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
                expected = set(ids) - {ids[i]}
                specs[i] = await makers[i].form_group(2, me, target=24.0, expected=expected)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
            return specs

    specs = run_sim(main, seed=4)
    assert all(s is not None and len(s.members) == 3 for s in specs), specs
    assert len({s.digest for s in specs}) == 1


def test_the_next_epochs_registration_key_is_looked_up_while_peers_compute() -> None:
    """Registering at the target began with a lookup of the epoch's key (0.16 of 0.24 s at 40
    simulated peers), on every peer's path through the last one to stop. Each peer looks up
    the next epoch's key as its round begins: when the target comes, its registration goes
    straight to the holders found (and its reads of the key start from them)."""
    from p2p.dht import follower_replicas

    async def main() -> list[bool]:
        net = SimNetwork(seed=5)
        async with open_sim_dhts(net, 12, latency=0.01) as peers:
            makers = matchmakers(peers, max_group_size=8, window=1.0, eager=True)
            ids = [str(node.peer_id) for node, _ in peers]

            async def one(i: int) -> None:
                me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
                await makers[i].form_group(2, me, target=24.0, expected=set(ids) - {ids[i]})

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
            await trio.sleep(5.0)  # computing toward epoch 3
            key = group_key("run", 3, 0)
            return [
                dht._recently_located(key, follower_replicas(dht.config)) is not None
                for _, dht in peers[:3]
            ]

    assert run_sim(main, seed=5) == [True, True, True]


def test_the_last_peer_to_register_reads_the_others_at_once() -> None:
    """The gathering polled the registrations every window / 8, beginning with a sleep: the
    last peer to stop, whom every other waited for, slept that long before it found them all
    registered. Its first read now comes as its gathering begins, and it groups with them."""

    async def main() -> tuple[list, float, list[float]]:
        net = SimNetwork(seed=6)
        async with open_sim_dhts(net, 3, latency=0.01) as peers:
            makers = matchmakers(peers, max_group_size=8, window=4.0, eager=True)
            ids = [str(node.peer_id) for node, _ in peers]
            last = makers[2]
            reads: list[float] = []
            began: list[float] = []
            gather, registrations = last._gather, last._registrations

            async def gathering(slot, g):  # noqa: ANN001, ANN202
                began.append(trio.current_time())
                return await gather(slot, g)

            async def read(*args, **kw):  # noqa: ANN002, ANN003, ANN202
                reads.append(trio.current_time())
                return await registrations(*args, **kw)

            last._gather, last._registrations = gathering, read
            specs: list = [None] * 3

            async def one(i: int) -> None:
                if i == 2:
                    await trio.sleep(2.0)  # stopped last
                me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
                expected = set(ids) - {ids[i]}
                specs[i] = await makers[i].form_group(2, me, target=24.0, expected=expected)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
            return specs, began[0], reads

    specs, began, reads = run_sim(main, seed=6)
    assert all(s is not None and len(s.members) == 3 for s in specs), specs
    assert reads[0] == began, (reads, began)


def test_a_computing_peer_asked_about_its_round_reads_its_table_anew() -> None:
    """A 40-peer run's slowest peer computed on 3.7 s after the median one stopped: its
    progress table still showed the others computing. The gathering peers ask it whom it
    follows (it is one of the few missing); that question now tells it that its round forms
    (its context's ``forming``: a sweep of the table), until it registers itself."""
    from dedloc_jax.rounds.context import PeerSide, context_of
    from dedloc_jax.rounds.following import ask_leader

    told: list[int] = []

    async def main() -> None:
        net = SimNetwork(seed=7)
        async with open_sim_dhts(net, 2, latency=0.01) as peers:
            contexts = [PeerSide(), PeerSide(forming=told.append)]
            makers = matchmakers(peers, max_group_size=8, window=1.0, contexts=contexts)
            other = str(peers[1][0].peer_id)
            await ask_leader(peers[0][0], (3, 0), other, 1.0)
            await ask_leader(peers[0][0], (3, 1), other, 1.0)  # (not a level-0 round)
            makers[1].slots[(4, 0)].registered = {"weight": 1.0}  # registered at epoch 4
            await ask_leader(peers[0][0], (4, 0), other, 1.0)

    run_sim(main, seed=7)
    assert told == [3]

    swept: list[str] = []

    def table(poll: float | None):
        return type(
            "Table",
            (),
            {
                "epoch": 3,
                "records": {},
                "poll": poll,  # we check mid-step (announced): a read comes before the step ends
                "proven": lambda self, p: True,
                "weightless": lambda self, p: False,
                "sweep_next_read": lambda self: swept.append("sweep"),
            },
        )()

    side = context_of(table(0.25), lambda e: None, lambda p: False, None)  # type: ignore[arg-type]
    side.forming(2)  # (past our epoch: nothing to read anew)
    side.forming(3)
    assert swept == ["sweep"]
    quiet = context_of(table(None), lambda e: None, lambda p: False, None)  # type: ignore[arg-type]
    quiet.forming(3)
    assert swept == ["sweep"]


def _partial_leader(maker, accept: set[str], *, at_once: bool, waits: bool = False):
    """Make ``maker`` a hostile leader that takes only the ``accept`` peers: it forms its group
    as soon as they joined (``waits``: as an honest leader, when every peer it expects joined
    or a wait ran out) and refuses every other join as "group already formed", once its group
    formed (as an honest leader refuses a join that came after it), or ``at_once``."""
    real_lead = maker._lead

    async def lead(slot, me, deadlines, cap, *, expected, late=frozenset()):
        return await real_lead(
            slot, me, deadlines, cap, expected=expected & accept, late=frozenset(late) & accept
        )

    async def join(ctx, request) -> dict:
        slot = (request.get("epoch"), request.get("level"))
        record = maker.slots.asked(slot)
        with trio.move_on_after(30.0):
            await record.opened.wait()
        if record.leading is None or str(ctx.remote_peer) in accept:
            return await maker._handle_join(ctx, request)  # as an honest peer would
        if not at_once:
            await record.leading.formed.wait()
        return {"ok": False, "reason": "group already formed", "closed": True}

    if not waits:
        maker._lead = lead
    maker.node.remove_handler(JOIN)
    maker.node.add_handler(JOIN, join)


def _partial_leader_epochs(
    n: int, seed: int, *, at_once: bool, waits: bool = False, epochs: int = 8
) -> list[tuple[bool, list[int], bool, float]]:
    """``n`` peers; peer 0 is a hostile leader (:func:`_partial_leader`) that takes only peer 1
    and refuses the others. Each epoch every peer expects the others. Per epoch: whether peer 0
    ranked first (led), each honest peer's group size (1: alone), whether the honest peers
    were all in one group, and the longest an honest peer took to form its group."""
    from dedloc_jax.rounds.grouping import _rank, group_seed

    async def main() -> list:
        net = SimNetwork(seed=seed)
        async with open_sim_dhts(net, n, latency=0.01) as peers:
            ids = [str(node.peer_id) for node, _ in peers]
            makers = matchmakers(peers, max_group_size=8)
            _partial_leader(makers[0], {ids[1]}, at_once=at_once, waits=waits)
            out = []
            for epoch in range(3, 3 + epochs):
                specs: list = [None] * n
                took = [0.0] * n

                async def one(i: int, epoch: int = epoch, specs=specs, took=took) -> None:
                    me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
                    others = set(ids) - {ids[i]}
                    start = trio.current_time()
                    specs[i] = await makers[i].form_group(
                        epoch, me, target=8.0 * n, expected=others
                    )
                    took[i] = trio.current_time() - start

                async with trio.open_nursery() as nursery:
                    for i in range(n):
                        nursery.start_soon(one, i)
                honest = set(ids[1:])
                held = [specs[i] for i in range(1, n)]
                together = (
                    all(s is not None and honest <= {m.peer_id for m in s.members} for s in held)
                    and len({s.digest for s in held}) == 1
                )
                seed_ = group_seed("run", epoch)
                led = min(ids, key=lambda p: (_rank(seed_, p), p)) == ids[0]
                sizes = [1 if s is None else len(s.members) for s in held]
                out.append((led, sizes, together, round(max(took[1:]), 2)))
                await trio.sleep(5.0)
            return out

    return run_sim(main, seed=seed)


@pytest.mark.parametrize(
    "n, at_once, waits",
    [(4, False, False), (5, False, False), (4, True, False), (4, True, True)],
    ids=["after-it-formed", "after-it-formed-of-5", "at-once", "at-once-then-waits"],
)
def test_a_leader_that_takes_one_peer_and_refuses_the_others_does_not_split_them(
    n: int, at_once: bool, waits: bool
) -> None:
    """A hostile peer that ranks first takes one honest follower and refuses the others as
    "group already formed". The one it took said it held the leader's spec, so the refusal
    looked like an honest race: in every epoch it led (3 of 8 here), the honest peers split
    into the pair it took and peers that went home alone ([2, 1, 1]), or, when it formed
    late, a second group of the refused ones ([2, 2, 2]: two lineages). Now the peer it took
    asks the planned members its spec left out: more of them say it refused them than it
    took, so it leaves, and the honest peers form one group without the hostile leader."""
    epochs = _partial_leader_epochs(n, 11, at_once=at_once, waits=waits)
    print(epochs)
    assert any(led for led, *_ in epochs), epochs  # (else the test shows nothing)
    assert all(together for _, _, together, _ in epochs), epochs


@pytest.mark.parametrize(
    "spec_holds, answers, leaves",
    [
        # the leader took us and refused two of our group that still look for one: a split
        (1, {"B": "refused", "C": "refused"}, True),
        (1, {"B": "joining", "C": "refused"}, True),
        # one of them went home alone, or follows another leader: not a split of ours
        (1, {"B": "refused", "C": "alone"}, False),
        (1, {"B": "refused", "C": "elsewhere"}, False),
        # it took two of us: a lone member saying it was refused does not take us away
        (2, {"C": "refused"}, False),
        (3, {"D": "refused"}, False),
        # it took half of us and refused the other half: two witnesses outweigh its word
        (2, {"C": "refused", "D": "refused"}, True),
        (3, {"D": "refused", "E": "refused"}, True),
        # not more than it took, nor more than a third of our group
        (4, {"E": "refused", "F": "refused"}, False),
        # claimants that never averaged with the run (Sybils) count for nothing
        (1, {"S1": "refused", "S2": "refused", "S3": "refused"}, False),
    ],
)
def test_a_follower_leaves_a_leader_only_when_more_of_its_group_say_it_refused_them_than_it_took(
    spec_holds: int, answers: dict, leaves: bool
) -> None:
    """The rule of :meth:`Matchmaker._split`, on the answers of the planned members that the
    leader's spec left out: at least two proven members, more than it took or more than a
    third of our group. On main, a leader that took two and refused two was believed, and
    three Sybils outweighed one member taken."""
    from dedloc_jax.averaging.group import GroupSpec
    from dedloc_jax.rounds.matchmaking import Matchmaker

    said = {
        "refused": {"decided": True, "leader": "Y", "grouped": False, "refused": "H"},
        "joining": {"decided": True, "leader": "H", "grouped": False},
        "alone": {"decided": True, "leader": None, "grouped": False, "refused": "H"},
        "elsewhere": {"decided": True, "leader": "X", "grouped": True},
    }
    mm = object.__new__(Matchmaker)
    mm.context = PeerSide(proven=lambda peer: not peer.startswith("S"))

    async def ask(slot, peer, timeout):
        return said[answers[peer]]

    mm._ask_leader = ask
    inside = ["H", "me", "A", "B", "C"][: 1 + spec_holds]  # the leader, us, whom else it took
    members = inside + sorted(answers)  # our planned group
    spec = GroupSpec(tuple(member_for(p, "node", 1e6, 1e6, 8.0) for p in inside))
    assert trio.run(mm._split, (3, 0), spec, "H", members, 1.0) is leaves


@pytest.mark.parametrize(
    "scenario",
    ["leader_takes_half", "leader_takes_one_holds", "sybil_refusals"],
)
def test_a_hostile_leader_or_sybil_claims_do_not_split_the_honest_peers(scenario: str) -> None:
    """:mod:`bench.hostile_leader`'s scenarios, 8 epochs at seed 11. On main the honest peers
    split in every epoch the hostile leader led:

    - ``leader_takes_half``: of four honest peers it took two and refused two; the two it
      took were not more than it held, so nobody asked, and the refused went home alone;
    - ``leader_takes_one_holds``: it took one of three, refused the others at once and held
      the one it took for 3 windows: the refused gave up (one alone, or a second group)
      before that one had a spec to check;
    - ``sybil_refusals``: four Sybils, registered in time and never averaged with the run,
      told the three members an honest leader took that it refused them: more than it took,
      so every member left the honest leader (0 of 8 epochs grouped).

    Now the refused are believed when two proven members of our group say so, and are more
    than the leader took or than a third of the group (also while our join still waits);
    Sybils' words count for nothing."""
    from bench.hostile_leader import epochs

    runs = epochs(scenario, 11)
    print(runs)
    assert any(e["led"] for e in runs), runs  # (else the test shows nothing)
    assert all(e["together"] for e in runs if e["led"]), runs
