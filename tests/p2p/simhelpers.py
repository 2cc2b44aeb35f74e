"""Helpers shared by the simulated-network tests (tests/p2p/test_sim_*.py)."""

from __future__ import annotations

import trio

from p2p.multiaddr import Multiaddr

MB = 1_000_000


async def _collect(stream: trio.abc.Stream, out: bytearray, max_bytes: int | None = None) -> None:
    while True:
        data = await stream.receive_some(max_bytes)
        if not data:
            return
        out.extend(data)


class Sink:
    """A listener that stores what each inbound connection sends, with finish times."""

    def __init__(self) -> None:
        self.received: dict[str, bytearray] = {}
        self.done_at: dict[str, float] = {}
        self.streams: list[trio.abc.Stream] = []

    async def handler(self, stream: trio.abc.Stream, remote: Multiaddr | None) -> None:
        key = str(remote)
        buf = self.received.setdefault(key, bytearray())
        self.streams.append(stream)
        try:
            await _collect(stream, buf)
        except trio.BrokenResourceError:
            return
        self.done_at[key] = trio.current_time()


async def _listen(nursery: trio.Nursery, host, handler) -> Multiaddr:
    return await nursery.start(host.transport.listen, Multiaddr.parse(host.listen_addr), handler)


async def _keep(store: list, stream: trio.abc.Stream) -> None:
    store.append(stream)
    await trio.sleep_forever()


async def _first(store: list) -> trio.abc.Stream:
    """The first accepted stream, once the listener's handler task has run."""
    while not store:
        await trio.sleep(0)
    return store[0]
