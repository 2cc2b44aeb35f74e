"""Multiaddr text: parse/print round trips, accessors, and clear errors for malformed input."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.errors import MultiaddrError
from p2p.identity import Identity, PeerID
from p2p.multiaddr import Multiaddr

PID = Identity.from_seed(b"target").peer_id
RELAY = Identity.from_seed(b"relay").peer_id


@pytest.mark.parametrize(
    "text",
    [
        "/ip4/127.0.0.1/tcp/4001",
        f"/ip4/127.0.0.1/tcp/4001/p2p/{PID}",
        "/ip6/::1/tcp/0",
        f"/ip6/2001:db8::7/tcp/65535/p2p/{PID}",
        "/sim/host-7/tcp/1",
        f"/sim/relay/tcp/9/p2p/{RELAY}/p2p-circuit/p2p/{PID}",
        f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PID}",
        "/dns4/example.org/tcp/443",
        f"/p2p/{PID}",
    ],
)
def test_parse_print_round_trip(text):
    addr = Multiaddr.parse(text)
    assert str(addr) == text
    assert Multiaddr.parse(str(addr)) == addr
    assert Multiaddr.parse(addr) is addr
    assert hash(Multiaddr.parse(text)) == hash(addr)
    assert text in repr(addr)


def test_normalisation_of_equivalent_forms():
    assert str(Multiaddr.parse("/ip6/0:0:0:0:0:0:0:1/tcp/080/")) == "/ip6/::1/tcp/80"


def test_accessors_of_a_direct_address():
    addr = Multiaddr.parse(f"/ip4/192.168.1.2/tcp/4001/p2p/{PID}")
    assert addr.host == "192.168.1.2"
    assert addr.port == 4001
    assert addr.peer_id == PID
    assert not addr.is_relayed
    assert addr.relay_parts() is None
    assert str(addr.transport_part()) == "/ip4/192.168.1.2/tcp/4001"
    assert addr.value_of("ip4") == "192.168.1.2"
    assert addr.value_of("ip6") is None


def test_accessors_of_a_relayed_address():
    text = f"/sim/r/tcp/7/p2p/{RELAY}/p2p-circuit/p2p/{PID}"
    addr = Multiaddr.parse(text)
    assert addr.is_relayed
    assert addr.peer_id == PID  # the last /p2p/ is the target
    relay, target = addr.relay_parts()
    assert str(relay) == f"/sim/r/tcp/7/p2p/{RELAY}"
    assert relay.peer_id == RELAY
    assert target == PID
    assert str(addr.transport_part()) == "/sim/r/tcp/7"
    assert addr.host == "r" and addr.port == 7


def test_with_peer_appends_or_replaces():
    base = Multiaddr.parse("/ip4/1.2.3.4/tcp/5")
    assert str(base.with_peer(PID)) == f"/ip4/1.2.3.4/tcp/5/p2p/{PID}"
    assert str(base.with_peer(PID).with_peer(RELAY)) == f"/ip4/1.2.3.4/tcp/5/p2p/{RELAY}"


def test_from_components_round_trip():
    addr = Multiaddr.parse(f"/ip4/1.2.3.4/tcp/5/p2p/{PID}")
    assert Multiaddr.from_components(addr.components) == addr


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "starts with '/'"),
        ("ip4/1.2.3.4", "starts with '/'"),
        ("/", "empty multiaddr"),
        ("/ip4", "needs a value"),
        ("/ip4/1.2.3.4/tcp", "needs a value"),
        ("/ip4/256.0.0.1/tcp/1", "invalid IPv4"),
        ("/ip4/1.2.3/tcp/1", "invalid IPv4"),
        ("/ip4/::1/tcp/1", "invalid IPv4"),
        ("/ip6/1.2.3.4/tcp/1", "invalid IPv6"),
        ("/ip6/:::/tcp/1", "invalid IPv6"),
        ("/ip4/1.2.3.4/tcp/65536", "invalid TCP port"),
        ("/ip4/1.2.3.4/tcp/-1", "invalid TCP port"),
        ("/ip4/1.2.3.4/tcp/http", "invalid TCP port"),
        ("/ip4/1.2.3.4/tcp/\u00b2", "invalid TCP port"),  # a digit int() rejects
        ("/ip4/1.2.3.4/tcp/\u0663", "invalid TCP port"),  # an Arabic-Indic digit
        ("/ip4/1.2.3.4/udp/1", "unknown protocol"),
        ("/ip4/1.2.3.4//tcp/1", "unknown protocol"),
        ("/ip4/1.2.3.4/tcp/1/p2p/notapeer0", "malformed peer ID"),
        ("/ip4/1.2.3.4/tcp/1/p2p/abc", "malformed peer ID"),
        ("/sim/ /tcp/1", "invalid sim value"),
    ],
)
def test_malformed_addresses_raise_clear_errors(text, fragment):
    with pytest.raises(MultiaddrError, match=fragment):
        Multiaddr.parse(text)


def test_non_text_is_rejected():
    with pytest.raises(MultiaddrError, match="is text"):
        Multiaddr.parse(b"/ip4/1.2.3.4")  # type: ignore[arg-type]


def test_relay_parts_needs_both_peer_ids():
    with pytest.raises(MultiaddrError, match="both peer IDs"):
        Multiaddr.parse(f"/ip4/1.2.3.4/tcp/1/p2p-circuit/p2p/{PID}").relay_parts()
    with pytest.raises(MultiaddrError, match="both peer IDs"):
        Multiaddr.parse(f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY}/p2p-circuit").relay_parts()


def test_transport_part_needs_a_transport():
    with pytest.raises(MultiaddrError, match="no transport part"):
        Multiaddr.parse(f"/p2p/{PID}").transport_part()


def test_multiaddr_error_is_a_value_error():
    with pytest.raises(ValueError):
        Multiaddr.parse("/nope")


# ---- property tests ---------------------------------------------------------------------------

_peer_ids = st.binary(min_size=32, max_size=32).map(PeerID)
_ports = st.integers(0, 65535)
_hosts = st.one_of(
    st.ip_addresses(v=4).map(lambda a: ("ip4", str(a))),
    st.ip_addresses(v=6).map(lambda a: ("ip6", str(a))),
    st.from_regex(r"[a-z][a-z0-9\-]{0,15}", fullmatch=True).map(lambda h: ("sim", h)),
)


@st.composite
def _addresses(draw):
    proto, host = draw(_hosts)
    text = f"/{proto}/{host}/tcp/{draw(_ports)}"
    if draw(st.booleans()):
        text += f"/p2p/{draw(_peer_ids)}"
        if draw(st.booleans()):
            text += f"/p2p-circuit/p2p/{draw(_peer_ids)}"
    return text


@settings(deadline=None, derandomize=True, database=None)
@given(_addresses())
def test_generated_addresses_round_trip(text):
    addr = Multiaddr.parse(text)
    assert str(addr) == text
    assert Multiaddr.parse(str(addr)) == addr
    assert addr.port is not None and 0 <= addr.port <= 65535
    if addr.value_of("ip6") is not None:
        assert ipaddress.IPv6Address(addr.host)


@settings(deadline=None, derandomize=True, database=None)
@given(st.ip_addresses(v=6), _ports, _peer_ids)
def test_ip6_round_trip_keeps_peer(ip, port, pid):
    addr = Multiaddr.parse(f"/ip6/{ip.exploded}/tcp/{port}/p2p/{pid}")
    assert ipaddress.IPv6Address(addr.host) == ip
    assert addr.peer_id == pid
    assert Multiaddr.parse(str(addr)) == addr


_pieces = st.sampled_from(
    ["ip4", "ip6", "tcp", "sim", "p2p", "p2p-circuit", "dns", "1.2.3.4", "::1", "80", "", "x"]
)


_joined = st.lists(_pieces, max_size=8).map(lambda p: "/" + "/".join(p))


@settings(deadline=None, derandomize=True, database=None)
@given(st.one_of(st.text(max_size=60), _joined))
def test_random_text_parses_or_raises_multiaddr_error(text):
    try:
        addr = Multiaddr.parse(text)
    except MultiaddrError:
        return
    again = Multiaddr.parse(str(addr))
    assert again == addr
