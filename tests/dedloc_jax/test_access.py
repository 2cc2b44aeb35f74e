"""Private collaborations: invitations, the DHT validator, the RPC guards, end to end."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from dedloc_jax.access import (
    AccessDenied,
    AccessPolicy,
    Invitation,
    InvitedWritersValidator,
    invite,
)
from dedloc_jax.averaging import GroupSpec, Member, all_reduce
from dedloc_jax.averaging.errors import AveragingError
from dedloc_jax.config import AccessConfig, CollaborationConfig
from dedloc_jax.opening import open_collaboration
from dedloc_jax.progress import PeerProgress
from dedloc_jax.rounds.wire import JOIN
from dedloc_jax.rounds.wire import member_to_wire as _member_to_wire
from dedloc_jax.state.serving import MANIFEST
from dedloc_jax.tracker import progress_key
from p2p.dht import DHTConfig, InvalidRecordError
from p2p.dht.clock import DHTClock
from p2p.dht.records import Record, owner_marker, pack_value
from p2p.dht.validation import ValidatorChain, sign_record
from p2p.errors import RPCError
from p2p.identity import Identity
from p2p.node import NodeConfig
from p2p.testing import SimNetwork, open_sim_nodes, run_sim

RUN = "private"
OWNER = Identity.from_seed(b"o" * 32)
PEER = Identity.from_seed(b"p" * 32)
STRANGER = Identity.from_seed(b"s" * 32)


def _policy(now: float = 1000.0) -> AccessPolicy:
    clock = [now]
    policy = AccessPolicy(RUN, OWNER.public_key, clock=lambda: clock[0])
    policy.now = clock  # type: ignore[attr-defined]  # the test moves time by hand
    return policy


# --- invitations ------------------------------------------------------------------------------
def test_invitation_round_trip_and_verify() -> None:
    inv = Invitation.from_bytes(invite(OWNER, RUN, PEER.peer_id, 2000.0, "client"))
    assert inv.peer_id == str(PEER.peer_id) and inv.role == "client"
    inv.verify(OWNER.public_key, PEER.peer_id, 1999.0, RUN)
    assert Invitation.from_marker("x" + owner_marker(PEER.peer_id) + inv.marker(), RUN, inv.peer_id)
    assert (
        inv.allows("client")
        and inv.allows("aux") is False
        and Invitation(RUN, "p", 1).allows("aux")
    )


@pytest.mark.parametrize(
    "case,reason",
    [
        ("expired", "expired"),
        ("other peer", "not"),
        ("other run", "run"),
        ("forged", "not signed by the run's owner"),
        ("tampered expiry", "not signed by the run's owner"),
    ],
)
def test_invitation_is_refused_with_a_precise_reason(case: str, reason: str) -> None:
    inv = Invitation(RUN, str(PEER.peer_id), 2000.0).sign(OWNER)
    peer, now, run = PEER.peer_id, 1000.0, RUN
    if case == "expired":
        now = 2000.0
    elif case == "other peer":
        peer = STRANGER.peer_id
    elif case == "other run":
        run = "another"
    elif case == "forged":
        inv = Invitation(RUN, str(PEER.peer_id), 2000.0).sign(STRANGER)
    else:
        inv = Invitation(RUN, inv.peer_id, 9e9, None, inv.signature)
    with pytest.raises(AccessDenied, match=reason):
        inv.verify(OWNER.public_key, peer, now, run)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=1200) | st.text(max_size=600))
def test_garbage_invitations_are_denied_never_crash(data: bytes | str) -> None:
    try:
        if isinstance(data, bytes):
            Invitation.from_bytes(data).verify(OWNER.public_key, PEER.peer_id, 0.0, RUN)
        else:
            inv = Invitation.from_marker(data, RUN, str(PEER.peer_id))
            if inv is not None:
                inv.verify(OWNER.public_key, PEER.peer_id, 0.0, RUN)
    except AccessDenied:
        pass


# --- the DHT validator --------------------------------------------------------------------------
def _record(writer: Identity, inv: Invitation | None, key: str = RUN + ".progress") -> Record:
    subkey = owner_marker(writer.peer_id) + (inv.marker() if inv else "")
    return sign_record(Record(key, subkey, pack_value({"epoch": 1}), 5000.0), writer)


def test_validator_admits_invited_writers_and_the_owner_only() -> None:
    policy = _policy()
    chain = ValidatorChain([InvitedWritersValidator(policy)])
    good = Invitation(RUN, str(PEER.peer_id), 2000.0).sign(OWNER)
    chain.validate(_record(PEER, good))
    assert policy.is_invited(PEER.peer_id)  # learned from the record
    chain.validate(_record(OWNER, None))
    chain.validate(Record("other-run.progress", None, pack_value(1), 5000.0))  # not ours
    refused = {
        "no invitation": _record(STRANGER, None),
        "someone else's invitation": _record(STRANGER, good),
        "forged": _record(STRANGER, Invitation(RUN, str(STRANGER.peer_id), 2000.0).sign(STRANGER)),
        "unowned": Record(RUN + ".checkpoint", None, pack_value(1), 5000.0),
    }
    for what, rec in refused.items():
        assert chain.reason(rec) is not None, what
    assert not policy.is_invited(STRANGER.peer_id)
    policy.now[0] = 2000.0  # type: ignore[attr-defined]
    with pytest.raises(InvalidRecordError, match="expired"):
        chain.validate(_record(PEER, good))
    assert not policy.is_invited(PEER.peer_id)


def test_roles_limit_the_modes_a_peer_may_join_as() -> None:
    policy = _policy()
    policy.learn(invite(OWNER, RUN, PEER.peer_id, 2000.0, "aux"), PEER.peer_id)
    policy.check(PEER.peer_id, "aux")
    with pytest.raises(AccessDenied, match="invited as aux"):
        policy.check(PEER.peer_id, "node")


# --- end to end on the simulated network --------------------------------------------------------
DIM = 64


def _grad(peer: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([peer, epoch]).normal(size=DIM).astype(np.float32)


async def _refusals(dht, peer) -> list[str]:
    """Why a progress write of ``peer`` was refused (here or by the nodes it reached)."""
    try:
        report = PeerProgress(str(peer), 9, 0, 0.0, dht.now()).to_record()  # well-formed
        res = await dht.store(progress_key(RUN), report, dht.now() + 60, subkey=owner_marker(peer))
    except InvalidRecordError as e:
        return [e.reason]
    return sorted(res.refused.values())


def test_private_run_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four invited peers train together; a stranger running the same software without an
    invitation cannot write progress, join, poison an average or download state; an invited
    peer whose invitation expires is cut off."""
    progress = CollaborationConfig.local_demo(32).progress.replace(min_refresh=0.5, max_refresh=2.0)
    base = CollaborationConfig.local_demo(32).replace(
        access=AccessConfig(owner_public_key=OWNER.public_key), progress=progress
    )
    facts: dict[str, object] = {}
    t0 = time.time()
    plain_init = DHTClock.__init__

    def virtual_clock(self: DHTClock, local_time: object = None, **kwargs: object) -> None:
        plain_init(self, lambda: t0 + trio.current_time(), **kwargs)

    # DHT time follows virtual time, so invitations expire at a known point of the simulation
    monkeypatch.setattr(DHTClock, "__init__", virtual_clock)

    async def main() -> None:
        net = SimNetwork(seed=5)
        ids = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(5)]
        async with (
            open_sim_nodes(net, 5, identities=ids, config=NodeConfig.testing()) as nodes,
            AsyncExitStack() as stack,
        ):
            expiries = [t0 + 10_000] * 3 + [t0 + 20]  # peer 3's invitation expires soon
            cores = []
            for i, node in enumerate(nodes):
                if i < 4:
                    invitation = invite(OWNER, RUN, node.peer_id, expiries[i])
                    config = base.replace(access=base.access.replace(invitation=invitation))
                else:  # the stranger: same software, no owner key, no invitation
                    config = CollaborationConfig.local_demo(32).replace(progress=progress)
                cores.append(
                    await stack.enter_async_context(
                        open_collaboration(
                            node,
                            RUN,
                            initial_peers=[str(nodes[0].addrs[0])] if i else [],
                            config=config.replace(mode="node"),
                            dht_config=DHTConfig.fast(),
                        )
                    )
                )
            honest, stranger = cores[:4], cores[4]

            # training: everybody tries, the stranger with a gradient scaled by 1e6
            results: dict[int, list[np.ndarray]] = {i: [] for i in range(5)}

            async def train(i: int) -> None:
                core = cores[i]
                for epoch in range(2):
                    samples = 0
                    while True:
                        await trio.sleep(0.4)
                        samples += 8
                        if core.report(epoch, samples, 8):
                            break
                        if trio.current_time() > 15:
                            return
                    g = _grad(i, epoch) * (1e6 if i == 4 else 1)
                    outcome = await core.average(epoch, [g], samples)
                    results[i].append((outcome.group_size, outcome.gradients[0], samples))

            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(train, i)
            facts["results"] = results
            facts["honest_records"] = [sorted(c.tracker.records) for c in honest]
            facts["names"] = [str(n.peer_id) for n in nodes]

            # the stranger's progress write is refused by the honest nodes it reached
            facts["store_refused"] = await _refusals(stranger.dht, nodes[4].peer_id)
            value = await honest[1].dht.get(progress_key(RUN))
            facts["progress_writers"] = sorted(value) if isinstance(value, dict) else []

            # direct join and state requests by the stranger are refused; invited ones work
            manifest = honest[0].state_server.set_state([np.ones(10, np.float32)], epoch=2)
            digest = manifest.digest
            join = {
                "epoch": 99,
                "member": _member_to_wire(Member(str(nodes[4].peer_id), weight=1.0)),
            }
            for who, node in (("stranger", nodes[4]), ("invited", nodes[2])):
                for name, req in ((MANIFEST, {"digest": digest}), (JOIN, join)):
                    if who == "invited" and name == JOIN:
                        continue
                    try:
                        await node.call(nodes[0].peer_id, name, req, timeout=5)
                        facts[f"{who} {name}"] = "ok"
                    except RPCError as e:
                        facts[f"{who} {name}"] = str(e)

            # a contribution sent straight to an honest reducer is refused at the door
            spec = GroupSpec(
                (
                    Member(str(nodes[0].peer_id), "node"),
                    Member(str(nodes[1].peer_id), "node"),
                    Member(str(nodes[4].peer_id), "client"),
                ),
                b"poison",
            )
            vec = {0: _grad(0, 7), 1: _grad(1, 7), 4: _grad(4, 7) * 1e6}
            got: dict[int, object] = {}

            async def member(i: int) -> None:
                service = cores[i].rounds.service
                r = await all_reduce(service, spec, [vec[i]], 1.0, codec="none", timeout=10)
                got[i] = r.average[0]

            async with trio.open_nursery() as nursery:
                for i in (0, 1):
                    nursery.start_soon(member, i)
                with trio.move_on_after(10):
                    try:
                        await member(4)
                    except AveragingError as e:
                        got[4] = e
            facts["poison"] = (got[0], got[1], (vec[0] + vec[1]) / 2)

            # the invited peer 3 is cut off once its invitation expires
            await trio.sleep(max(0.0, 25.0 - trio.current_time()))
            try:
                await nodes[3].call(nodes[0].peer_id, MANIFEST, {"digest": digest}, timeout=5)
                facts["expired"] = "ok"
            except RPCError as e:
                facts["expired"] = str(e)
            facts["expired_store"] = await _refusals(cores[3].dht, nodes[3].peer_id)

    run_sim(main, seed=5, timeout=900)
    names = facts["names"]
    stranger = names[4]
    results = facts["results"]
    # invited peers averaged in groups of four, and got exactly the honest mean
    for epoch in range(2):
        rows = [results[i][epoch] for i in range(4)]
        assert all(group == 4 for group, _, _ in rows), rows
        total = sum(s for _, _, s in rows)
        want = sum(_grad(i, epoch).astype(np.float64) * rows[i][2] for i in range(4)) / total
        for _, got_vec, _ in rows:
            np.testing.assert_allclose(got_vec, want, rtol=1e-5, atol=1e-6)
    assert all(group == 1 for group, _, _ in results[4])  # the stranger stayed alone
    for seen in facts["honest_records"]:
        assert stranger not in seen and len(seen) == 4
    assert facts["store_refused"] and all("no invitation" in r for r in facts["store_refused"])
    assert not any(stranger in w for w in facts["progress_writers"])
    assert "no invitation" in facts[f"stranger {MANIFEST}"]
    assert "no invitation" in facts[f"stranger {JOIN}"]
    assert facts[f"invited {MANIFEST}"] == "ok"
    assert "not leading" not in facts[f"stranger {JOIN}"]
    a, b, want = facts["poison"]
    np.testing.assert_allclose(a, want, rtol=1e-6)
    np.testing.assert_array_equal(a, b)
    assert "expired" in facts["expired"]
    assert facts["expired_store"] and all("expired" in r for r in facts["expired_store"])
