"""``nat.relays`` and ``nat.addrs.*`` carry schemas on every ``python -m p2p.dht serve`` node:
a relay advert of another shape is refused, and the CLI writer is told why."""

from __future__ import annotations

import json

from tests.p2p.dht.test_cli import _run, _serve


def test_serve_nodes_refuse_malformed_relay_adverts_with_the_reason() -> None:
    procs = []
    try:
        first, addr0 = _serve()
        procs.append(first)
        second, addr1 = _serve("--initial-peers", addr0)
        procs.append(second)
        peers = ("--initial-peers", addr1)
        plain = _run("store", "nat.relays", '"x"', "--ttl", "600000", *peers)
        assert plain.returncode == 1 and "only signed subkeys" in plain.stderr, plain.stderr
        markup = _run(
            "store", "nat.relays", '["<script>x</script>"]', "--ttl", "60", "--owned", *peers
        )
        assert markup.returncode == 1 and "not a multiaddr" in markup.stderr, markup.stderr
        many = json.dumps(["/ip4/1.2.3.4/tcp/1"] * 9)
        too_many = _run("store", "nat.relays", many, "--ttl", "60", "--owned", *peers)
        assert too_many.returncode == 1 and "more than 8 items" in too_many.stderr
        good = _run(
            "store", "nat.relays", '["/ip4/1.2.3.4/tcp/1"]', "--ttl", "60", "--owned", *peers
        )
        assert good.returncode == 0 and "stored on 2 nodes" in good.stdout, good.stderr
        got = json.loads(_run("get", "nat.relays", "--initial-peers", addr0).stdout)
        assert ["/ip4/1.2.3.4/tcp/1"] in got.values()  # beside the serve nodes' own adverts
        assert all(isinstance(v, list) and len(v) <= 8 for v in got.values())
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
