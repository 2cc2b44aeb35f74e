"""The broadcast of the mean across groups (dedloc_jax.rounds.across.broadcast), in the
simulator: every member gets the representative's values exactly, also when a reducer of the
broadcast lies in an open run."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from dedloc_jax.averaging import AllReduceConfig, AveragingService, GroupSpec, Member
from dedloc_jax.averaging.reducer import Reducer
from dedloc_jax.averaging.verify import direction
from dedloc_jax.rounds.across import broadcast
from p2p.sim import SimNetwork
from p2p.testing import open_sim_nodes, run_sim

N = 4
SIZE = 300
WEIGHTS = [37.0, 11.0, 5.0, 23.0]  # the group's samples: the broadcast must not weigh by them


def _broadcast(config: AllReduceConfig) -> tuple[list, np.ndarray, list[str]]:
    """Member 0 (the representative) broadcasts its arrays to the group; returns each
    member's result, the representative's arrays as fp16 carries them, and the members."""
    values = [np.asarray(direction(bytes(32), i * SIZE, SIZE), np.float32) * 3 for i in range(N)]
    out: list = [None] * N
    names: list[str] = []

    async def main() -> None:
        async with open_sim_nodes(SimNetwork(seed=1), N) as nodes:
            services = [AveragingService(node, config) for node in nodes]
            spec = GroupSpec(
                tuple(
                    Member(str(n.peer_id), weight=w) for n, w in zip(nodes, WEIGHTS, strict=True)
                ),
                b"g",
            )
            names.extend(m.peer_id for m in spec.members)
            for a in nodes:
                for b in nodes:
                    if a is not b:
                        a.peerstore.add_addrs(b.peer_id, b.addrs)

            async def one(i: int) -> None:
                out[i] = await broadcast(
                    services[i],
                    spec,
                    [values[i]],
                    source=i == 0,
                    codec="fp16",
                    timeout=60.0,
                    config=config,
                )

            async with trio.open_nursery() as nursery:
                for i in range(N):
                    nursery.start_soon(one, i)

    run_sim(main, seed=1)
    return out, values[0].astype(np.float16).astype(np.float32), names


def test_every_member_gets_the_representatives_values_whatever_the_groups_weights() -> None:
    out, want, _ = _broadcast(AllReduceConfig.testing())
    for r in out:
        assert r is not None and r.average[0].tobytes() == want.tobytes()


@pytest.mark.parametrize("robust", [False, True])
def test_a_reducer_lying_in_the_broadcast_of_an_open_run_is_caught(monkeypatch, robust) -> None:
    """A reducer of the broadcast returning -1000 x its share: with the run's verified
    settings every honest member convicts it and recomputes that share from the
    representative's revealed part, so all hold the representative's values (unverified, the
    poison reached every member)."""
    liar: list[str] = []
    original = Reducer._aggregate

    def lying(self, k, avg):
        original(self, k, avg)
        if self.plan.name(self.plan.me) in liar:
            avg *= np.float32(-1000.0)

    monkeypatch.setattr(Reducer, "_aggregate", lying)
    _, _, names = _broadcast(AllReduceConfig.testing())
    liar.append(names[2])
    config = AllReduceConfig.testing().replace(verify=True, robust=robust)
    out, want, _ = _broadcast(config)
    for i, r in enumerate(out):
        if i == 2:
            continue
        assert r.average[0].tobytes() == want.tobytes()
        assert [a.peer for a in r.accusations] == [names[2]]
        assert [s.recomputed for s in r.shares] == [s.owner == names[2] for s in r.shares]
