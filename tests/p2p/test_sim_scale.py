"""The simulated network at scale (hundreds of hosts) and its determinism: same seed, same
trace."""

from __future__ import annotations

import random

import pytest
import trio

from p2p.testing import SimNetwork, run_sim
from tests.p2p.simhelpers import MB, _collect, _listen


async def _gossip(seed: int, n_hosts: int, fanout: int, messages: int) -> tuple[list, list, dict]:
    """Every host sends ``messages`` small messages to ``fanout`` random others, over links
    of random speed and latency; returns (delivery log, network trace, stats)."""
    net = SimNetwork(seed=seed, record=True)
    rng = random.Random(seed)
    hosts = [
        net.add_host(
            upload_bps=rng.choice([1, 5, 20]) * MB / 8,
            download_bps=rng.choice([5, 20, 100]) * MB / 8,
            latency=rng.uniform(0.005, 0.1),
        )
        for _ in range(n_hosts)
    ]
    log: list[tuple[float, str, str, int]] = []

    async with trio.open_nursery() as nursery:
        addrs = []
        for h in hosts:

            async def handler(stream, remote, h=h):
                buf = bytearray()
                await _collect(stream, buf)
                assert len(buf) % 100 == 0
                log.append((trio.current_time(), str(remote.value_of("sim")), h.name, len(buf)))

            addrs.append(await _listen(nursery, h, handler))

        async def talk(src, dst_index):
            stream = await src.transport.dial(addrs[dst_index])
            for i in range(messages):
                await stream.send_all(bytes([i % 256]) * 100)
                await net.sleep(rng.uniform(0, 0.05))
            await stream.aclose()

        async with trio.open_nursery() as talkers:
            for i, h in enumerate(hosts):
                for j in rng.sample([k for k in range(n_hosts) if k != i], fanout):
                    talkers.start_soon(talk, h, j)
        while len(log) < n_hosts * fanout:
            await net.sleep(0.1)
        nursery.cancel_scope.cancel()
    return log, net.trace, vars(net.stats)


def test_200_hosts_exchange_messages():
    log, _, stats = run_sim(_gossip, 0, 200, 3, 5)
    assert len(log) == 600
    assert all(n == 500 for *_, n in log)
    assert stats["bytes"] == 200 * 3 * 5 * 100
    assert stats["connections"] == 600


def test_same_seed_same_trace():
    first = run_sim(_gossip, 3, 30, 3, 5, seed=11)
    second = run_sim(_gossip, 3, 30, 3, 5, seed=11)
    assert first == second
    assert first[1]  # the trace is not empty
    other = run_sim(_gossip, 4, 30, 3, 5, seed=11)
    assert other[1] != first[1]


@pytest.mark.slow
def test_500_hosts_exchange_messages():
    log, _, stats = run_sim(_gossip, 1, 500, 4, 5)
    assert len(log) == 2000
    assert stats["bytes"] == 500 * 4 * 5 * 100
