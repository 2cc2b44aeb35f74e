"""One hostile peer in an open run (simulator, virtual time): the lying reducer is caught and
banned, the honest peers stay in step with the honest aggregate; a ban travels through the DHT
only with evidence that convicts."""

from __future__ import annotations

import types

import msgpack
import numpy as np
import pytest
import trio

from dedloc_jax.averaging import AllReduceConfig
from dedloc_jax.averaging.reducer import Reducer
from dedloc_jax.bans import Bans, bans_key
from dedloc_jax.config import CollaborationConfig
from dedloc_jax.validators import MAX_BPS
from p2p.dht.records import owner_marker
from p2p.identity import PeerID
from p2p.testing import SimNetwork, run_sim
from tests.dedloc_jax.averaging.helpers import run_round
from tests.dedloc_jax.simcollab import open_sim_collaboration

DIM = 600
PEERS = 4
LIAR = 3


@pytest.fixture
def liar_ids(monkeypatch):
    """Peer IDs whose reducer returns -1000 x its aggregate."""
    ids: set[str] = set()
    original = Reducer._aggregate

    def lying(self, k, avg):
        original(self, k, avg)
        if self.plan.name(self.plan.me) in ids:
            avg *= np.float32(-1000.0)

    monkeypatch.setattr(Reducer, "_aggregate", lying)
    return ids


def test_lying_reducer_is_banned_within_two_rounds_and_honest_peers_keep_the_aggregate(liar_ids):
    config = CollaborationConfig.local_demo(PEERS * 8)  # an open run: robust and verified
    assert config.robust_on and config.verify_on
    truth = np.random.default_rng(0).standard_normal(DIM).astype(np.float32)
    sent = [
        [
            truth + 0.01 * np.random.default_rng([e, i]).standard_normal(DIM).astype(np.float32)
            for i in range(PEERS)
        ]
        for e in range(3)
    ]

    async def main() -> list[list[dict]]:
        net = SimNetwork(seed=5)
        logs: list[list[dict]] = [[] for _ in range(PEERS)]
        async with open_sim_collaboration(net, PEERS, config=config, latency=0.01) as cores:
            liar = str(cores[LIAR].node.peer_id)
            liar_ids.add(liar)
            # it claims the largest link the schema takes (the 1e15 is refused), so the
            # LP gives it a share to reduce
            cores[LIAR].meter.upload_override = cores[LIAR].meter.download_override = MAX_BPS

            async def peer(i: int) -> None:
                core, samples = cores[i], 0
                for epoch in range(3):
                    samples = 0
                    while True:
                        await trio.sleep(0.1)
                        samples += 8
                        if core.report(epoch, samples, 8):
                            break
                    out = await core.average(epoch, [sent[epoch][i]], samples)
                    logs[i].append(
                        {
                            "got": np.asarray(out.gradients[0]),
                            "group": out.group_size,
                            "banned": core.bans.is_banned(liar),
                        }
                    )

            async with trio.open_nursery() as nursery:
                for i in range(PEERS):
                    nursery.start_soon(peer, i)
            # the conviction is in the DHT for anyone to check
            value = await cores[0].dht.get(bans_key("run"))
            assert owner_marker(cores[0].node.peer_id) in value
        return logs

    logs = run_sim(main, seed=5)
    honest = [i for i in range(PEERS) if i != LIAR]
    first = min(e for e in range(3) if all(logs[i][e]["banned"] for i in honest))
    assert first <= 1  # banned within two rounds (here: in the round it lied)
    lied = 0
    for e in range(3):
        got = logs[honest[0]][e]["got"]
        assert all(logs[i][e]["got"].tobytes() == got.tobytes() for i in honest)  # in step
        assert np.abs(got).max() < 10  # the poison (-1000 x) reached nobody
        want_all = np.mean([sent[e][i] for i in range(PEERS)], axis=0)
        want_honest = np.mean([sent[e][i] for i in honest], axis=0)
        if e > first:
            assert all(logs[i][e]["group"] == 3 for i in honest)
            np.testing.assert_allclose(got, want_honest, rtol=1e-3, atol=1e-3)
            continue
        # while the liar is in the group, each value is the whole group's aggregate, or the
        # honest peers' where the liar's share was recomputed without it: never zero
        near_all = np.isclose(got, want_all, rtol=1e-3, atol=1e-3)
        near_honest = np.isclose(got, want_honest, rtol=1e-3, atol=1e-3)
        assert np.all(near_all | near_honest)
        assert not np.any(got == 0)
        lied += int(np.sum(~near_all))
    assert lied > 0  # some share was recomputed


def test_a_sign_flipping_sender_counts_for_nothing_and_the_honest_peers_keep_their_mean():
    """One of four sends -1000 x its gradient under the open-run defaults (CenteredClip with a
    derived radius): every round's result is the honest senders' weighted mean, bit-close, so
    the flip costs the run exactly the samples the flipper withheld (bench.byzantine, seed 0:
    loss 1.4074 x clean, the same to 7 digits as its free_rider, which sends nothing).
    CenteredClip alone (no part weighing nothing) lets the flipped part pull the centre by its
    weight times the radius at every iteration, always the same way."""
    config = CollaborationConfig.local_demo(PEERS * 8)
    assert config.robust_on and config.defence.robust_tau is None  # the radius is derived
    rng = np.random.default_rng(3)
    truth = rng.standard_normal(DIM).astype(np.float32)
    sent = [
        [truth + 0.3 * rng.standard_normal(DIM).astype(np.float32) for _ in range(PEERS)]
        for _ in range(3)
    ]

    async def main() -> list[list[tuple[np.ndarray, int]]]:
        net = SimNetwork(seed=11)
        logs: list[list[tuple[np.ndarray, int]]] = [[] for _ in range(PEERS)]
        async with open_sim_collaboration(net, PEERS, config=config, latency=0.01) as cores:

            async def peer(i: int) -> None:
                core = cores[i]
                for epoch in range(3):
                    samples = 0
                    while True:
                        await trio.sleep(0.1)
                        samples += 8
                        if core.report(epoch, samples, 8):
                            break
                    vec = sent[epoch][i] * np.float32(-1000.0 if i == LIAR else 1.0)
                    out = await core.average(epoch, [vec], samples)
                    logs[i].append((np.asarray(out.gradients[0]), samples))

            async with trio.open_nursery() as nursery:
                for i in range(PEERS):
                    nursery.start_soon(peer, i)
        return logs

    logs = run_sim(main, seed=11)
    honest = [i for i in range(PEERS) if i != LIAR]
    for e in range(3):
        got = logs[honest[0]][e][0]
        assert all(logs[i][e][0].tobytes() == got.tobytes() for i in honest)  # in step
        weights = np.array([logs[i][e][1] for i in honest], np.float64)
        want = weights @ np.array([sent[e][i] for i in honest], np.float64) / weights.sum()
        # float32 rounding only: the flipped part moved nothing (without verify.OUTLIER's
        # rule, CenteredClip alone: off by 17.1 on a mean of norm 24.5)
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


class _MemoryDHT:
    """The part of the DHT a Bans uses: signed subkeys kept in memory."""

    def __init__(self) -> None:
        self.values: dict[str, dict] = {}

    def now(self) -> float:
        return 0.0

    async def store(self, key, value, expiration, *, subkey=None, **kw) -> None:
        self.values.setdefault(key, {})[subkey] = types.SimpleNamespace(value=value)

    async def get(self, key, **kw):
        return self.values.get(key)


def _node(seed: int):
    from p2p.identity import Identity

    ident = Identity.from_seed(bytes([seed]) * 32)
    return types.SimpleNamespace(peer_id=ident.peer_id, identity=ident)


def _accusation(liar_ids):
    _, _, names = run_round(["node"] * 4, [{"x": np.zeros(1, np.float32)}] * 4, [1.0] * 4)
    liar_ids.add(names[1])
    rng = np.random.default_rng(2)
    trees = [{"g": rng.standard_normal(120).astype(np.float32)} for _ in range(4)]
    cfg = AllReduceConfig.testing().replace(verify=True)
    outcome, _, _ = run_round(["node"] * 4, trees, [1.0] * 4, config=cfg, codec="fp16")
    (acc,) = outcome[0].accusations
    return acc, names


def test_a_ban_travels_only_with_evidence_that_convicts(liar_ids):
    acc, names = _accusation(liar_ids)
    dht = _MemoryDHT()
    accuser, reader = Bans(_node(1), dht, "run"), Bans(_node(2), dht, "run")
    accuser.convict(acc)
    assert accuser.is_banned(names[1])

    async def go() -> None:
        await accuser.publish()
        await reader.refresh(force=True)

    trio.run(go)
    assert reader.is_banned(names[1])
    assert [b["peer"] for b in reader.listing()] == [names[1]]
    assert reader.listing()[0]["verified"] and reader.listing()[0]["role"] == "reducer"

    # an accuser naming an honest peer with the same evidence, or with forged evidence, bans
    # nobody: it is only listed as an unproven report
    evidence = msgpack.unpackb(
        dht.values[bans_key("run")][owner_marker(_node(1).peer_id)].value["bans"][0]["evidence"],
        raw=False,
        strict_map_key=False,
    )
    forged = dict(evidence, encoded=bytes(len(evidence["encoded"])))
    records = [
        {"peer": names[0], "evidence": msgpack.packb(evidence)},
        {"peer": names[1], "evidence": msgpack.packb(forged)},
    ]
    liar_dht = _MemoryDHT()
    for rec in records:
        rec |= {"role": "reducer", "reason": "lied", "round": b"r", "digest": bytes(32)}
    liar_dht.values[bans_key("run")] = {
        owner_marker(PeerID.from_base58(names[3])): types.SimpleNamespace(value={"bans": records})
    }
    third = Bans(_node(3), liar_dht, "run")
    trio.run(lambda: third.refresh(force=True))
    assert not third.is_banned(names[0]) and not third.is_banned(names[1])
    assert {b["peer"] for b in third.listing()} == {names[0], names[1]}
    assert not any(b["verified"] for b in third.listing())


def test_evidence_too_large_for_a_record_is_published_without_it_and_said_so(
    liar_ids, caplog, monkeypatch
):
    """A conviction whose evidence exceeds the pieces a ban may take goes out bare, with one
    warning naming the sizes; a reader lists it unverified and bans nobody on it. (The bound
    is lowered here: the defaults never exceed it, see the next test.)"""
    import dataclasses

    import dedloc_jax.bans as bans
    from dedloc_jax.bans import MAX_PIECES, PIECE

    monkeypatch.setattr(bans, "MAX_INDEXED", MAX_PIECES + 4)
    acc, names = _accusation(liar_ids)
    pad = bytes((MAX_PIECES + 4) * PIECE)
    big = dataclasses.replace(acc, evidence=dict(acc.evidence, pad=pad))
    dht = _MemoryDHT()
    accuser, reader = Bans(_node(1), dht, "run"), Bans(_node(2), dht, "run")
    accuser.convict(big)

    async def go() -> None:
        await accuser.publish()
        accuser._dirty = True
        await accuser.publish()  # republished: logged once
        await reader.refresh(force=True)

    with caplog.at_level("WARNING", logger="dedloc_jax.bans"):
        trio.run(go)
    said = [r.getMessage() for r in caplog.records if "published without it" in r.getMessage()]
    assert len(said) == 1 and names[1] in said[0] and str(PIECE) in said[0]
    rec = dht.values[bans_key("run")][owner_marker(_node(1).peer_id)].value["bans"][0]
    assert rec["evidence"] == b""
    assert not reader.is_banned(names[1])
    assert [(b["peer"], b["verified"]) for b in reader.listing()] == [(names[1], False)]


def test_evidence_of_the_largest_default_group_and_chunk_is_published_and_verified(liar_ids):
    """A conviction in a group of ``max_group_size`` (64) at the largest default chunk
    (262,144 values) without compression carries 64 MiB of parts: over the 64 pieces a record
    lists (8 MiB), it went out bare and nobody else banned on it. It goes through an index
    piece now, every stored value within the DHT's limit, and a reader that was not there
    fetches 64 pieces a read and bans the liar once it holds the whole evidence."""
    import dataclasses

    from dedloc_jax.bans import MAX_INDEXED, MAX_PIECES, PIECE

    acc, names = _accusation(liar_ids)  # a real conviction, of a small round
    # Grown to the size of one from the largest group at the largest chunk: a part of 4 bytes
    # a value from each member, their statements, and the result.
    chunk = AllReduceConfig.loopback().chunk_elems
    members = CollaborationConfig().rounds.max_group_size
    statement = max(len(msgpack.packb(st, use_bin_type=True)) for st in acc.evidence["statements"])
    pad = bytes(members * (4 * chunk + statement) + 4 * chunk)
    big = dataclasses.replace(acc, evidence=dict(acc.evidence, pad=pad))
    dht = _ValidatingDHT()
    accuser, reader = Bans(_node(1), dht, "run"), Bans(_node(2), dht, "run")
    accuser.convict(big)
    size = len(accuser._mine[0].evidence)
    pieces = -(-size // PIECE)
    assert MAX_PIECES < pieces <= MAX_INDEXED, (size, pieces)

    async def go() -> int:
        await accuser.publish()
        for reads in range(1, pieces // MAX_PIECES + 3):
            await reader.refresh(force=True)
            if reader.is_banned(names[1]):
                return reads
        return -1

    reads = trio.run(go)
    print(f"evidence {size} bytes in {pieces} pieces; banned after {reads} reads")
    assert dht.largest <= 160 << 10
    assert reads == -(-(pieces + 1) // MAX_PIECES)  # the index, then 64 pieces a read
    assert reader.listing()[0]["verified"]


class _ValidatingDHT(_MemoryDHT):
    """Stores only what the run's schemas and the DHT's value limit let through."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = self.stores = 0

    async def store(self, key, value, expiration, *, subkey=None, **kw) -> None:
        from dedloc_jax.validators import run_validators
        from p2p.dht.config import DHTConfig
        from p2p.dht.errors import InvalidRecordError

        size = len(msgpack.packb(value, use_bin_type=True))
        if size > DHTConfig().max_value_bytes:
            raise InvalidRecordError(f"value of {size} bytes")
        for schema in run_validators("run"):
            spec, regex = getattr(schema, "spec", None), getattr(schema, "_regex", None)
            if spec is not None and regex.fullmatch(key) and spec.check(value, "value"):
                raise InvalidRecordError(spec.check(value, "value"))
        self.largest = max(self.largest, size)
        self.stores += 1
        await super().store(key, value, expiration, subkey=subkey)


def test_a_ban_at_the_largest_default_chunk_publishes_evidence_others_verify(liar_ids):
    """A chunk of 262,144 values (the loopback preset's, the largest default) from four members
    in fp16 makes ~2.6 MB of evidence, over what one record carries (160 KiB; the DHT takes
    256 KiB a value): it went out bare and nobody else could ban on it. Its pieces go under
    their own keys now, and a reader that was not there bans the liar on them."""
    _, _, names = run_round(["node"] * 4, [{"x": np.zeros(1, np.float32)}] * 4, [1.0] * 4)
    liar_ids.add(names[1])
    cfg = AllReduceConfig.loopback().replace(verify=True)
    n = 4 * cfg.chunk_elems  # one chunk per share
    rng = np.random.default_rng(4)
    trees = [{"g": rng.standard_normal(n).astype(np.float32)} for _ in range(4)]
    outcome, _, _ = run_round(["node"] * 4, trees, [1.0] * 4, config=cfg, codec="fp16")
    (acc,) = outcome[0].accusations
    dht = _ValidatingDHT()
    accuser, reader = Bans(_node(1), dht, "run"), Bans(_node(2), dht, "run")
    accuser.convict(acc)
    size = len(accuser._mine[0].evidence)
    assert size > 2 * cfg.chunk_elems * 4  # parts and result: far over one record

    async def go() -> None:
        await accuser.publish()
        stores = dht.stores
        accuser._dirty = True  # another conviction: the record again, not the pieces
        await accuser.publish()
        assert dht.stores == stores + 1
        await reader.refresh(force=True)

    trio.run(go)
    print(f"evidence {size} bytes; largest value stored {dht.largest} bytes")
    assert dht.largest <= 160 << 10
    assert reader.is_banned(names[1])
    assert reader.listing()[0]["verified"]
    # a piece altered by whoever stores it proves nothing
    third_dht = _MemoryDHT()
    third_dht.values = {
        k: {sk: types.SimpleNamespace(value=bytes(len(v.value))) for sk, v in d.items()}
        if k.startswith("run.evidence.")
        else d
        for k, d in dht.values.items()
    }
    third = Bans(_node(3), third_dht, "run")
    trio.run(lambda: third.refresh(force=True))
    assert not third.is_banned(names[1])


def test_an_equivocation_ban_travels_with_its_two_signatures(monkeypatch):
    """A reducer convicted of signing two results of one chunk is banned by its accuser and,
    from the published record's evidence alone, by a reader; the same evidence naming another
    peer bans nobody."""
    from tests.dedloc_jax.averaging.helpers import equivocate

    _, _, names = run_round(["node"] * 4, [{"x": np.zeros(1, np.float32)}] * 4, [1.0] * 4)
    eq = equivocate(monkeypatch)
    eq.name = names[1]
    rng = np.random.default_rng(2)
    trees = [{"g": rng.standard_normal(120).astype(np.float32)} for _ in range(4)]
    cfg = AllReduceConfig.testing().replace(verify=True)
    outcome, _, _ = run_round(["node"] * 4, trees, [1.0] * 4, config=cfg)
    (acc,) = outcome[0].accusations
    assert (acc.peer, acc.reason) == (names[1], "equivocation")
    dht = _MemoryDHT()
    accuser, reader = Bans(_node(1), dht, "run"), Bans(_node(2), dht, "run")
    accuser.convict(acc)

    async def go() -> None:
        await accuser.publish()
        await reader.refresh(force=True)

    trio.run(go)
    assert reader.is_banned(names[1])
    (listed,) = reader.listing()
    assert listed["verified"] and listed["role"] == "reducer"
    assert listed["reason"] == "equivocation"
    rec = dht.values[bans_key("run")][owner_marker(_node(1).peer_id)].value["bans"][0]
    framed = _MemoryDHT()
    framed.values[bans_key("run")] = {
        owner_marker(_node(1).peer_id): types.SimpleNamespace(
            value={"bans": [dict(rec, peer=names[0])]}
        )
    }
    third = Bans(_node(3), framed, "run")
    trio.run(lambda: third.refresh(force=True))
    assert not third.is_banned(names[0])
