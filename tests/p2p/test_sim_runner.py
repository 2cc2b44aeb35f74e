"""run_sim, the simulated network's virtual-time runner: a deadlock becomes an error, a
network belongs to one trio.run, and timers due at one instant fire in a repeatable order."""

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


def test_timers_due_at_one_instant_fire_in_the_same_order_in_every_run():
    """Not in the order of the cancel scopes' memory addresses (trio's own tie-break): that
    order differed between processes, and 200-peer soaks with the same seeds diverged. Two
    runs whose scopes lie in memory in different orders wake their tasks in the same order."""

    async def main(layout: tuple[int, ...]) -> list[int]:
        scopes = sorted((trio.CancelScope() for _ in layout), key=id)
        chosen = [scopes[i] for i in layout]  # task k's scope: the layout-th by address
        woke: list[int] = []

        async def sleeper(k: int, scope: trio.CancelScope) -> None:
            with scope:
                scope.deadline = trio.current_time() + 5.0
                await trio.sleep_forever()
            woke.append(k)

        async with trio.open_nursery() as nursery:
            for k, scope in enumerate(chosen):
                nursery.start_soon(sleeper, k, scope)
        return woke

    first = run_sim(main, (5, 0, 9, 3, 11, 1, 7, 2, 10, 4, 8, 6), timeout=60)
    second = run_sim(main, (2, 7, 0, 10, 5, 8, 1, 11, 3, 6, 9, 4), timeout=60)
    assert sorted(first) == list(range(12))
    assert first == second
