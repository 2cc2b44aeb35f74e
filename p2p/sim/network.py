"""The simulated network: hosts, their links, latency, and faults (kill, partition, heal).

Nothing here runs in the background. Time advances only through trio's clock (normally
``trio.testing.MockClock(autojump_threshold=0)``): every operation first brings the
:class:`~p2p.sim.engine.Engine` up to ``trio.current_time()``, and exactly one task blocked in
the simulator (the *keeper*) sleeps until the engine's next event, so link completions and
deliveries fire at their exact virtual times. Blocked tasks are woken by cancelling their
private cancel scope, in event order, which keeps a run deterministic for a given seed.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from p2p.sim.engine import Engine
from p2p.sim.fluid import FluidNet, Link

if TYPE_CHECKING:
    from p2p.sim.stream import Connection
    from p2p.sim.transport import SimListener, SimTransport

logger = logging.getLogger(__name__)


@dataclass
class SimStats:
    """Counters of what went through the network (handy in benchmarks and assertions)."""

    bytes: int = 0
    chunks: int = 0
    dials: int = 0
    failed_dials: int = 0
    connections: int = 0


class SimHost:
    """One machine on the simulated network, with its own access links and transport."""

    def __init__(
        self,
        net: SimNetwork,
        name: str,
        *,
        upload_bps: float,
        download_bps: float,
        latency: float,
        reachable: bool,
    ) -> None:
        if latency < 0:
            raise ValueError(f"latency must be >= 0 seconds, got {latency!r}")
        self.net = net
        self.name = name
        self.uplink: Link = net.fluid.new_link(f"{name}.up", upload_bps)
        self.downlink: Link = net.fluid.new_link(f"{name}.down", download_bps)
        self.latency = float(latency)
        self.reachable = reachable
        self.nat_mapping_timeout: float | None = None
        """Behind a NAT that forgets a connection after this many seconds without traffic
        either way: from then on it silently drops that connection's bytes (None: never)."""
        self.alive = True
        self.listeners: dict[int, SimListener] = {}
        self.connections: dict[Connection, None] = {}
        from p2p.sim.transport import SimTransport

        self.transport: SimTransport = SimTransport(self)

    @property
    def listen_addr(self) -> str:
        """The address to listen on with a port picked by the simulator."""
        return f"/sim/{self.name}/tcp/0"

    def __repr__(self) -> str:
        state = "alive" if self.alive else "dead"
        return f"SimHost({self.name!r}, {state})"


class _Sleeper:
    __slots__ = ("waiter", "fired")

    def __init__(self) -> None:
        self.waiter: trio.CancelScope | None = None
        self.fired = False

    def fire(self) -> None:
        self.fired = True
        if self.waiter is not None:
            self.waiter.cancel()


class SimNetwork:
    """An in-memory network of :class:`SimHost` s; use it inside one ``trio.run``.

    ``buffer_bytes`` is the per-direction socket buffer (bytes written but not yet read, not
    counting those in propagation; ``max_inflight_bytes`` bounds the latter on infinite links);
    with ``silent_failures`` a dial to a dead, unreachable or partitioned host hangs until the
    caller's timeout instead of failing at once (as a SYN into the void does); ``record=True``
    keeps an event list in :attr:`trace` for determinism checks.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        buffer_bytes: int = 512 * 1024,
        max_inflight_bytes: int = 64 * 1024 * 1024,
        silent_failures: bool = False,
        record: bool = False,
    ) -> None:
        if buffer_bytes <= 0:
            raise ValueError("buffer_bytes must be positive")
        self.seed = seed
        self.rng = random.Random(seed)
        self.buffer_bytes = buffer_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.silent_failures = silent_failures
        self.engine = Engine(on_new_head=self._refresh_keeper)
        self.fluid = FluidNet(self.engine)
        self.hosts: dict[str, SimHost] = {}
        self.stats = SimStats()
        self.trace: list[tuple] | None = [] if record else None
        self._latency_override: dict[frozenset[str], float] = {}
        self._partitions: list[tuple[frozenset[str], frozenset[str]]] = []
        self._waiters: dict[trio.CancelScope, None] = {}
        self._keeper: trio.CancelScope | None = None

    # -- topology --------------------------------------------------------------------------

    def add_host(
        self,
        name: str | None = None,
        *,
        upload_bps: float = math.inf,
        download_bps: float = math.inf,
        latency: float = 0.0,
        reachable: bool = True,
    ) -> SimHost:
        """Add a host; bandwidths in bytes/s, ``latency`` one-way seconds of its access link.

        ``reachable=False`` models a host behind NAT: it dials out but accepts no dials.
        """
        if name is None:
            name = f"h{len(self.hosts)}"
        if not name or "/" in name or any(c.isspace() for c in name):
            raise ValueError(f"invalid host name {name!r}")
        if name in self.hosts:
            raise ValueError(f"host {name!r} already exists")
        host = SimHost(
            self,
            name,
            upload_bps=upload_bps,
            download_bps=download_bps,
            latency=latency,
            reachable=reachable,
        )
        self.hosts[name] = host
        return host

    def host(self, ref: SimHost | str) -> SimHost:
        if isinstance(ref, SimHost):
            if ref.net is not self:
                raise ValueError(f"{ref!r} belongs to another network")
            return ref
        try:
            return self.hosts[ref]
        except KeyError:
            raise KeyError(f"no simulated host {ref!r}") from None

    def latency(self, a: SimHost, b: SimHost) -> float:
        """One-way delay a -> b: a pairwise override, else the sum of both access latencies."""
        if self._latency_override:
            v = self._latency_override.get(frozenset((a.name, b.name)))
            if v is not None:
                return v
        return a.latency + b.latency

    def set_latency(self, a: SimHost | str, b: SimHost | str, seconds: float) -> None:
        """Override the one-way delay between two hosts (both directions)."""
        if seconds < 0:
            raise ValueError("latency must be >= 0")
        self._latency_override[frozenset((self.host(a).name, self.host(b).name))] = seconds

    def set_bandwidth(
        self,
        host: SimHost | str,
        upload_bps: float | None = None,
        download_bps: float | None = None,
    ) -> None:
        """Change a host's link capacities; flows in progress adapt from now on."""
        h = self.host(host)
        self._settle()
        if upload_bps is not None:
            self.fluid.set_capacity(h.uplink, upload_bps)
        if download_bps is not None:
            self.fluid.set_capacity(h.downlink, download_bps)
        self._refresh_keeper()

    # -- faults ----------------------------------------------------------------------------

    def kill(self, host: SimHost | str) -> None:
        """Take a host off the network: its connections reset on both sides, dials fail."""
        h = self.host(host)
        self._settle()
        h.alive = False
        self._record("kill", h.name)
        logger.debug("sim: kill %s (%d connections)", h.name, len(h.connections))
        for conn in list(h.connections):
            conn.reset(f"host {h.name} died")
        self._refresh_keeper()

    def revive(self, host: SimHost | str) -> None:
        """Bring a killed host back; listeners still running on it accept again."""
        h = self.host(host)
        h.alive = True
        self._record("revive", h.name)

    def partition(self, group_a: Iterable[SimHost | str], group_b: Iterable[SimHost | str]) -> None:
        """Cut every path between the two groups (hosts in neither are unaffected)."""
        a = frozenset(self.host(x).name for x in group_a)
        b = frozenset(self.host(x).name for x in group_b)
        if a & b:
            raise ValueError(f"hosts in both groups: {sorted(a & b)}")
        self._settle()
        self._partitions.append((a, b))
        self._record("partition", tuple(sorted(a)), tuple(sorted(b)))
        for name in sorted(a):
            for conn in list(self.hosts[name].connections):
                if not self.can_reach(conn.a, conn.b):
                    conn.reset("network partition")
        self._refresh_keeper()

    def heal(self) -> None:
        """Remove every partition (connections already broken stay broken)."""
        self._partitions.clear()
        self._record("heal")

    def can_reach(self, a: SimHost, b: SimHost) -> bool:
        """Whether packets can flow between a and b now (both alive, not partitioned)."""
        if not (a.alive and b.alive):
            return False
        for ga, gb in self._partitions:
            if (a.name in ga and b.name in gb) or (a.name in gb and b.name in ga):
                return False
        return True

    # -- time and waiting (used by streams and transports) ----------------------------------

    def _settle(self) -> None:
        """Fire every event due by trio's current time."""
        now = trio.current_time()
        if now < self.engine.now:
            raise RuntimeError(
                "trio's clock is behind this SimNetwork's: use one network per trio.run"
            )
        self.engine.run_until(now)

    async def _wait(self, owner: object, attr: str) -> None:
        """Block until ``owner.<attr>`` (a cancel scope) is cancelled by a notifier.

        This is the task's checkpoint. If this task is the keeper it also wakes at the engine's
        next event time.
        """
        scope = trio.CancelScope()
        setattr(owner, attr, scope)
        self._waiters[scope] = None
        try:
            with scope:
                self._refresh_keeper()
                await trio.sleep_forever()
        finally:
            setattr(owner, attr, None)
            del self._waiters[scope]
            if self._keeper is scope:
                self._keeper = None
                # do what woke us (an event, or rates to recompute) before handing on the deadline
                self._settle()
                if self.fluid.flush():
                    self._settle()
                self._refresh_keeper()

    def _refresh_keeper(self) -> None:
        """Give the next event's deadline to one waiting task: the one it wakes, if waiting."""
        if not self._waiters:
            self._keeper = None
            return
        if self.fluid.has_pending():  # rates to recompute before time moves: wake a keeper now
            if self._keeper is None:
                self._keeper = next(iter(self._waiters))
            self._keeper.deadline = self.engine.now
            return
        ev = self.engine.peek()
        if ev is None:
            if self._keeper is not None:
                self._keeper.deadline = math.inf
            return
        target = getattr(ev.owner, "waiter", None) if ev.owner is not None else None
        keeper = self._keeper
        if target is not None and target is not keeper and target in self._waiters:
            if keeper is not None:
                keeper.deadline = math.inf
            self._keeper = keeper = target
        elif keeper is None:
            self._keeper = keeper = next(iter(self._waiters))
        keeper.deadline = ev.time

    async def sleep_until(self, t: float) -> None:
        """Sleep in the simulator's event order (deterministic ties, unlike trio deadlines)."""
        sleeper = _Sleeper()
        self._settle()
        if t <= self.engine.now:
            await trio.lowlevel.checkpoint()
            return
        ev = self.engine.at(t, sleeper.fire, owner=sleeper)
        try:
            while not sleeper.fired:
                await self._wait(sleeper, "waiter")
                self._settle()
        finally:
            ev.cancel()

    async def sleep(self, seconds: float) -> None:
        self._settle()
        await self.sleep_until(self.engine.now + seconds)

    def _record(self, kind: str, *details: object) -> None:
        if self.trace is not None:
            self.trace.append((self.engine.now, kind, *details))

    def __repr__(self) -> str:
        return f"SimNetwork(seed={self.seed}, hosts={len(self.hosts)})"
