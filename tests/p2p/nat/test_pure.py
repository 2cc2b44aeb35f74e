"""Pure logic of NAT traversal: verdicts, roles, dial-back eligibility, address candidates."""

from __future__ import annotations

import pytest

from p2p.errors import ProtocolError
from p2p.identity import Identity
from p2p.multiaddr import Multiaddr
from p2p.nat import DialBackAnswer, ObservedAddrs, Reachability, Role, conclude, decide_role
from p2p.nat.autonat import eligible_addrs
from p2p.nat.holepunch import parse_punch_addrs, punch_addrs
from p2p.nat.observed import parse_identify

P = [Identity.from_seed(bytes([i]) * 32).peer_id for i in range(6)]
M = Multiaddr.parse


def answers(*statuses: str) -> list[DialBackAnswer]:
    return [DialBackAnswer(P[i], s) for i, s in enumerate(statuses)]


@pytest.mark.parametrize(
    ("statuses", "verdict"),
    [
        ((), Reachability.UNKNOWN),
        (("ok",), Reachability.PUBLIC),  # one peer answered at all: its word is all we have
        (("failed",), Reachability.PRIVATE),
        (("ok", "ok", "failed"), Reachability.PUBLIC),
        (("ok", "failed", "failed"), Reachability.UNKNOWN),  # one success breaks "private"
        (("failed", "failed", "error", "refused"), Reachability.PRIVATE),
        (("ok", "error", "refused"), Reachability.PUBLIC),
        (("error", "refused"), Reachability.UNKNOWN),
    ],
)
def test_conclude(statuses, verdict):
    assert conclude(answers(*statuses), min_confirmations=2) is verdict


def test_conclude_needs_more_confirmations_when_asked():
    assert conclude(answers("ok", "ok", "failed"), 3) is Reachability.UNKNOWN
    assert conclude(answers("ok", "ok", "ok"), 3) is Reachability.PUBLIC


def test_decide_role():
    assert decide_role(Reachability.PUBLIC, 0) is Role.PUBLIC
    assert decide_role(Reachability.PRIVATE, 1) is Role.RELAYED
    assert decide_role(Reachability.PRIVATE, 0) is Role.CLIENT
    assert decide_role(Reachability.UNKNOWN, 0) is Role.UNKNOWN
    assert decide_role(Reachability.PUBLIC, 0, force_client=True) is Role.CLIENT
    assert decide_role(Reachability.PRIVATE, 0, force_client=False) is Role.UNKNOWN


def test_dial_back_only_to_the_requesting_host():
    observed = M("/ip4/203.0.113.7/tcp/51234")
    requested = [
        "/ip4/203.0.113.7/tcp/4001",
        "/ip4/198.51.100.1/tcp/80",  # a third party: never dialed (no amplification)
        "/ip4/203.0.113.7/tcp/4001/p2p/" + P[0].to_base58(),  # duplicate once bare
        "/ip4/10.0.0.5/tcp/4001",
        "/ip4/203.0.113.7/tcp/0",
        "/ip4/203.0.113.7/tcp/1/p2p/" + P[1].to_base58() + "/p2p-circuit/p2p/" + P[0].to_base58(),
        "garbage",
        "/ip4/203.0.113.7/tcp/4002",
    ]
    assert eligible_addrs(requested, observed, 8) == [
        M("/ip4/203.0.113.7/tcp/4001"),
        M("/ip4/203.0.113.7/tcp/4002"),
    ]
    assert eligible_addrs(requested, observed, 1) == [M("/ip4/203.0.113.7/tcp/4001")]
    assert eligible_addrs(requested, None, 8) == []
    with pytest.raises(ProtocolError):
        eligible_addrs("not a list", observed, 8)


def test_observed_addrs_candidates_and_expiry():
    obs = ObservedAddrs(ttl=100.0, max_addrs=2)
    listen = [M("/ip4/10.0.0.5/tcp/4001/p2p/" + P[5].to_base58())]
    obs.record(P[0], M("/ip4/203.0.113.7/tcp/51234"), now=0.0)
    obs.record(P[1], M("/ip4/203.0.113.7/tcp/51234"), now=1.0)
    obs.record(P[2], M("/ip4/203.0.113.9/tcp/6000"), now=2.0)
    assert obs.addrs(min_reporters=2) == [M("/ip4/203.0.113.7/tcp/51234")]
    assert obs.candidates(listen) == [
        M("/ip4/10.0.0.5/tcp/4001"),
        M("/ip4/203.0.113.7/tcp/51234"),
        M("/ip4/203.0.113.7/tcp/4001"),
        M("/ip4/203.0.113.9/tcp/6000"),
        M("/ip4/203.0.113.9/tcp/4001"),
    ]
    obs.record(P[3], M("/ip4/203.0.113.10/tcp/1"), now=3.0)  # over the bound: weakest goes
    assert len(obs.addrs()) == 2
    assert M("/ip4/203.0.113.7/tcp/51234") in obs.addrs()
    obs.expire(now=102.0)
    assert obs.addrs() == [M("/ip4/203.0.113.10/tcp/1")]
    assert obs.hosts() == {"203.0.113.10"}


def test_parse_identify_rejects_bad_observed_and_foreign_addrs():
    mine = "/ip4/1.2.3.4/tcp/5/p2p/" + P[0].to_base58()
    other = "/ip4/1.2.3.4/tcp/6/p2p/" + P[1].to_base58()
    res = parse_identify(P[0], {"observed": "/ip4/9.9.9.9/tcp/7", "addrs": [mine, other, "x"]})
    assert res.observed == M("/ip4/9.9.9.9/tcp/7")
    assert res.listen_addrs == (M(mine),)
    for bad in ("nonsense", mine, 5, "/ip4/9.9.9.9"):
        with pytest.raises(ProtocolError):
            parse_identify(P[0], {"observed": bad, "addrs": []})
    with pytest.raises(ProtocolError):
        parse_identify(P[0], [1, 2])


def test_punch_addrs_announce_public_ipv4_hosts_then_our_own():
    hosts = ["203.0.113.7", "::1", "sim-host", "203.0.113.7", "0.0.0.0"]
    assert punch_addrs(hosts, "10.0.0.5", 4242) == [
        "/ip4/203.0.113.7/tcp/4242",
        "/ip4/10.0.0.5/tcp/4242",
    ]
    assert punch_addrs([], "127.0.0.1", 1) == []


def test_parse_punch_addrs_rejects_what_we_must_not_dial():
    assert parse_punch_addrs(["/ip4/203.0.113.7/tcp/4242", "/ip4/10.0.0.5/tcp/1"]) == [
        ("203.0.113.7", 4242),
        ("10.0.0.5", 1),
    ]
    assert len(parse_punch_addrs(["/ip4/10.0.0.5/tcp/1"] * 10)) == 4  # bounded
    relayed = "/ip4/1.2.3.4/tcp/1/p2p/" + P[0].to_base58() + "/p2p-circuit/p2p/" + P[1].to_base58()
    for bad in (
        [],
        "x",
        ["/ip4/0.0.0.0/tcp/5"],
        ["/ip4/127.0.0.1/tcp/5"],
        ["/ip4/224.0.0.1/tcp/5"],
        ["/ip4/1.2.3.4/tcp/0"],
        ["/ip6/::2/tcp/5"],
        ["/sim/h/tcp/5"],
        [relayed],
        ["garbage"],
    ):
        with pytest.raises(ProtocolError):
            parse_punch_addrs(bad)
