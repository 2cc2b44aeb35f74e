"""TopK ``diloco`` peers in the simulator: the real stack all-gathers their sparse payloads.

The peers of ``test_diloco_sim`` (the library's transform, eagerly, over a
:class:`~dedloc_jax.peer.CollaborationPeer`, keeping in step) with
``compression=TopK(...)``: they end bit-identical on the outer parameters; a newcomer starts
with zero error feedback; a member whose payload is malformed is rejected (and logged) by
every other member, which still agree among themselves.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np
import optax
import trio

from dedloc_jax import TopK
from dedloc_jax.diloco import diloco
from p2p.testing import SimNetwork
from tests.dedloc_jax.simcollab import open_sim_collaboration
from tests.dedloc_jax.test_diloco_sim import CONFIG, TARGET, Peer, _assert_one_lineage, _run

CFG = TopK(density=0.25, bits=2, error_feedback=0.95, chunk=4)  # 7 values: 2 chunks, 1 each


class TopKPeer(Peer):
    def __init__(self, core: Any, seed: int) -> None:
        super().__init__(core, seed)
        # a Nesterov outer step (not TopK's default SGD), so that its state is served too
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
        self.tx = diloco(
            optax.adam(0.05), self.host, target_batch_size=TARGET, outer=outer, compression=CFG
        )
        self.state = self.tx.init(self.params)


def _train(count: int, outer_steps: int, setup: Any = None) -> list[TopKPeer]:
    async def main() -> list[TopKPeer]:
        net = SimNetwork(seed=3)
        async with open_sim_collaboration(net, count, config=CONFIG, latency=0.01) as cores:
            peers = [TopKPeer(core, seed=i) for i, core in enumerate(cores)]
            if setup is not None:
                setup(peers)
            async with trio.open_nursery() as nursery:
                for p in peers:
                    nursery.start_soon(p.train, outer_steps, peers)
            return peers

    return _run(main)


def test_topk_peers_gather_sparse_payloads_and_end_bit_identical() -> None:
    peers = _train(4, 3)
    _assert_one_lineage(peers, 3)
    assert all(h.group_size == 4 and h.complete for p in peers for h in p.core.history)
    feedback = [np.asarray(p.state.error_feedback).tobytes() for p in peers]
    assert len(set(feedback)) == 4  # each peer's own, left unsent


def test_a_malformed_payload_is_rejected_by_every_other_member(caplog) -> None:
    liar = 3

    def corrupt(peers: list[TopKPeer]) -> None:
        gather = peers[liar].core.rounds.gather
        honest = gather.gather

        async def lying(spec, cfg, data, n, weight, **kw):
            bad = b"\x00\x00\xc0\x7f" + bytes(data)[4:]  # a NaN scale, signed by the liar
            return await honest(spec, cfg, bad, n, weight, **kw)

        gather.gather = lying

    with caplog.at_level(logging.WARNING, logger="dedloc_jax.rounds.gather"):
        peers = _train(4, 2, corrupt)
    rejected = [r for r in caplog.records if "sparse payload rejected" in r.getMessage()]
    assert rejected and all("non-finite scale" in r.getMessage() for r in rejected)
    honest = peers[:liar]
    _assert_one_lineage(honest, 2)
    # the liar's payload never counts: the honest peers' rounds are incomplete without it
    assert all(not h.complete for p in honest for h in p.core.history[:1])


def test_each_payload_crosses_each_link_once(monkeypatch) -> None:
    """Between two reachable members one call moves both payloads (the lower ID asks, carrying
    its own): no member receives another's entry twice in a round. (Both used to ask each
    other, so every payload crossed twice: most of a 40-member round's bytes.)"""
    from dedloc_jax.rounds.gather import SparseGather

    received: Counter[tuple[str, str, bytes]] = Counter()
    accept = SparseGather._accept

    def counting(self, g, round_id, entry):
        if isinstance(entry, dict) and entry.get("p") != str(self.node.peer_id):
            received[(str(self.node.peer_id), entry.get("p"), round_id)] += 1
        return accept(self, g, round_id, entry)

    monkeypatch.setattr(SparseGather, "_accept", counting)
    peers = _train(4, 2)
    _assert_one_lineage(peers, 2)
    assert all(h.group_size == 4 and h.complete for p in peers for h in p.core.history)
    assert len(received) == 2 * 4 * 3  # two rounds, every member got every other's entry
    assert set(received.values()) == {1}, received
