"""A dial-back probe must not leave the probed node with a connection that is about to die.

The probed node runs a mux on every inbound connection and may prefer the probe over its own
connection to the prober (the duplicate-connection tie-break). CI once lost a DHT bootstrap
ping that way: sent on the probe connection just as the prober closed it.
"""

from __future__ import annotations

import logging
from functools import partial

import trio

from p2p.identity import Identity
from p2p.multiaddr import Multiaddr
from p2p.mux_frames import GOAWAY, decode_frame
from p2p.nat.autonat import AutoNATConfig, DialBackServer, ask_dial_back, probe
from p2p.node import open_node
from p2p.secure import secure_inbound


def test_a_dial_back_sends_goaway_that_processed_no_stream() -> None:
    async def main() -> None:
        probed = Identity.generate()
        first_frames: list[tuple[int, int, bytes]] = []
        done = trio.Event()

        async def accept(raw: trio.SocketStream) -> None:
            channel = await secure_inbound(raw, probed)
            kind, sid, payload = decode_frame(await channel.receive_frame())
            first_frames.append((kind, sid, bytes(payload)))
            await channel.aclose()  # as the mux does on a GOAWAY
            done.set()

        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, accept, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            async with open_node() as prober:
                server = DialBackServer(prober, AutoNATConfig())
                server.register()
                addr = Multiaddr.parse(f"/ip4/127.0.0.1/tcp/{port}")
                why = await server._try(addr, probed.peer_id)
            assert why is None
            await done.wait()
            nursery.cancel_scope.cancel()
        assert first_frames == [(GOAWAY, 0, b"dial-back probe")]

    trio.run(main)


def test_after_ok_the_probed_node_talks_on_its_own_connection() -> None:
    async def echo(ctx, request):
        return request

    async def main() -> None:
        # order the two IDs so the probed node's tie-break prefers the prober's connection
        a_id, b_id = Identity.generate(), Identity.generate()
        if min(a_id.peer_id, b_id.peer_id) != b_id.peer_id:
            a_id, b_id = b_id, a_id
        async with open_node(b_id) as prober, open_node(a_id) as probed:
            DialBackServer(prober, AutoNATConfig()).register()
            prober.add_handler("echo", echo)
            await probed.connect(prober.addrs[0])
            for round_ in range(5):
                answer = await ask_dial_back(probed, prober.peer_id, probed.addrs, AutoNATConfig())
                assert answer.status == "ok", answer
                conn = probed.connection_to(prober.peer_id)
                assert conn is not None and conn.outbound  # the probe is gone already
                for i in range(20):
                    assert await probed.call(prober.peer_id, "echo", [round_, i]) == [round_, i]

    trio.run(main)


def test_a_probe_with_nobody_to_ask_says_so(caplog) -> None:
    """A run's first peer logged "reachability unknown from " (the list of answers, empty):
    a new user read it as a truncated line. It names the empty list now."""
    addrs = [Multiaddr.parse("/ip4/127.0.0.1/tcp/1")]
    with caplog.at_level(logging.INFO, logger="p2p.nat.autonat"):
        verdict, answers = trio.run(probe, None, [], addrs, AutoNATConfig())
    assert answers == [] and verdict.value == "unknown"
    assert "reachability unknown from no peer (none to ask yet)" in caplog.text
