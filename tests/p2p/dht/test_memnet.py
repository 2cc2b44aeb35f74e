"""The in-memory network used by DHT simulations: messages take exactly one latency."""

from __future__ import annotations

import trio
import trio.testing

from p2p.dht.memnet import MemoryNetwork


def test_messages_sent_together_arrive_after_one_latency_even_if_one_is_cancelled() -> None:
    """Messages sent at one instant share one timer; cancelling the task that holds it (or a
    waiting one) neither delays nor hastens the others."""

    async def main() -> None:
        net = MemoryNetwork(latency=1.0)
        arrived: dict[str, float] = {}
        t0 = trio.current_time()

        async def send(name: str, cancel_after: float | None = None) -> None:
            if name != "holder":
                await trio.lowlevel.checkpoint()  # same instant, but after the holder
            with trio.CancelScope() as scope:
                if cancel_after is not None:
                    scope.deadline = t0 + cancel_after
                await net.travel()
                arrived[name] = trio.current_time() - t0

        async def later() -> None:
            await trio.sleep(0.5)
            await send("later")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, "holder", 0.3)
            nursery.start_soon(send, "waiter-cancelled", 0.6)
            for name in ("a", "b"):
                nursery.start_soon(send, name)
            nursery.start_soon(later)
        assert arrived == {"a": 1.0, "b": 1.0, "later": 1.5}
        assert not net._arrivals

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
