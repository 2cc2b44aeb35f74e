"""Helpers for running the p2p stack on the simulated network (part of the product).

``run_sim(main)`` runs ``main`` under ``trio.testing.MockClock(autojump_threshold=0)``, so
virtual time jumps ahead whenever every task is blocked; ``open_sim_nodes`` starts real nodes
on simulated hosts. Everything in :mod:`p2p.sim` is re-exported here.
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import trio
import trio.testing

from p2p.identity import Identity
from p2p.mux_config import MuxConfig
from p2p.mux_stream import Frames, MuxStream
from p2p.sim import (
    Connection,
    SimHost,
    SimListener,
    SimNetwork,
    SimStats,
    SimStream,
    SimTransport,
)

if TYPE_CHECKING:
    from p2p.node import Node, NodeConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _seed_trio_scheduler(seed: int) -> None:
    """Make trio's scheduling order reproducible.

    trio shuffles each batch of runnable tasks with a module-level ``random.Random`` to flush
    out ordering assumptions; seeding it makes a simulated run repeat exactly. This reaches
    into trio's internals, so it degrades to a no-op if they change.
    """
    core = getattr(trio, "_core", None)
    run_mod = getattr(core, "_run", None)
    rnd = getattr(run_mod, "_r", None)
    if isinstance(rnd, random.Random):
        rnd.seed(seed)
    else:  # pragma: no cover - depends on trio's internals
        logger.warning("cannot seed trio's scheduler; runs may not repeat exactly")


def run_sim(
    async_fn: Callable[..., Awaitable[T]],
    *args: Any,
    seed: int | None = 0,
    timeout: float | None = None,
) -> T:
    """``trio.run(async_fn, *args)`` in virtual time; returns its result.

    With ``seed`` (default 0) trio's scheduler and the ``random`` module are seeded too, so a
    simulation whose code uses only ``SimNetwork(seed)`` and ``random`` randomness repeats
    event for event; ``seed=None`` leaves them alone.
    ``timeout`` (virtual seconds) raises :class:`trio.TooSlowError` past it: use it where a bug
    could leave every task blocked with no deadline, which under an autojumping MockClock
    otherwise spins in real time until the test runner's own timeout.
    """
    if seed is not None:
        _seed_trio_scheduler(seed)
        random.seed(seed)  # e.g. the DHT's bucket refreshes look up random IDs

    async def main() -> T:
        with trio.fail_after(math.inf if timeout is None else timeout):
            return await async_fn(*args)
        raise AssertionError("unreachable")  # pragma: no cover - fail_after raises

    with _rare_collections(), _ordered_deadlines():
        return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@contextmanager
def _ordered_deadlines() -> Iterator[None]:
    """Expire timers that fall due at the same instant in the order they were set.

    trio breaks ties between equal deadlines by ``id()`` of the cancel scope, a memory
    address that differs between processes, and under a MockClock many peers wake at one
    instant: a counter in place of the address makes a seed fix the run. This reaches into
    trio's internals, so it does nothing if they change.
    """
    run_mod = getattr(getattr(trio, "_core", None), "_run", None)
    deadlines = getattr(run_mod, "Deadlines", None)
    original = getattr(deadlines, "add", None)
    if deadlines is None or original is None or not hasattr(run_mod, "heappush"):
        logger.warning("cannot order trio's deadlines; runs may not repeat exactly")
        yield
        return
    counter = itertools.count()
    push = run_mod.heappush

    def add(self: Any, deadline: float, cancel_scope: Any) -> None:
        push(self._heap, (deadline, next(counter), cancel_scope))
        self._active += 1

    deadlines.add = add
    try:
        yield
    finally:
        deadlines.add = original


SIM_GC_THRESHOLDS = (50_000, 50, 100)
"""Collector thresholds while a simulation runs (the default is (700, 10, 10))."""


@contextmanager
def _rare_collections() -> Iterator[None]:
    """Run the cyclic garbage collector rarely while simulating.

    Hundreds of nodes in one process hold millions of live objects and allocate fast (every
    trio checkpoint, frame and cancel scope), so the default thresholds (a young collection
    every 700 allocations) spend much of the CPU scanning them. Nearly all of it is freed by
    reference counting; a young collection
    every 50,000 allocations still frees the cycles (tracebacks, cancelled tasks) in time.
    """
    before = gc.get_threshold()
    gc.set_threshold(*SIM_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def sim_identity(net: SimNetwork, index: int) -> Identity:
    """A deterministic identity for the ``index``-th node of a network with this seed."""
    return Identity.from_seed(f"sim-identity/{net.seed}/{index}".encode())


@asynccontextmanager
async def open_sim_nodes(
    net: SimNetwork,
    n: int,
    *,
    identities: Sequence[Identity] | None = None,
    config: NodeConfig | None = None,
    names: Sequence[str] | None = None,
    **host_kwargs: Any,
) -> AsyncIterator[list[Node]]:
    """Start ``n`` nodes, each on a new host of ``net`` (``host_kwargs`` go to ``add_host``).

    Each node's host is available as ``net.hosts[name]``; node ``i`` listens on its host's
    simulated address, and all nodes stop when the block exits.
    """
    from p2p.node import NodeConfig, open_node  # lazy: the node layer sits above us

    if identities is not None and len(identities) < n:
        raise ValueError(f"need {n} identities, got {len(identities)}")
    if names is not None and len(names) < n:
        raise ValueError(f"need {n} names, got {len(names)}")
    cfg = config if config is not None else NodeConfig()
    base = len(net.hosts)
    async with AsyncExitStack() as stack:
        nodes: list[Node] = []
        for i in range(n):
            host = net.add_host(names[i] if names is not None else None, **host_kwargs)
            ident = identities[i] if identities is not None else sim_identity(net, base + i)
            node = await stack.enter_async_context(
                open_node(ident, transport=host.transport, listen=[host.listen_addr], config=cfg)
            )
            nodes.append(node)
        yield nodes


def host_of(net: SimNetwork, node: Node) -> SimHost:
    """The simulated host a node listens on (from its first ``/sim/`` address)."""
    for addr in node.addrs:
        name = addr.value_of("sim")
        if name is not None:
            return net.hosts[name]
    raise ValueError(f"{node!r} has no simulated address")


class _ReadOnlyHost:
    """The mux behind :func:`received_stream`: grants and releases go nowhere, sends fail."""

    def __init__(self, config: MuxConfig) -> None:
        self.config = config
        self.max_payload = self.max_bulk = config.max_frame_payload
        self.bulk_min = config.max_frame_payload

    def raise_if_closed(self) -> None:
        pass

    async def send_stream_frames(self, stream: MuxStream, frames: Frames) -> None:
        raise trio.ClosedResourceError("a received_stream only receives")

    def grant(self, stream_id: int, increment: int) -> None:
        pass

    def queue_reset(self, stream_id: int, reason: str) -> None:
        pass

    def release(self, n: int) -> None:
        pass

    def stream_ended(self, stream: MuxStream) -> None:
        pass


def received_stream(
    pieces: Sequence[bytes | bytearray | memoryview] = (), *, eof: bool = True
) -> MuxStream:
    """An inbound mux stream that has received ``pieces`` (and then EOF if ``eof``), each as
    the mux queues a frame's payload, so decoders read them through the production path.

    A piece that is a ``bytes`` object arrives as a BULK frame delivers it (whole, no copy);
    wrap it in a memoryview slice to mimic a DATA frame's payload. More can be queued later
    with ``stream.queue_received`` and ``stream.on_remote_eof``.
    """
    stream = MuxStream(_ReadOnlyHost(MuxConfig()), 1, outbound=False)
    for piece in pieces:
        if len(piece):
            stream.queue_received(memoryview(piece).cast("B"))
    if eof:
        stream.on_remote_eof()
    return stream


__all__ = [
    "Connection",
    "SimHost",
    "SimListener",
    "SimNetwork",
    "SimStats",
    "SimStream",
    "SimTransport",
    "host_of",
    "open_sim_nodes",
    "received_stream",
    "run_sim",
    "sim_identity",
]
