"""Issue 46.4: Sybil announcers cannot forge the run's state (simulator).

Three honest trainers average and serve each state; then five fresh identities announce a
made-up state a few epochs ahead, all on one made-up lineage (in ``RUN.state`` and in their
progress records), replaying the honest peers' vouches. They outnumber the honest peers, so
a fork choice by announcers followed them: a newcomer downloaded the forged state and the
honest peers' fork checks told them to load it. Only a state whose peer another peer vouched
it averaged with votes now.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import numpy as np
import pytest
import trio

from dedloc_jax.config import CollaborationConfig
from dedloc_jax.progress import MAX_LINEAGE
from dedloc_jax.state.download import find_donors
from dedloc_jax.state.serving import read_announcements, state_key
from dedloc_jax.state.vouching import MAX_VOUCHES, VouchBook, sign_vouch
from dedloc_jax.tracker import progress_key
from p2p.dht import DHT, DHTClock, DHTConfig, open_dht
from p2p.dht.records import owner_marker
from p2p.errors import P2PError
from p2p.identity import Identity, PeerID
from p2p.node import NodeConfig
from p2p.testing import SimNetwork, open_sim_nodes, run_sim
from tests.dedloc_jax.simcollab import open_sim_collaboration, train_steadily

MICRO = 4
RATE = 16.0
TARGET = 96
SYBILS = 5
AHEAD = 3  # epochs the forged state claims to be ahead of the run


def _fake(epoch: int) -> bytes:
    return bytes([0xEE]) * 24 + epoch.to_bytes(8, "big")


async def _announce_forged(
    dhts: list[DHT], run_id: str, honest: Callable[[], int], nodes: Any = None
) -> None:
    """Every Sybil claims the run's epoch + AHEAD, with one made-up lineage, in both records,
    carrying whatever vouches the honest announcements carry (replayed); with ``nodes`` (the
    Sybils' own), also vouches the Sybils sign for each other (each naming all the others as
    mates it averaged with: a signature costs nothing)."""
    while True:
        epoch = honest() + AHEAD
        lineage = [_fake(epoch - k) for k in range(1, MAX_LINEAGE + 1)]
        replayed: list = []
        value = await dhts[0].get(state_key(run_id), quorum=0)
        for item in (value or {}).values() if isinstance(value, dict) else ():
            if isinstance(item.value, dict):
                replayed.extend(item.value.get("vouches", []))
        minted = [
            sign_vouch(n.identity, run_id, epoch, _fake(epoch), [str(m.peer_id) for m in nodes])
            for n in nodes or ()
        ]
        for dht in dhts:
            naming = [v.to_wire() for v in minted if str(dht.peer_id) in v.mates]
            state = {
                "epoch": epoch,
                "digest": _fake(epoch),
                "lineage": lineage,
                "addrs": [],
                "vouches": (naming + replayed)[:MAX_VOUCHES],
            }
            progress = {
                "epoch": epoch,
                "samples": 0,
                "sps": RATE,
                "time": dht.now(),
                "mode": "node",
                "state": [epoch, _fake(epoch), lineage],
            }
            for key, v in ((state_key(run_id), state), (progress_key(run_id), progress)):
                try:
                    await dht.store(key, v, dht.now() + 30.0, subkey=owner_marker(dht.peer_id))
                except P2PError:
                    pass
        await trio.sleep(0.5)


def _run(seed: int = 11, mint: bool = False) -> dict:
    config = CollaborationConfig.local_demo(TARGET)
    config = config.replace(progress=config.progress.replace(max_refresh=1.0))

    async def main() -> dict:
        net = SimNetwork(seed=seed)
        out: dict = {"served": [None] * 3, "verdicts": []}
        async with open_sim_collaboration(net, 3, config=config, latency=0.01) as cores:
            params = [np.zeros(100, np.float32) for _ in cores]

            async def train(i: int) -> None:
                await train_steadily(cores[i], i, params, micro=MICRO, rate=RATE)

            names = [f"sybil{k}" for k in range(SYBILS)] + ["newcomer"]
            async with (
                open_sim_nodes(net, SYBILS + 1, config=NodeConfig.testing(), names=names) as nodes,
                AsyncExitStack() as stack,
            ):
                dhts = [
                    await stack.enter_async_context(
                        open_dht(
                            node,
                            initial_peers=[str(cores[0].node.addrs[0])],
                            config=DHTConfig.fast(),
                            clock=DHTClock(trio.current_time),
                        )
                    )
                    for node in nodes
                ]
                fresh = (nodes[-1], dhts[-1])  # a true newcomer: it averaged with nobody
                nodes, dhts = nodes[:SYBILS], dhts[:SYBILS]
                async with trio.open_nursery() as nursery:
                    await _attack(cores, nodes if mint else None, dhts, nursery, train, out, fresh)
        return out

    return run_sim(main, seed=seed)


async def _attack(
    cores: Any, nodes: Any, dhts: Any, nursery: Any, train: Any, out: dict, fresh: Any
) -> None:
    for i in range(3):
        nursery.start_soon(train, i)
    await trio.sleep(20.0)
    out["epoch_at_attack"] = cores[0].epoch
    nursery.start_soon(_announce_forged, dhts, "run", lambda: cores[0].epoch, nodes)
    for _ in range(20):
        await trio.sleep(1.0)
        out["verdicts"].append([core.fork_verdict() for core in cores])
    # A newcomer's view: the state announcements alone, then with a table.
    newcomer = cores[2]
    announced = await read_announcements(
        newcomer.node, newcomer.dht, "run", whole=True, book=newcomer.state.book
    )
    out["announced"] = [(str(a.peer), a.epoch, getattr(a, "vouched", False)) for a in announced]
    out["sybils"] = {str(d.peer_id) for d in dhts}
    out["first"] = cores[0].node.peer_id
    out["alone"] = await find_donors(newcomer.node, newcomer.dht, "run")
    out["table"] = await find_donors(
        newcomer.node, newcomer.dht, "run", cores[2].tracker.announcements(), newcomer.state.book
    )
    # A newcomer that averaged with nobody, with only the peer it joined through as its root
    # (what open_collaboration gives it: the IDs in its initial peers' addresses).
    out["roots"] = [sorted(core.state.book._roots) for core in cores]
    out["rooted"] = await find_donors(
        newcomer.node, newcomer.dht, "run", book=VouchBook([str(cores[0].node.peer_id)])
    )
    # A true newcomer through the first peer, and one whose root is gone (a peer that left
    # the run; it reached the DHT through others): no signer traces to that root.
    gone = str(PeerID.from_public_key(Identity.generate().public_key))
    first = str(cores[0].node.peer_id)
    out["fresh"] = await find_donors(*fresh, "run", book=VouchBook([first]))
    out["orphan"] = await find_donors(*fresh, "run", book=VouchBook([gone]))
    out["chosen"] = [core.tracker.chosen_epoch for core in cores]
    out["served"] = [core.state_server.latest for core in cores]
    out["vouched"] = [getattr(core.state_server, "vouched", None) for core in cores]
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "mint", [pytest.param(False, marks=pytest.mark.slow), True], ids=["replayed", "minted"]
)
def test_sybil_announcers_of_a_forged_state_neither_lead_a_newcomer_nor_the_honest(
    mint: bool,
) -> None:
    """``minted``: the Sybils also vouch for each other; such vouches counted, and the five
    outvoted the three honest peers, until only signers with an averaging history that we
    can trace to our own mates counted."""
    out = _run(mint=mint)
    honest = {(m.epoch, m.digest) for m in out["served"]}
    newest = max(m.epoch for m in out["served"])
    sybil_epochs = {e for p, e, _ in out["announced"] if p in out["sybils"]}
    print(f"announced {out['announced']}")
    print(f"honest states {sorted(e for e, _ in honest)}; sybils at {sorted(sybil_epochs)}")
    print(f"newcomer: alone {out['alone'] and out['alone'][:2]}, with table {out['table'][:2]}")
    print(f"chosen epochs {out['chosen']}; vouched {out['vouched']}")
    print(f"epoch {out['epoch_at_attack']} at the attack, {newest} 20 s later")
    before = out["epoch_at_attack"]
    assert before >= 5
    assert newest - before >= 0.7 * before  # the run keeps stepping at its clean rate
    assert sybil_epochs and min(sybil_epochs) > newest  # the forged state is announced, ahead
    assert all(out["vouched"])  # each honest peer carries a mate's vouch
    assert not any(v for p, _, v in out["announced"] if p in out["sybils"])  # replays fail
    # A true newcomer (no book: it averaged with nobody, so no signer is traced to a mate)
    # still takes the minted vouches: the Sybils' clique looks like the run's (see
    # dedloc_jax.state.vouching). A peer of the run, with its book, does not.
    # A newcomer that traces signers to the peer it joined through is not led either.
    assert out["roots"][1:] == [[str(out["first"])]] * 2  # open_collaboration's roots
    led = (out["table"], out["rooted"], out["fresh"])
    led += () if mint else (out["alone"],)
    for found in led:
        assert found is not None
        epoch, digest, donors = found
        assert digest != _fake(epoch)
        assert not {str(d) for d in donors} & out["sybils"]
    # Its roots gone, a newcomer waits (no state) rather than follow the unvouched majority.
    assert out["orphan"] is None
    assert all(c is not None and c <= newest for c in out["chosen"])
    # No honest peer was ever told that its lineage lost (it would load the forged state).
    assert not any(v is True for row in out["verdicts"] for v in row)
