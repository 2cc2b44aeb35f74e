"""After a round: convicting, publishing and adopting bans (dedloc_jax.rounds.average)."""

from __future__ import annotations

from types import SimpleNamespace

import trio
import trio.testing

from dedloc_jax.averaging import AllReduceResult
from dedloc_jax.rounds.average import Averager


def test_a_round_returns_before_others_bans_are_read() -> None:
    """Reading the others' bans after a round is a DHT lookup (0.17 s at 40 peers, blocking
    PowerSGD): every member waited for its own before computing again. It goes on in the
    background: the round returns first, and the bans are still read."""
    reads: list[str] = []

    class Bans:
        def convict(self, accusation: object) -> None:
            raise AssertionError("a clean round convicts nobody")

        async def publish(self) -> None:
            reads.append("published")

        async def refresh(self) -> None:
            await trio.sleep(0.2)  # a lookup
            reads.append("read")

    async def main() -> list[str]:
        async with trio.open_nursery() as nursery:
            node = SimpleNamespace(start_soon=nursery.start_soon)
            rounds = Averager(
                SimpleNamespace(node=node),  # type: ignore[arg-type]
                None,  # type: ignore[arg-type]
                None,  # type: ignore[arg-type]
                None,  # type: ignore[arg-type]
                SimpleNamespace(dht_latency=0.05),  # type: ignore[arg-type]
                bans=Bans(),  # type: ignore[arg-type]
            )
            await rounds.convict(AllReduceResult(None, None, ()))
            reads.append("returned")
        return reads

    reads = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert reads == ["published", "returned", "read"]
