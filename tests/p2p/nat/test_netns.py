"""The namespace lab: real processes and sockets, two peers behind NAT and one public peer.

Both NATed peers join the DHT through the public one, find out they are private, take a
reservation on it, publish their relayed addresses, and one streams data to the other
through the relay, end to end encrypted (the relay checks it never saw the plaintext).
Then the hole punch started by the relayed dial moves them to a direct connection (cone
NAT), or fails and leaves them on the relay (symmetric NAT).
"""

from __future__ import annotations

import os

import pytest

from bench.netns_lab import NetnsLab, read_event, unavailable_reason

pytestmark = pytest.mark.netns

_why = unavailable_reason("nft")


@pytest.mark.skipif(_why is not None, reason=_why or "")
@pytest.mark.parametrize(
    "fully_random",
    [
        pytest.param(False, id="cone-nat"),
        pytest.param(True, id="symmetric-nat", marks=pytest.mark.slow),
    ],
)
def test_two_nated_peers_exchange_data_through_the_public_relay(tmp_path, fully_random):
    marker = os.urandom(16).hex()
    size = 4 << 20
    with NetnsLab(fully_random=fully_random) as lab:

        def spawn(ns: str, *args: str):
            log = tmp_path / f"{ns}.log"
            peer = "tests.p2p.nat.netns_peer"
            proc = lab.spawn_module(ns, peer, *args, "--marker", marker, log=log)
            return proc, log

        pub, pub_log = spawn("pub", "pub", "--listen", "/ip4/10.77.0.10/tcp/0")
        ready = read_event(pub, "ready", 30, pub_log)
        boot = ready["addrs"][0]
        assert boot.startswith("/ip4/10.77.0.10/tcp/")

        b, b_log = spawn("h2", "nated", "--listen", "/ip4/10.77.2.2/tcp/0", "--boot", boot)
        b_ready = read_event(b, "ready", 60, b_log)
        assert b_ready["reachability"] == "private"
        assert b_ready["role"] == "relayed" and b_ready["client_mode"] is False
        assert b_ready["relayed"] == [f"{boot}/p2p-circuit/p2p/{b_ready['peer']}"]

        a, a_log = spawn(
            "h1", "nated", "--listen", "/ip4/10.77.1.2/tcp/0", "--boot", boot,
            "--send-to", b_ready["peer"], "--size", str(size),
        )  # fmt: skip
        a_ready = read_event(a, "ready", 60, a_log)
        assert a_ready["reachability"] == "private" and a_ready["role"] == "relayed"
        result = read_event(a, "result", 90, a_log)
        assert result["n"] == size and result["sha_ok"] is True
        assert result["remote_addr"] == b_ready["relayed"][0]  # through the relay
        assert "/p2p-circuit/p2p/" in result["via"]
        assert result["cipher"] in ("chacha20-poly1305", "aes-256-gcm", "aes-256-ocb")

        # then a hole punch: through cone NATs it goes direct, through symmetric ones it
        # fails and the relay stays in use
        upgrade = read_event(a, "upgrade", 60, a_log)
        after = read_event(a, "after-upgrade", 60, a_log)
        assert after["sha_ok"] is True and after["n"] == size // 4
        if fully_random:
            assert upgrade == {"event": "upgrade", "ok": False, "upgraded": 0, "failed": 1}
            assert after["remote_addr"] == b_ready["relayed"][0]
            assert "/p2p-circuit/p2p/" in after["via"]
        else:
            assert upgrade == {"event": "upgrade", "ok": True, "upgraded": 1, "failed": 0}
            assert after["remote_addr"].startswith("/ip4/10.77.0.12/tcp/")  # b's router
            assert after["via"].startswith("/ip4/10.77.0.11/tcp/")  # a's router, as b saw it

        pub.stdin.write("report\n")
        pub.stdin.flush()
        report = read_event(pub, "report", 30, pub_log)
        assert report["bytes_relayed"] > size  # the first transfer crossed the relay ...
        assert report["seen_bytes"] > size
        assert report["marker_seen"] is False  # ... as ciphertext only
        for proc in (a, b, pub):
            proc.stdin.write("quit\n")
            proc.stdin.flush()
        for proc in (a, b, pub):
            assert proc.wait(timeout=30) == 0
