"""A hostile matchmaking leader, or Sybils that claim one refused them, among honest peers (the
simulator, matchmaking only): in how many epochs are all the honest peers in one group?

Each scenario runs ``--epochs`` epochs of real matchmaking (DHT registrations, joins, the
members' questions) under a window of 1 s; every peer expects the honest others at every epoch.

* ``clean``: five honest peers (the baseline: epochs grouped, seconds to form).
* ``leader_takes_half``: peer 0 of five takes peers 1 and 2 (half of the four honest ones),
  forms as soon as they joined and refuses the other two as "group already formed".
* ``leader_takes_one_holds``: peer 0 of four takes peer 1, refuses the other two at once, and
  holds peer 1's join for 3 windows before it forms.
* ``leader_takes_all_but_one``: peer 0 of five takes three honest peers and refuses the fourth.
* ``sybil_refusals``: four honest peers and four Sybils (fresh identities that never averaged
  with the run): the Sybils register in time, serve no join, and tell every member that asks
  that the honest leader refused them.

A row: ``grouped_epochs`` (epochs in which every honest peer held one spec naming them all),
``hostile_led`` (epochs in which the hostile peer ranked first; Sybils: an honest peer did),
``grouped_when_led``, and ``max_form_s`` (the longest an honest peer took to form its group in
an epoch, virtual seconds). Last line: one JSON object.

    python -m bench.hostile_leader [--epochs 8] [--seeds 11 1 2 3] [--scenarios ...]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import trio

from dedloc_jax.rounds.context import PeerSide
from dedloc_jax.rounds.deadlines import Deadlines
from dedloc_jax.rounds.grouping import _rank, group_seed
from dedloc_jax.rounds.wire import JOIN, LEADER, member_for
from dedloc_jax.testing import matchmakers, open_sim_dhts
from p2p.testing import SimNetwork, run_sim

SCENARIOS: dict[str, dict[str, Any]] = {
    "clean": {"n": 5, "takes": None},
    "leader_takes_half": {"n": 5, "takes": 2},
    "leader_takes_one_holds": {"n": 4, "takes": 1, "hold": 3.0},
    "leader_takes_all_but_one": {"n": 5, "takes": 3},
    "sybil_refusals": {"n": 4, "sybils": 4},
}
WINDOW = 1.0


def hostile_leader(maker: Any, accept: set[str], *, at_once: bool, hold: float = 0.0) -> None:
    """Make ``maker`` a leader that takes only the ``accept`` peers: it forms as soon as they
    joined, holding each such join ``hold`` seconds first, and answers every other join
    "group already formed", ``at_once`` or once its group formed (as an honest leader refuses
    one that came after it)."""
    real_lead = maker._lead

    async def lead(slot, me, deadlines, cap, *, expected, late=frozenset()):  # type: ignore[no-untyped-def]
        return await real_lead(
            slot, me, deadlines, cap, expected=expected & accept, late=frozenset(late) & accept
        )

    async def join(ctx: Any, request: Any) -> Any:
        slot = (request.get("epoch"), request.get("level"))
        record = maker.slots.asked(slot)
        with trio.move_on_after(30.0):
            await record.opened.wait()
        if record.leading is None or str(ctx.remote_peer) in accept:
            if record.leading is not None:
                await trio.sleep(hold)
            return await maker._handle_join(ctx, request)  # as an honest peer would
        if not at_once:
            await record.leading.formed.wait()
        return {"ok": False, "reason": "group already formed", "closed": True}

    maker._lead = lead
    maker.node.remove_handler(JOIN)
    maker.node.add_handler(JOIN, join)


def sybil(maker: Any, leader_of: Any) -> None:
    """Make ``maker`` a Sybil: it serves no join, and tells whoever asks whom it follows that
    ``leader_of(epoch)`` refused it as its group closed and that it still looks for a group."""
    me = str(maker.node.peer_id)

    async def join(ctx: Any, request: Any) -> Any:
        return {"ok": False, "reason": "not leading"}

    async def leader(ctx: Any, request: Any) -> Any:
        epoch = request.get("epoch")
        return {"decided": True, "leader": me, "grouped": False, "refused": leader_of(epoch)}

    maker.node.remove_handler(JOIN)
    maker.node.add_handler(JOIN, join)
    maker.node.remove_handler(LEADER)
    maker.node.add_handler(LEADER, leader)


def _first(ids: list[str], epoch: int) -> str:
    seed = group_seed("run", epoch)
    return min(ids, key=lambda p: (_rank(seed, p), p))


def epochs(scenario: str, seed: int, count: int = 8) -> list[dict[str, Any]]:
    """One run of ``scenario`` (see the module docstring): per epoch, whether the hostile
    peer led (``led``), each honest peer's group size (1: alone), whether the honest peers
    were all in one group, and the longest an honest peer took to form its group."""
    s = SCENARIOS[scenario]
    n, takes, sybils = s["n"], s.get("takes"), s.get("sybils", 0)

    async def main() -> list[dict[str, Any]]:
        net = SimNetwork(seed=seed)
        async with open_sim_dhts(net, n + sybils, latency=0.01) as peers:
            ids = [str(node.peer_id) for node, _ in peers]
            honest = ids[1:] if takes is not None else ids[:n]
            proven = set(ids[:n])  # the Sybils never averaged with the run
            contexts = [PeerSide(proven=proven.__contains__) for _ in ids]
            makers = matchmakers(peers, max_group_size=8, window=WINDOW, contexts=contexts)
            if takes is not None:
                hostile_leader(
                    makers[0], set(ids[1 : 1 + takes]), at_once="hold" in s, hold=s.get("hold", 0)
                )
            for i in range(n, n + sybils):
                sybil(makers[i], lambda epoch: _first(honest, epoch))
            out = []
            for epoch in range(3, 3 + count):
                specs: list[Any] = [None] * len(ids)
                took = [0.0] * len(ids)

                async def one(i: int, epoch: int = epoch, specs=specs, took=took) -> None:  # type: ignore[no-untyped-def]
                    me = member_for(ids[i], "node", 1e6, 1e6, 8.0)
                    if i >= n:  # a Sybil registers, and that is all
                        await makers[i]._register(
                            (epoch, 0), me, 0.0, set(), Deadlines(window=WINDOW)
                        )
                        return
                    others = set(ids[:n]) - {ids[i]}
                    start = trio.current_time()
                    specs[i] = await makers[i].form_group(
                        epoch, me, target=8.0 * n, expected=others
                    )
                    took[i] = trio.current_time() - start

                async with trio.open_nursery() as nursery:
                    for i in range(len(ids)):
                        nursery.start_soon(one, i)
                held = [specs[ids.index(p)] for p in honest]
                together = (
                    all(
                        h is not None and set(honest) <= {m.peer_id for m in h.members}
                        for h in held
                    )
                    and len({h.digest for h in held}) == 1
                )
                first = _first(ids, epoch)
                led = first == ids[0] if takes is not None else first in honest
                out.append(
                    {
                        "led": led if takes is not None or sybils else False,
                        "sizes": [1 if h is None else len(h.members) for h in held],
                        "together": together,
                        "took": round(max(took[ids.index(p)] for p in honest), 2),
                    }
                )
                await trio.sleep(5.0)
            return out

    return run_sim(main, seed=seed)


def row(scenario: str, seeds: list[int], count: int = 8) -> dict[str, Any]:
    """The scenario's row over ``seeds`` (see the module docstring)."""
    runs = [e for seed in seeds for e in epochs(scenario, seed, count)]
    led = [e for e in runs if e["led"]]
    return {
        "attack": scenario,
        "grouped_epochs": f"{sum(e['together'] for e in runs)}/{len(runs)}",
        "hostile_led": len(led),
        "grouped_when_led": f"{sum(e['together'] for e in led)}/{len(led)}",
        "max_form_s": max(e["took"] for e in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="*", default=[11, 1, 2, 3])
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=SCENARIOS)
    args = parser.parse_args()
    wall = time.monotonic()
    rows = [row(s, args.seeds, args.epochs) for s in args.scenarios]
    for r in rows:
        print(" ".join(f"{k}={v}" for k, v in r.items()))
    out = {"epochs": args.epochs, "seeds": args.seeds, "rows": rows}
    print(json.dumps({**out, "wall_s": round(time.monotonic() - wall, 1)}))


if __name__ == "__main__":
    main()
