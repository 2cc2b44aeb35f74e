"""``--announce``: a peer behind a port forward is reached by the run at its announced address.

The p2p-level behaviour (DHT routing tables) is in tests/p2p/test_announce.py; here the whole
example path: ``NetConfig.announce`` -> ``dedloc_jax.Collaboration(announce=...)`` -> the
addresses in the collaboration's records (state announcements) that a newcomer dials.
"""

from __future__ import annotations

import socket
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import trio

from examples.sahajbert import trainer
from examples.sahajbert.config import NetConfig, TrainerConfig
from p2p.bridge import TrioThread
from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr
from tests.p2p.test_announce import Forwarder, start_forwarder


def _free_port() -> int:
    """A loopback port nobody listens on now. (The forwarder must know A's port before A
    starts: A's reachability check dials its announced address during start-up.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _serve_forwarder(port: int, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    async with trio.open_nursery() as nursery:
        fwd = await start_forwarder(nursery)
        fwd.target_port = port
        task_status.started(fwd)
        await trio.sleep_forever()


def test_a_peer_behind_a_port_forward_is_reached_at_its_announced_address(tmp_path: Path) -> None:
    cfg = TrainerConfig.demo(tmp_path).replace(run_id="announce-test")
    port = _free_port()
    with TrioThread("forwarder") as thread:
        fwd: Forwarder = thread.start_service(_serve_forwarder, port)
        # all on loopback: a dial-back goes only to the IP a peer is seen from (127.0.0.1 here)
        loopback = NetConfig(listen=("/ip4/127.0.0.1/tcp/0",))
        with closing(trainer.open_collaboration(cfg, loopback)) as coord:
            join = (trainer.dialable(coord)[0],)
            net_a = NetConfig(
                initial_peers=join, listen=(f"/ip4/127.0.0.1/tcp/{port}",), announce=(fwd.addr,)
            )
            with closing(trainer.open_collaboration(cfg, net_a)) as a:
                announced = f"{fwd.addr}/p2p/{a.peer_id}"
                assert a.addrs == [announced]  # not the listen address
                state = [np.arange(1000, dtype=np.float32), np.ones((3, 4), np.float32)]
                a.share_state(state, 7)
                with closing(trainer.open_collaboration(cfg, NetConfig(initial_peers=join))) as b:
                    epoch, arrays = b.load_state(timeout=30)
                    assert epoch == 7
                    assert all(np.array_equal(x, y) for x, y in zip(arrays, state, strict=True))

                    async def b_dials_a(core: Any) -> Multiaddr | None:
                        # A may have dialed B first (its DHT work): then B used A's connection
                        # and dialed nothing, so close it and let B dial A as it knows A
                        pid = PeerID.from_base58(a.peer_id)
                        for _ in range(5):
                            conn = core.node.connection_to(pid)
                            if conn is not None and conn.outbound:
                                return conn.remote_addr
                            if conn is not None:
                                await core.node.disconnect(pid)
                            await core.node.connect(pid)
                        return None

                    remote = b.run_async(b_dials_a)
                    assert remote is not None  # B dialed A itself
                    assert remote.transport_part() == Multiaddr.parse(fwd.addr)  # the forwarder
                    assert fwd.connections >= 1
