"""The RPC layer against untrusted input, request batching and the blacklist (no sockets)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2p.dht import DHTClock, DHTConfig, open_dht
from p2p.dht.blacklist import Blacklist
from p2p.dht.memnet import MemoryNetwork
from p2p.dht.protocol import DHTProtocol
from p2p.dht.records import Record, pack_value
from p2p.dht.traverse import FindBatcher
from p2p.dht.validation import ValidatorChain
from p2p.dht.wire import (
    Contact,
    Limits,
    parse_find_response,
    parse_store_request,
    record_to_wire,
)
from p2p.errors import ProtocolError, RPCError
from p2p.identity import Identity, PeerID

SENDER = Identity.from_seed(b"sender").peer_id
OTHER = Identity.from_seed(b"other").peer_id


@dataclass
class Ctx:
    remote_peer: PeerID
    remote_addr: None = None


def make_protocol() -> DHTProtocol:
    net = MemoryNetwork()
    node = net.add_node(Identity.from_seed(b"server"))
    return DHTProtocol(
        node, config=DHTConfig(), clock=DHTClock(lambda: 1000.0), validators=ValidatorChain()
    )


def handle(proto: DHTProtocol, name: str, request: object) -> object:
    handler = {"ping": proto.handle_ping, "store": proto.handle_store, "find": proto.handle_find}
    return trio.run(handler[name], Ctx(SENDER), request)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=5)
    ),
    max_leaves=30,
)
requests = msgpack_values | st.fixed_dictionaries(
    {},
    optional={
        "client": msgpack_values,
        "addrs": msgpack_values | st.lists(st.text(max_size=60), max_size=3),
        "records": msgpack_values | st.lists(st.lists(msgpack_values, max_size=7), max_size=3),
        "queries": msgpack_values
        | st.lists(st.binary(min_size=32, max_size=32) | st.text(), max_size=3),
    },
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["ping", "store", "find"]), request=requests)
def test_handlers_refuse_garbage_with_protocol_errors(name: str, request: object) -> None:
    proto = make_protocol()
    try:
        response = handle(proto, name, request)
    except ProtocolError:
        return
    assert isinstance(response, dict) and isinstance(response["time"], float)


def test_handlers_check_every_field() -> None:
    proto = make_protocol()
    good = record_to_wire(Record("k", None, pack_value(1), 1100.0))
    cases = {
        "records must be a list": {"records": "x"},
        "limit": {"records": [good] * 65},
        "key must be text": {"records": [[b"k", *good[1:]]]},
        "value must be at most": {"records": [["k", None, b"x" * 300_000, 1100.0, None, False]]},
        "expiration must be": {"records": [["k", None, b"\x01", float("nan"), None, False]]},
        "cache must be a boolean": {"records": [["k", None, b"\x01", 1100.0, None, 1]]},
        "client must be a boolean": {"client": "yes", "records": [good]},
        "names another peer": {"addrs": [f"/ip4/1.2.3.4/tcp/5/p2p/{OTHER}"], "records": []},
        "bad address": {"addrs": ["/ip4/999.1.1.1/tcp/5"], "records": []},
    }
    for reason, request in cases.items():
        with pytest.raises(ProtocolError, match=reason):
            handle(proto, "store", request)
    with pytest.raises(ProtocolError, match="32-byte ID or a key"):
        handle(proto, "find", {"queries": [b"short"]})
    # a good store answers per record: stored, outdated, or the validator's reason
    owned = Record(f"x[owner:{OTHER}]", None, pack_value(1), 1100.0)
    resp = handle(proto, "store", {"records": [good, record_to_wire(owned), good]})
    assert resp["results"][0] is True and resp["results"][2] is True
    assert "not signed" in resp["results"][1]
    too_far = record_to_wire(Record("far", None, pack_value(1), 1000.0 + 10 * 24 * 3600))
    assert "ahead" in handle(proto, "store", {"records": [too_far]})["results"][0]
    # the sender's own address is kept (with its peer ID appended)
    handle(proto, "ping", {"addrs": ["/ip4/10.0.0.1/tcp/4001"]})
    assert proto.routing.get(SENDER).addrs == (f"/ip4/10.0.0.1/tcp/4001/p2p/{SENDER}",)
    # client-mode senders are never added
    client = Identity.from_seed(b"client").peer_id
    trio.run(proto.handle_ping, Ctx(client), {"client": True})
    assert client not in proto.routing


def test_find_responses_are_checked() -> None:
    limits = Limits()
    peer = [OTHER.to_bytes(), [f"/ip4/1.2.3.4/tcp/5/p2p/{OTHER}"]]
    ok = {"time": 1.0, "results": [[[peer], None], [[], [[None, b"\x01", 5.0, None]]]]}
    answers = parse_find_response(ok, [7, "key"], limits)
    assert answers[0][0] == [Contact(OTHER, (f"/ip4/1.2.3.4/tcp/5/p2p/{OTHER}",))]
    assert answers[1][1] == [Record("key", None, b"\x01", 5.0)]
    bad = [
        {"time": 1.0, "results": [[[peer], None]]},  # one result for two queries
        {"time": 1.0, "results": [[[[b"x" * 31, []]], None], [[], None]]},
        {"time": 1.0, "results": [[[], [[None, b"\x01", 5.0, None]]], [[], None]]},  # node query
        {"time": 1.0, "results": [[[peer] * 65, None], [[], None]]},
        {"time": 1.0, "results": [[[], None], [[], [[None, "str", 5.0, None]]]]},
    ]
    for msg in bad:
        with pytest.raises(ProtocolError):
            parse_find_response(msg, [7, "key"], limits)
    with pytest.raises(ProtocolError):
        parse_store_request({"records": [["k", None, b"", 1.0, b"p" * 97, False]]}, limits)


def test_remote_garbage_gets_an_error_and_the_node_keeps_serving() -> None:
    async def main() -> None:
        net = MemoryNetwork()
        a, b = (net.add_node(Identity.from_seed(s)) for s in (b"a", b"b"))
        async with (
            open_dht(a, config=DHTConfig.fast(), clock=DHTClock(trio.current_time)) as da,
            open_dht(
                b,
                initial_peers=[str(a.addrs[0])],
                config=DHTConfig.fast(),
                clock=DHTClock(trio.current_time),
            ) as db,
        ):
            for garbage in [None, [1, 2], {"records": [[1, 2, 3]]}, {"queries": "x" * 10}]:
                with pytest.raises(RPCError) as info:
                    await b.call(a.peer_id, "dht.store", garbage)
                assert info.value.remote
            await db.store("still", "works", da.now() + 10)
            assert (await da.get("still")).value == "works"

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_find_batcher_merges_concurrent_queries_and_survives_a_cancelled_leader() -> None:
    sent: list[list] = []

    async def send(contact: Contact, queries: list, count: int | None = None) -> list:
        sent.append(list(queries))
        await trio.sleep(1)
        return [f"answer-{q}" for q in queries]

    async def main() -> None:
        batcher = FindBatcher(send)
        contact = Contact(OTHER)
        results = {}

        async def ask(q: int) -> None:
            results[q] = await batcher.find(contact, q)

        async with trio.open_nursery() as nursery:
            for q in range(4):
                nursery.start_soon(ask, q)
        assert len(sent) == 1 and sorted(sent[0]) == [0, 1, 2, 3]
        assert results == {q: f"answer-{q}" for q in range(4)}
        # the leader is cancelled while its batch is in flight: the follower retries alone
        sent.clear()
        results.clear()
        scopes = {10: trio.CancelScope(), 11: trio.CancelScope()}

        async def ask_in_scope(q: int) -> None:
            with scopes[q]:
                await ask(q)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask_in_scope, 10)
            nursery.start_soon(ask_in_scope, 11)
            await trio.sleep(0.5)
            leader = sent[0][0]
            follower = 21 - leader
            scopes[leader].cancel()
        assert sent[1] == [follower]
        assert results == {follower: f"answer-{follower}"}

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_blacklist_backs_off_exponentially() -> None:
    bl = Blacklist(base=2.0, max_ban=10.0)
    assert not bl.is_banned("p", 0.0)
    assert bl.failed("p", 0.0) == 2.0
    assert bl.failed("p", 2.0) == 6.0  # 2 + 4
    assert bl.failed("p", 6.0) == 14.0  # 6 + 8
    assert bl.failed("p", 14.0) == 24.0  # capped at 10
    assert bl.is_banned("p", 23.9) and not bl.is_banned("p", 24.0)
    bl.succeeded("p")
    assert bl.failures("p") == 0 and not bl.is_banned("p", 0.0)


def test_a_full_bucket_pings_its_oldest_entry_only_when_it_was_not_heard_from_lately() -> None:
    from p2p.dht.protocol import LIVE_FOR

    async def main() -> None:
        proto = make_protocol()
        proto.routing.k = 2  # small buckets fill after a few peers
        checked: list[PeerID] = []
        proto._check_eviction = lambda lrs: checked.append(lrs.peer)  # type: ignore[method-assign]
        peers = [Identity.from_seed(f"p{i}".encode()).peer_id for i in range(40)]
        async with trio.open_nursery() as nursery:
            proto.nursery = nursery
            for p in peers:
                proto.peer_seen(p, (), client=False)
            waiting = [p for p in peers if proto.routing.get(p) is None]
            assert waiting  # some buckets were full: those peers wait as replacements
            assert checked == []  # everyone in the table was heard from just now
            await trio.sleep(LIVE_FOR + 1)
            for p in waiting:
                proto.peer_seen(p, (), client=False)
            assert checked and all(proto.routing.get(p) is not None for p in checked)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
