"""The run's DHT keys carry schemas: records of the real shapes pass, others are refused
with a reason that reaches the writer, through ``DHT.store`` and through the CLI."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import trio

from dedloc_jax.progress import PeerProgress
from dedloc_jax.rounds.wire import group_key, member_for, member_from_wire, member_to_wire
from dedloc_jax.state.serving import state_key
from dedloc_jax.tracker import progress_key
from dedloc_jax.validators import run_validators
from p2p.dht import InvalidRecordError, Record, open_dht, owner_marker
from p2p.dht.records import pack_value
from p2p.dht.validation import ValidatorChain, sign_record
from p2p.identity import Identity
from p2p.node import open_node
from p2p.testing import run_sim
from tests.p2p.dht.swarm import TEST_CONFIG, dht_swarm

RUN = "runA"
ME = Identity.from_seed(b"writer")
ADDR = f"/ip4/1.2.3.4/tcp/4001/p2p/{ME.peer_id}"


def _progress() -> dict:
    """A record with every optional field that ``to_record`` can write."""
    state = (7, b"d" * 32, (b"a" * 32, b"b" * 32))
    return PeerProgress(
        str(ME.peer_id), 7, 120, 3.5, 1000.0, "node", 0.2, True, state, True, 4096, alone=True
    ).to_record()


def _registration() -> dict:
    me = member_for(str(ME.peer_id), "node", math.inf, 2e6, 120.0)
    return {"member": member_to_wire(me), "addrs": [ADDR], "state": b"d" * 32}


def _state() -> dict:
    return {"epoch": 7, "digest": b"d" * 32, "lineage": [b"a" * 32], "addrs": [ADDR]}


def _signed(key: str, value, subkey: str | None = "", ident: Identity = ME) -> Record:
    sub = owner_marker(ident.peer_id) + subkey if subkey is not None else None
    rec = Record(key, sub, pack_value(value), 100.0)
    return sign_record(rec, ident) if sub is not None else rec


def _reason(rec: Record) -> str | None:
    return ValidatorChain(run_validators(RUN)).reason(rec)


def test_the_real_records_pass() -> None:
    assert _reason(_signed(progress_key(RUN), _progress())) is None
    minimal = PeerProgress(str(ME.peer_id), 0, 0, 0.0, 1.0).to_record()
    assert _reason(_signed(progress_key(RUN), minimal)) is None
    assert _reason(_signed(group_key(RUN, 7), _registration())) is None
    assert _reason(_signed(group_key(RUN, 7, 1), _registration())) is None
    assert _reason(_signed(state_key(RUN), _state())) is None
    assert _reason(_signed("nat.relays", [ADDR])) is None
    # other runs' keys and other keys of this run are left alone
    assert _reason(Record("runB.progress", None, pack_value("x"), 100.0)) is None
    assert _reason(Record(f"{RUN}.metrics", None, pack_value("x"), 100.0)) is None
    assert _reason(Record(f"{RUN}Xprogress", None, pack_value("x"), 100.0)) is None


@pytest.mark.parametrize(
    ("key", "change", "why"),
    [
        ("progress", {"epoch": "7"}, "value.epoch must be an integer"),
        ("progress", {"epoch": -1}, "value.epoch below 0"),
        ("progress", {"sps": math.nan}, "value.sps must be finite"),
        ("progress", {"time": math.inf}, "value.time must be finite"),
        ("progress", {"mode": "<script>alert(1)</script>"}, "value.mode must be one of"),
        ("progress", {"waiting": 1}, "value.waiting must be a boolean"),
        ("progress", {f"x{i}": 1 for i in range(5)}, "unknown field 'x0' (over 4 unknown)"),
        ("progress", {"<b>x</b>": 1}, "field named '<b>x</b>', not a lower-case identifier"),
        ("progress", {"Poll": 1}, "not a lower-case identifier"),
        ("progress", {"note": "x" * 600}, "unknown fields take 60"),
        ("group", {"later": [1] * 600}, "unknown fields take"),
        ("state", {"a": b"x" * 300, "b": b"y" * 300}, "unknown fields take"),
        ("progress", {"state": [7, b"d", [b"x"] * 5]}, "value.state[2] has more than 4"),
        ("progress", {"target": 0}, "value.target below 1"),
        ("group", {"addrs": ["<b>x</b>" * 100]}, "value.addrs[0] must be a multiaddr of at most"),
        ("group", {"addrs": ["<b>x</b>"]}, "value.addrs[0] is not a multiaddr"),
        ("group", {"addrs": ["/dns4/<b>x<b>/tcp/1"]}, "value.addrs[0] names a malformed host"),
        ("state", {"addrs": ["/ip4/1.2.3.4/tcp/1<b>"]}, "value.addrs[0] is not a multiaddr"),
        ("progress", {"epoch": (1 << 53) - 1}, "value.epoch above"),
        ("state", {"epoch": (1 << 53) - 1}, "value.epoch above"),
        (
            "group",
            {"member": {"mode": "node", "up": 1e15, "down": 1e15, "weight": 1.0}},
            "value.member.up above",
        ),
        ("group", {"addrs": [ADDR] * 33}, "value.addrs has more than 32 items"),
        ("group", {"member": {"mode": "node", "up": 1.0, "down": 1.0}}, "weight is missing"),
        ("group", {"state": b"s" * 65}, "value.state longer than 64"),
        ("state", {"digest": "text"}, "value.digest must be bytes"),
        ("state", {"lineage": None}, "value.lineage must be a list"),
    ],
)
def test_records_of_another_shape_are_refused_with_the_reason(key, change, why) -> None:
    base, k = {
        "progress": (_progress(), progress_key(RUN)),
        "group": (_registration(), group_key(RUN, 3)),
        "state": (_state(), state_key(RUN)),
    }[key]
    reason = _reason(_signed(k, {**base, **change}))
    assert reason is not None and why in reason and k in reason


def test_a_newer_versions_records_are_stored_and_read_without_its_fields() -> None:
    """A record with fields a newer version added (as ``poll`` once was) passes every node of
    this one, and readers take what they know: the strict schema kept a mid-step peer's records
    off every older node of a mixed-version run."""
    newer = {"later": 0.5, "hint": [1, 2], "flag": True}
    progress = {**_progress(), **newer}
    assert _reason(_signed(progress_key(RUN), progress)) is None
    assert PeerProgress.from_record(str(ME.peer_id), progress) == PeerProgress.from_record(
        str(ME.peer_id), _progress()
    )
    registration = {**_registration(), **newer}
    registration["member"] = {**registration["member"], "later": 1}
    assert _reason(_signed(group_key(RUN, 3), registration)) is None
    assert member_from_wire("p", registration["member"]) == member_from_wire(
        "p", _registration()["member"]
    )
    assert _reason(_signed(state_key(RUN), {**_state(), **newer})) is None
    # a known field is still checked as strictly, whatever comes beside it
    bad = {**progress, "epoch": -1}
    assert "value.epoch below 0" in (_reason(_signed(progress_key(RUN), bad)) or "")


def test_records_that_would_live_longer_than_the_run_allows_are_refused() -> None:
    """A progress record stored once with a 7-day TTL outlived its writer by a week; every
    key of the run takes MAX_RECORD_TTL (plus clock slack) at most, on store and on read."""
    from dedloc_jax.config import MAX_RECORD_TTL

    chain = ValidatorChain(run_validators(RUN))
    week = 7 * 24 * 3600.0
    for key, value in (
        (progress_key(RUN), _progress()),
        (group_key(RUN, 3), _registration()),
        (state_key(RUN), _state()),
    ):
        rec = _signed(key, value)  # expires at 100.0
        assert chain.lifetime_reason(rec, 100.0 - MAX_RECORD_TTL, week) is None
        reason = chain.lifetime_reason(rec, 100.0 - week, week)
        assert reason is not None and "expiration more than" in reason
    # keys without a bound of their own keep the DHT's
    other = Record(f"{RUN}.metrics", None, pack_value("x"), 100.0)
    assert chain.lifetime_reason(other, 100.0 - week, week) is None


def test_plain_or_unsigned_records_are_refused() -> None:
    for key in (progress_key(RUN), group_key(RUN, 3), state_key(RUN), "nat.relays"):
        reason = _reason(Record(key, None, pack_value("x"), 100.0))
        assert reason is not None and "only signed subkeys" in reason
        reason = _reason(Record(key, "junk", pack_value(_progress()), 100.0))
        assert reason is not None and "only signed subkeys" in reason
    assert "not a list" not in (_reason(_signed("nat.relays", "x")) or "")
    assert "must be a list" in _reason(_signed("nat.relays", "x"))
    assert "not a multiaddr" in _reason(_signed("nat.relays", ["<script>"]))
    assert "at most 512" in _reason(_signed("nat.relays", ["/ip4/1.2.3.4/tcp/1" + "x" * 600]))


def test_refusals_reach_dht_store_with_the_reason() -> None:
    """Nodes of the run refuse; a writer without the schemas (an old or hostile peer) is
    told why, and the run's readers never see the record."""

    async def main() -> None:
        async with dht_swarm(8, seed=3, validators=run_validators(RUN)) as swarm:
            via = [str(swarm.dhts[0].node.addrs[0])]
            writer = await swarm.add(50, via, config=TEST_CONFIG, client_mode=True)
            now = writer.now()
            bad = {**_progress(), "sps": math.inf}
            me = owner_marker(writer.peer_id)
            with pytest.raises(InvalidRecordError, match=r"refused: progress record .*sps"):
                await writer.store(progress_key(RUN), bad, now + 60, subkey=me)
            with pytest.raises(InvalidRecordError, match="only signed subkeys"):
                await writer.store(progress_key(RUN), "x", now + 600_000)
            good = await writer.store(progress_key(RUN), _progress(), now + 60, subkey=me)
            assert good.ok
            got = await swarm.dhts[5].get(progress_key(RUN))
            assert list(got) == [me] and got[me].value == _progress()
            # a node of the run checks its own writes before sending them
            with pytest.raises(InvalidRecordError, match="value.epoch must be an integer"):
                await swarm.dhts[2].store(
                    progress_key(RUN),
                    {**_progress(), "epoch": 1.5},
                    now + 60,
                    subkey=owner_marker(swarm.dhts[2].peer_id),
                )

    run_sim(main)


ROOT = Path(__file__).resolve().parents[2]


def test_refusals_reach_the_cli_with_the_reason() -> None:
    """``python -m p2p.dht store`` against real nodes of a run on loopback."""

    async def cli(*args: str) -> tuple[int, str, str]:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = await trio.run_process(
            [sys.executable, "-m", "p2p.dht", "store", *args, "--config", "fast"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
            cwd=ROOT,
        )
        return proc.returncode, proc.stdout.decode(), proc.stderr.decode()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            dhts = []
            for _ in range(3):
                initial = [str(dhts[0].node.addrs[0])] if dhts else []
                dhts.append(await nursery.start(_run_node, initial))
            peers = ["--initial-peers", str(dhts[1].node.addrs[0])]
            key = progress_key(RUN)
            with trio.fail_after(120):
                rc, out, err = await cli(key, '"x"', "--ttl", "600000", *peers)
                assert rc == 1 and "only signed subkeys" in err, err
                nan = '{"$float": "nan"}'
                bad = f'{{"epoch": 1, "samples": 2, "sps": {nan}, "time": 5, "mode": "node"}}'
                rc, out, err = await cli(key, bad, "--ttl", "60", "--owned", *peers)
                assert rc == 1 and "value.sps must be finite" in err, err
                rc, out, err = await cli(
                    "nat.relays", '["<b>relay</b>"]', "--ttl", "60", "--owned", *peers
                )
                assert rc == 1 and "not a multiaddr" in err, err
                good = '{"epoch": 1, "samples": 2, "sps": 1.5, "time": 5, "mode": "node"}'
                rc, out, err = await cli(key, good, "--ttl", "60", "--owned", *peers)
                assert rc == 0 and "stored on 3 nodes" in out, err
            got = await dhts[2].get(key)
            assert [v.value for v in got.values()] == [
                {"epoch": 1, "samples": 2, "sps": 1.5, "time": 5, "mode": "node"}
            ]
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _run_node(initial: list[str], task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with (
        open_node(Identity.generate(), listen=["/ip4/127.0.0.1/tcp/0"]) as node,
        open_dht(
            node, initial_peers=initial, config=TEST_CONFIG, validators=run_validators(RUN)
        ) as dht,
    ):
        task_status.started(dht)
        await trio.sleep_forever()


def test_collaborations_install_the_schemas_by_default() -> None:
    """A record of another shape sent straight to a run's node (as a peer of another version
    or a hostile one would) is refused with the reason; with ``record_schemas=False`` the same
    STORE is taken."""
    from dedloc_jax.config import CollaborationConfig
    from p2p.dht.wire import Contact
    from p2p.testing import SimNetwork
    from tests.dedloc_jax.simcollab import open_sim_collaboration

    async def attempt(record_schemas: bool) -> bool | str | None:
        config = CollaborationConfig.local_demo(32)
        config = config.replace(defence=config.defence.replace(record_schemas=record_schemas))
        async with open_sim_collaboration(SimNetwork(4), 2, config=config, run_id=RUN) as cores:
            writer, target = cores[1], cores[0]
            rec = Record(
                progress_key(RUN),
                owner_marker(writer.node.peer_id),
                pack_value({**_progress(), "samples": -5}),
                writer.dht.now() + 60,
            )
            rec = sign_record(rec, writer.node.identity)
            contact = Contact(target.node.peer_id, tuple(str(a) for a in target.node.addrs))
            answers = await writer.dht.protocol.store(contact, [rec])
            return None if answers is None else answers[0]

    refused = run_sim(attempt, True)
    assert isinstance(refused, str) and "value.samples below 0" in refused
    assert run_sim(attempt, False) is True


def test_a_peer_stating_links_above_the_cap_still_registers() -> None:
    """bench.byzantine lying_config: a peer configured with 1e15 B/s links wrote a registration
    its own node refused (the schema caps links at MAX_BPS), so it never registered; every
    round waited two windows for it and probed it (stall 16.7 s, 6 of 36 rounds incomplete).
    Its member entry now states MAX_BPS at most, which the leader then bounds to the median."""
    me = member_for(str(ME.peer_id), "node", 1e15, 1e15, 120.0)
    registration = {"member": member_to_wire(me), "addrs": [ADDR]}
    assert _reason(_signed(group_key(RUN, 7), registration)) is None
