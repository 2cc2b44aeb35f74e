"""Issue 46.4: a newcomer whose root (the peer it joined through, e.g. a bootstrap or a
coordinator that trains nothing) is alive but announces no state loads only a state vouched
by signers its root trusts (simulator).

Three honest trainers join through an aux bootstrap and average; five Sybils then announce a
forged state ahead of the run and sign vouches for each other. Before, a newcomer whose root
announced nothing traced no signer to it and counted every announcer: the five outvoted the
three and it chose the forged state. Now it asks its root whom it trusts (the root took the
first vouched announcers it read as its anchors: trust on first use), and counts their vouches.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import numpy as np
import trio

from dedloc_jax.config import CollaborationConfig
from dedloc_jax.state.download import find_donors
from dedloc_jax.state.vouching import VouchBook
from p2p.dht import DHTClock, DHTConfig, open_dht
from p2p.node import NodeConfig
from p2p.testing import SimNetwork, open_sim_nodes, run_sim
from tests.dedloc_jax.simcollab import open_sim_collaboration, train_steadily
from tests.dedloc_jax.test_sybil_state import MICRO, RATE, SYBILS, TARGET, _announce_forged, _fake


def _run(seed: int = 13) -> dict:
    config = CollaborationConfig.local_demo(TARGET)
    config = config.replace(progress=config.progress.replace(max_refresh=1.0))

    async def main() -> dict:
        net = SimNetwork(seed=seed)
        out: dict = {}
        modes = ["aux", "node", "node", "node"]
        async with open_sim_collaboration(
            net, 4, config=config, modes=modes, latency=0.01
        ) as cores:
            root = cores[0]
            params = [np.zeros(100, np.float32) for _ in cores]

            async def train(i: int) -> None:
                await train_steadily(cores[i], i, params, micro=MICRO, rate=RATE)

            names = [f"sybil{k}" for k in range(SYBILS)] + ["early", "newcomer"]
            async with (
                open_sim_nodes(net, SYBILS + 2, config=NodeConfig.testing(), names=names) as nodes,
                AsyncExitStack() as stack,
            ):
                dhts = [
                    await stack.enter_async_context(
                        open_dht(
                            node,
                            initial_peers=[str(root.node.addrs[0])],
                            config=DHTConfig.fast(),
                            clock=DHTClock(trio.current_time),
                        )
                    )
                    for node in nodes
                ]
                rooted = str(root.node.peer_id)
                async with trio.open_nursery() as nursery:
                    for i in (1, 2, 3):
                        nursery.start_soon(train, i)
                    await trio.sleep(20.0)
                    # a newcomer before the attack: the root reads the run as it is
                    out["early"] = await find_donors(
                        nodes[-2], dhts[-2], "run", book=VouchBook([rooted])
                    )
                    nursery.start_soon(
                        _announce_forged,
                        dhts[:SYBILS],
                        "run",
                        lambda: cores[1].epoch,
                        nodes[:SYBILS],
                    )
                    await trio.sleep(10.0)
                    out["found"] = await find_donors(
                        nodes[-1], dhts[-1], "run", book=VouchBook([rooted])
                    )
                    out["served"] = [c.state_server.latest for c in cores[1:]]
                    out["root_serves"] = root.state_server.latest
                    out["sybils"] = {str(d.peer_id) for d in dhts[:SYBILS]}
                    nursery.cancel_scope.cancel()
        return out

    return run_sim(main, seed=seed)


def test_a_newcomer_whose_root_is_silent_loads_only_a_state_its_root_vouches_for() -> None:
    out = _run()
    assert out["root_serves"] is None  # the root is silent about state
    honest = {(m.epoch, m.digest) for m in out["served"]}
    for key in ("early", "found"):
        found = out[key]
        assert found is not None, key
        epoch, digest, donors = found
        assert digest != _fake(epoch), key
        assert not {str(d) for d in donors} & out["sybils"], key
    assert out["found"][0] >= min(e for e, _ in honest) - 2
