"""The sparse all-gather (:mod:`dedloc_jax.rounds.gather`) on two simulated nodes: both
members leave the round when the payloads are swapped, not one of them a retry later.

Of two reachable senders only the lower ID asks; the higher one is handed the lower's entry
by that request. It used to notice only after sleeping ``RETRY`` (1 s): in a two-volunteer
TopK DiLoCo run (tiny model, micro-steps of 25 ms) the higher-ID peer came back from every
outer step 1 s after the other, which had by then fed the whole target alone: the higher one
contributed one micro-step (4 samples) per epoch, the other 160-176.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

from dedloc_jax.averaging import GroupSpec, Member
from dedloc_jax.rounds import gather as gather_mod
from dedloc_jax.rounds.gather import SparseGather
from dedloc_jax.topk import TopK, encode, pack
from p2p.testing import SimNetwork, host_of, open_sim_nodes, run_sim

CFG = TopK(density=0.25, bits=2, error_feedback=0.95, chunk=4)
N = 16


def _registered(nodes: list, make: Any = SparseGather) -> list[SparseGather]:
    """``make(node)`` for each node, registered."""
    gathers = [make(node) for node in nodes]
    for g in gathers:
        g.register()
    return gathers


def _introduce(nodes: list) -> tuple[list[str], dict[str, int]]:
    """Every node learns every other's addresses. Returns the sorted IDs and each ID's index
    in ``nodes``."""
    for a in nodes:
        for b in nodes:
            if a is not b:
                a.peerstore.add_addrs(b.peer_id, b.addrs)
    ids = sorted(str(node.peer_id) for node in nodes)
    return ids, {str(node.peer_id): i for i, node in enumerate(nodes)}


def _spec(ids: list[str], client: str | None = None) -> GroupSpec:
    """The group of ``ids`` (sorted), all nodes but ``client``."""
    members = (Member(p, "client" if p == client else "node") for p in sorted(ids))
    return GroupSpec(tuple(members), group_id=b"g")


async def _gather(
    g: SparseGather, spec: GroupSpec, rng: np.random.Generator, timeout: float = 30.0
) -> Any:
    """``g``'s gather of N random values (drawn from ``rng``), weight 4."""
    data = pack(CFG, encode(CFG, rng.standard_normal(N).astype(np.float32)), N)
    return await g.gather(spec, CFG, data, N, 4.0, timeout=timeout)


def test_both_members_leave_the_gather_when_the_entries_are_swapped() -> None:
    async def main() -> dict[str, float]:
        net = SimNetwork(seed=0)
        async with open_sim_nodes(net, 2) as nodes:
            gathers = _registered(nodes)
            await nodes[0].connect(nodes[1].addrs[0])
            ids = [str(node.peer_id) for node in nodes]
            spec = _spec(ids)
            rng = np.random.default_rng(0)
            left: dict[str, float] = {}
            start = trio.current_time()

            async def run(i: int) -> None:
                got = await _gather(gathers[i], spec, rng)
                assert got.complete
                left[ids[i]] = trio.current_time() - start

            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(run, i)
            return left

    left = run_sim(main, timeout=60.0)
    # (virtual time: the network's latency only; before the fix the higher ID left 1 s later)
    assert max(left.values()) - min(left.values()) < gather_mod.RETRY / 4, left


def test_a_member_that_asked_leaves_when_the_last_entry_comes() -> None:
    """Three nodes; the lowest opens its gather half a second after the others. The middle
    one asked the highest, then waits for the lowest's request (which carries its entry):
    it leaves when that comes, not ``RETRY`` after its asks (its next pass). Its asks stay
    ``RETRY`` apart: waking on every entry to ask again is what 7ebcd13 did."""

    async def main() -> dict[str, float]:
        net = SimNetwork(seed=0)
        async with open_sim_nodes(net, 3, latency=0.01) as nodes:
            gathers = _registered(nodes)
            ids, by_id = _introduce(nodes)
            spec = _spec(ids)
            left: dict[str, float] = {}
            start = trio.current_time()

            async def run(peer: str) -> None:
                if peer == ids[0]:
                    await trio.sleep(0.5)
                rng = np.random.default_rng(by_id[peer])
                got = await _gather(gathers[by_id[peer]], spec, rng)
                assert got.complete
                left[peer[:6]] = trio.current_time() - start

            async with trio.open_nursery() as nursery:
                for peer in ids:
                    nursery.start_soon(run, peer)
            return left

    left = run_sim(main, timeout=60.0)
    # (virtual time: before, the two that asked left at 1.0 s, a RETRY after their asks)
    assert max(left.values()) < 0.5 + gather_mod.RETRY / 4, left


class _Counting(SparseGather):
    """Records the entries it asks each peer for that are not that peer's own (relayed)."""

    def __init__(self, node: Any, relayed: list[str]) -> None:
        super().__init__(node)
        self.relayed = relayed

    async def _ask(self, g: Any, round_id: bytes, peer: str, want: list[str], *rest: Any) -> None:
        self.relayed.extend(p for p in want if p != peer)
        await super()._ask(g, round_id, peer, want, *rest)


def test_entries_that_arrive_do_not_make_a_member_ask_relays_early() -> None:
    """Four nodes and a client that opens its gather 0.3 s after them, the lowest node 0.1 s
    after them. Every node gets the client's entry from the client itself within ``RETRY``,
    so none asks a relay for it. Waking on every entry to ask again (7ebcd13) made the
    nodes that had asked ask relays at once for the client, when its pushes were on their
    way; at 40 peers such asks went to relays that had left, which kept them ``HOLD``
    seconds (a whole pass), and one of 40 ended its round incomplete."""

    async def main() -> list[str]:
        net = SimNetwork(seed=0)
        relayed: list[str] = []
        async with open_sim_nodes(net, 5, latency=0.01) as nodes:
            gathers = _registered(nodes, lambda node: _Counting(node, relayed))
            ids, by_id = _introduce(nodes)
            client = ids[2]
            spec = _spec(ids, client)

            async def run(peer: str) -> None:
                await trio.sleep(0.3 if peer == client else 0.1 if peer == ids[0] else 0.0)
                rng = np.random.default_rng(by_id[peer])
                got = await _gather(gathers[by_id[peer]], spec, rng)
                assert got.complete

            async with trio.open_nursery() as nursery:
                for peer in ids:
                    nursery.start_soon(run, peer)
        return relayed

    assert run_sim(main, timeout=60.0) == []


@pytest.mark.parametrize("late_rank", [0, 1, 2])
def test_a_member_that_opens_late_still_gets_every_entry(late_rank: int) -> None:
    """Three nodes and a client; one node opens its gather 6 s (more than ``HOLD``) after the
    others, with a 5 s deadline. The others' first asks to it came back empty after ``HOLD``.
    It must still hold every entry: the client's through a relay that already finished its
    round, the lower nodes' from their next asks. Before, the asks that met its closed round
    counted it as holding their entries, a relay whose round had ended kept an ask ``HOLD``
    seconds (as a round never opened), and the highest node never asked a relay: at every
    rank it left incomplete."""

    async def main() -> dict[str, bool]:
        net = SimNetwork(seed=0)
        async with open_sim_nodes(net, 4, latency=0.01) as nodes:
            gathers = _registered(nodes)
            ids, by_id = _introduce(nodes)
            client = ids[1]
            late = [p for p in ids if p != client][late_rank]
            modes = {p: "client" if p == client else "node" for p in ids}
            spec = _spec(ids, client)
            complete: dict[str, bool] = {}

            async def run(peer: str) -> None:
                if peer == late:
                    await trio.sleep(gather_mod.HOLD + 1.0)
                rng = np.random.default_rng(by_id[peer])
                timeout = 5.0 if peer == late else 30.0
                got = await _gather(gathers[by_id[peer]], spec, rng, timeout=timeout)
                complete[peer] = got.complete

            async with trio.open_nursery() as nursery:
                for peer in ids:
                    nursery.start_soon(run, peer)
            return {("late " if p == late else modes[p]) + p[:6]: c for p, c in complete.items()}

    complete = run_sim(main, timeout=120.0)
    assert all(complete.values()), complete


def test_a_round_that_ended_answers_a_late_ask_at_once() -> None:
    """A member asked after its round ended (a relay asked for a client's entry by a slower
    member) answers at once with what it held. It waited ``HOLD`` for the round to open
    again, and answered nothing: the asker's pass, and often its whole deadline, went by."""

    async def main() -> tuple[float, int]:
        net = SimNetwork(seed=0)
        async with open_sim_nodes(net, 2, latency=0.01) as nodes:
            gathers = _registered(nodes)
            await nodes[0].connect(nodes[1].addrs[0])
            ids = [str(node.peer_id) for node in nodes]
            spec = _spec(ids)

            async def run(i: int) -> None:
                assert (await _gather(gathers[i], spec, np.random.default_rng(i))).complete

            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(run, i)
            asked = trio.current_time()
            request = {"r": spec.digest + b":sparse", "w": [ids[0]]}
            answer = await nodes[1].call(nodes[0].peer_id, gather_mod.GATHER, request)
            return trio.current_time() - asked, len(answer["e"])

    took, entries = run_sim(main, timeout=60.0)
    assert entries == 1
    assert took < gather_mod.HOLD / 4, took  # (virtual time: the link's round trip)


def test_the_highest_node_gets_a_client_it_cannot_hear_from_through_a_relay() -> None:
    """A client that cannot reach the highest node (a partition): that node, asked by every
    other node and with no one to ask, gets the client's entry through a relay ``RETRY``
    into the round. It never asked a relay (only a second pass of asks did), and left
    incomplete."""

    async def main() -> bool:
        net = SimNetwork(seed=0)
        async with open_sim_nodes(net, 4, latency=0.01) as nodes:
            gathers = _registered(nodes)
            ids, by_id = _introduce(nodes)
            client, top = ids[0], ids[-1]
            net.partition([host_of(net, nodes[by_id[client]])], [host_of(net, nodes[by_id[top]])])
            spec = _spec(ids, client)
            complete: dict[str, bool] = {}

            async def run(peer: str) -> None:
                rng = np.random.default_rng(by_id[peer])
                got = await _gather(gathers[by_id[peer]], spec, rng, timeout=8.0)
                complete[peer] = got.complete

            async with trio.open_nursery() as nursery:
                for peer in ids:
                    nursery.start_soon(run, peer)
            return complete[top]

    assert run_sim(main, timeout=120.0)
