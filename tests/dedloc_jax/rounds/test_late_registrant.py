"""A late registrant gets into a round within a bounded number of epochs (the capped soak's
joiners, seed 6: see docs/decisions.md, "The capped soak's late registrant").

A newcomer that loaded the state after the others' gathering began is not in the peers they
expect, and its registration landed after their plan: it stepped alone, loaded the state, and
was late again. Two ways it stayed out, each pinned here on three matchmakers (window 1 s):

- the others never learned that it takes part (they read only registrations made before they
  planned, and read again only for peers they expected): unearned, it was not waited for at
  the next epoch either;
- its own view (a registration, or an expected peer, the others do not count) left it alone
  in its plan while the others planned it as their leader: it went alone, and they formed
  their group without it.
"""

from __future__ import annotations

import trio

from dedloc_jax.rounds.context import PeerSide
from dedloc_jax.rounds.grouping import group_seed
from dedloc_jax.rounds.plan import plan_groups
from dedloc_jax.rounds.wire import member_for
from p2p.testing import SimNetwork, run_sim, sim_identity
from tests.dedloc_jax.simcollab import matchmakers, open_sim_dhts


def _newcomer_late_at_its_first_round(epochs: int = 4) -> list[list[int]]:
    """Peers 0 and 1 are proven to each other; peer 2 never averaged. At the first epoch the
    two do not expect it (its record was not at the epoch as they began) and it registers
    0.3 s after them, after they planned; from the next epoch on they expect it and it
    registers 0.3 s late again. Per epoch: each peer's group size (1: alone)."""

    async def main() -> list[list[int]]:
        net = SimNetwork(seed=7)
        async with open_sim_dhts(net, 3, latency=0.01) as peers:
            ids = [str(node.peer_id) for node, _ in peers]
            new = ids[2]
            ctx = [PeerSide(proven=lambda p: p != new) for _ in range(2)] + [PeerSide()]
            makers = matchmakers(peers, max_group_size=8, contexts=ctx)
            out = []
            for k, epoch in enumerate(range(3, 3 + epochs)):
                sizes = [0, 0, 0]

                async def one(
                    i: int, epoch: int = epoch, first: bool = k == 0, sizes=sizes
                ) -> None:
                    me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
                    if i == 2:
                        await trio.sleep(0.3)
                    others = {p for p in ids if p != ids[i]}
                    if first and i < 2:
                        others.discard(new)
                    spec = await makers[i].form_group(epoch, me, target=24.0, expected=others)
                    sizes[i] = 1 if spec is None else len(spec.members)

                async with trio.open_nursery() as nursery:
                    for i in range(3):
                        nursery.start_soon(one, i)
                out.append(sizes)
                await trio.sleep(5.0)
            return out

    return run_sim(main, seed=7)


def test_a_newcomer_that_joined_late_once_is_waited_for_at_the_next_round() -> None:
    """Its late join (refused: the group had formed) tells the leader, and its question to
    the other member tells that one, that it takes part: both wait for it from the next round
    on. Before, only the late read of a round that expected it did, so it missed two rounds
    ([2, 2, 1] twice, then [3, 3, 3]), and in the soak, loading the state between them, it
    was never at a third in time."""
    rounds = _newcomer_late_at_its_first_round()
    assert rounds[0] == [2, 2, 1], rounds
    assert all(sizes == [3, 3, 3] for sizes in rounds[1:]), rounds


EPOCH = 17
"""An epoch whose ranks put peer 2 first in the plan of peers 0 and 1 (who read the three
registrations and expect each other and peer 2) and alone in its own (it expects two more
peers, which never register: five planned, three groups of a cap of 3)."""


def _views_that_leave_the_leader_alone() -> list[int]:
    async def main() -> list[int]:
        net = SimNetwork(seed=7)
        async with open_sim_dhts(net, 3, latency=0.01) as peers:
            ids = [str(node.peer_id) for node, _ in peers]
            ghosts = {str(sim_identity(net, i).peer_id) for i in (10, 11)}
            makers = matchmakers(peers, max_group_size=3)
            sizes = [0, 0, 0]

            async def one(i: int) -> None:
                me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
                others = {p for p in ids if p != ids[i]} | (ghosts if i == 2 else set())
                spec = await makers[i].form_group(EPOCH, me, target=24.0, expected=others)
                sizes[i] = 1 if spec is None else len(spec.members)

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
            return sizes

    return run_sim(main, seed=7)


def test_a_peer_alone_in_its_plan_leads_the_peers_that_join_it() -> None:
    """Peer 2's view (two expected peers the others do not count) sizes three groups and
    leaves it alone; peers 0 and 1 plan one group that it leads, and join it while it still
    waits for those two. Before, it went alone, and they fell back to the next in rank: a
    group of 2 and a peer alone (seed 6 of the capped soak: the joiner that loaded the state
    stepped alone again). Now it leads the joins that wait for it."""
    a, b, c, x, y = (str(sim_identity(SimNetwork(seed=7), i).peer_id) for i in (0, 1, 2, 10, 11))
    seed = group_seed("run", EPOCH)
    theirs = plan_groups(a, None, {b, c}, {}, {}, planned={a, b, c}, expected={b, c}, seed=seed,
                         cap=3, level=0)  # fmt: skip
    mine = plan_groups(c, None, {a, b}, {}, {}, planned={a, b, c, x, y}, expected={a, b, x, y},
                       seed=seed, cap=3, level=0)  # fmt: skip
    assert theirs.mine[0] == c and mine.mine == [c] and not mine.late  # the views, as said
    assert _views_that_leave_the_leader_alone() == [3, 3, 3]
