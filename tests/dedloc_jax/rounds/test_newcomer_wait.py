"""A newcomer's first round in long epochs (DiLoCo's outer steps): waited for one window.

A peer that never registered nor averaged with the run is not waited for (its progress record
costs nothing to publish). In DeDLOC's epochs of seconds that loses a newcomer one round; in
DiLoCo's outer steps of hours its first round carries hours of its computing, and a newcomer
that noticed the target a second after the others averaged alone (the 12-peer TopK stand-in
of ``bench.collaboration --mode diloco``: epoch 1 incomplete). Where a window is at most
``NEWCOMER_WAIT_SHARE`` of an epoch, the others now wait one window for it.
"""

from __future__ import annotations

import trio

from dedloc_jax.rounds.context import PeerSide
from dedloc_jax.rounds.matchmaking import register
from dedloc_jax.rounds.wire import JOIN, LEADER, group_key, member_for, member_to_wire
from p2p.testing import SimNetwork, run_sim
from tests.dedloc_jax.simcollab import matchmakers, open_sim_dhts

WINDOW = 1.0


def _rounds(
    gap: float, *, ghost: bool = False, late: float = 0.6
) -> list[tuple[list[int], list[float]]]:
    """Peers 0 and 1 (proven to each other) form groups at epochs 3 and 4, ``gap`` virtual
    seconds apart; peer 2, never seen before, registers 0.6 s after them at epoch 4 only, as
    a volunteer does (``ghost``: it only stores its registration and takes no part). Per
    epoch: each peer's group size (1: alone, 0: not in it) and how long peers 0 and 1 took."""

    async def main() -> list:
        net = SimNetwork(seed=7)
        async with open_sim_dhts(net, 3, latency=0.01) as peers:
            ids = [str(node.peer_id) for node, _ in peers]
            ctx = [PeerSide(proven=lambda p: p != ids[2]) for _ in range(2)] + [PeerSide()]
            makers = matchmakers(peers, max_group_size=8, window=WINDOW, contexts=ctx)
            if ghost:
                peers[2][0].remove_handler(JOIN)
                peers[2][0].remove_handler(LEADER)
            out = []
            for epoch in (3, 4):
                sizes, took = [0, 0, 0], [0.0, 0.0]
                joining = range(3) if epoch == 4 else range(2)

                async def one(i: int, epoch: int = epoch, sizes=sizes, took=took) -> None:
                    me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
                    if i == 2:
                        await trio.sleep(late)
                        if ghost:
                            key = group_key("run", epoch, 0)
                            ttl = makers[2].deadlines.registration_ttl
                            member = {"member": member_to_wire(me)}
                            await register(peers[2][1], peers[2][0].peer_id, key, member, ttl)
                            return
                    start = trio.current_time()
                    others = {p for p in ids if p != ids[i]}
                    spec = await makers[i].form_group(epoch, me, target=1e9, expected=others)
                    sizes[i] = 1 if spec is None else len(spec.members)
                    if i < 2:
                        took[i] = trio.current_time() - start

                async with trio.open_nursery() as nursery:
                    for i in joining:
                        nursery.start_soon(one, i)
                out.append((sizes, took))
                await trio.sleep(gap)
            return out

    return run_sim(main, seed=7)


def test_a_newcomer_a_little_late_to_its_first_long_epoch_is_grouped() -> None:
    """Epochs 200 windows apart: the newcomer, 0.6 s late at its first round, averages with
    both (it was left out, alone, before)."""
    rounds = _rounds(200.0)
    assert rounds[0][0] == [2, 2, 0], rounds
    assert rounds[1][0] == [3, 3, 3], rounds


def test_in_short_epochs_a_newcomer_is_still_not_waited_for() -> None:
    """Epochs 5 windows apart (DeDLOC's): the proven peers form their group without waiting
    for a fresh identity, in less than a window."""
    rounds = _rounds(5.0)
    sizes, took = rounds[1]
    assert sizes[:2] == [2, 2] and max(took) < WINDOW, rounds


def test_a_ghost_costs_a_long_epoch_one_window_at_most() -> None:
    """A fresh identity that only stores a registration and takes no part holds the proven
    peers' long epoch by about one window, then they average without it."""
    rounds = _rounds(200.0, ghost=True)
    sizes, took = rounds[1]
    assert sizes[:2] == [2, 2] and max(took) < 3 * WINDOW, rounds
