"""run_sim, the simulated network's virtual-time runner: a deadlock becomes an error, and a
network belongs to one trio.run."""

from __future__ import annotations

import pytest
import trio

from p2p.testing import SimNetwork, run_sim
from tests.p2p.simhelpers import _keep, _listen


def test_run_sim_timeout_turns_a_deadlock_into_an_error():
    async def stuck():
        await trio.Event().wait()  # nothing will ever set it, and no deadline is pending

    with pytest.raises(trio.TooSlowError):
        run_sim(stuck, timeout=60)
    assert run_sim(trio.sleep, 5, timeout=60) is None


def test_one_network_per_trio_run():
    net = SimNetwork()
    a, b = net.add_host("a"), net.add_host("b")

    async def main():
        async with trio.open_nursery() as nursery:
            addr = await _listen(nursery, b, lambda s, r: _keep([], s))
            await net.sleep(5)
            await a.transport.dial(addr)
            nursery.cancel_scope.cancel()

    run_sim(main)
    with pytest.raises(RuntimeError, match="one network per trio.run"):
        run_sim(net.sleep, 1.0)  # a new run's clock starts behind this network's
