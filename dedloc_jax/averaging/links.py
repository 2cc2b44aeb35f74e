"""This peer's link figures for its rounds: the meter read with its fallbacks, and probes run
when a round will need a fresh figure (:class:`LinkKeeper`)."""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import trio

from dedloc_jax.averaging.bandwidth import (
    UNMEASURED_DOWNLOAD_BPS,
    UNMEASURED_UPLOAD_BPS,
    BandwidthMeter,
    LinkFigures,
    LinkLocks,
    measure_links,
)
from p2p.errors import P2PError
from p2p.identity import PeerID
from p2p.node import Node

log = logging.getLogger(__name__)


class ProgressTable(Protocol):
    """What the keeper reads of the progress table (a :class:`~dedloc_jax.tracker.
    ProgressTracker`): whom to probe, when the next round comes, how this peer takes part."""

    mode: str

    @property
    def records(self) -> Mapping[str, Any]: ...

    def current_estimate(self) -> Any: ...


class LinkKeeper:
    """Measures this peer's links for the rounds that use the figures.

    ``locks``: the node's link locks (its probe server's too); ``unmeasured``: the (upload,
    download) bytes/s a direction not measured yet counts as (a
    slow home link, so deadlines computed from it are long enough); ``rpc_timeout`` bounds a
    probe (six of them)."""

    def __init__(
        self,
        node: Node,
        meter: BandwidthMeter,
        locks: LinkLocks,
        table: ProgressTable,
        *,
        probe_bytes: int,
        rpc_timeout: float,
        unmeasured: tuple[float | None, float | None] = (None, None),
    ) -> None:
        self.node = node
        self.meter = meter
        self.locks = locks
        self.table = table
        self.probe_bytes = probe_bytes
        self.rpc_timeout = rpc_timeout
        self.unmeasured = (
            unmeasured[0] or UNMEASURED_UPLOAD_BPS,
            unmeasured[1] or UNMEASURED_DOWNLOAD_BPS,
        )
        self._averaging = 0  # rounds of ours in progress (no probe meanwhile)

    def bandwidth(self) -> tuple[float, float]:
        """Measured (or overridden) link speeds, an unmeasured one as ``unmeasured`` says (see
        :class:`~dedloc_jax.rounds.deadlines.Deadlines`)."""
        f = self.meter.figures()
        return f.upload_bps or self.unmeasured[0], f.download_bps or self.unmeasured[1]

    def figures(self) -> LinkFigures:
        """This peer's published link figures: measured up and down (bytes/s), their age."""
        return self.meter.figures()

    @contextlib.contextmanager
    def averaging(self) -> Iterator[None]:
        """While a round of ours runs: the round's traffic and a probe's would slow each other."""
        self._averaging += 1
        try:
            yield
        finally:
            self._averaging -= 1

    async def probe(self, *, nbytes: int = 4 << 20, max_peers: int = 8) -> LinkFigures:
        """Measure this peer's links against a few peers of the run whose progress we read
        (reachable ones, in a per-peer random order): on joining, or when ``meter.stale()``.
        Not a trainer whose record says it left (averages no more): it is gone or about to
        go, and each probe after a clean leave logged the partner unreachable."""
        me = str(self.node.peer_id)
        rng = random.Random(me)
        records = self.table.records
        peers = sorted(
            pid
            for pid, r in records.items()
            if pid != me and r.mode != "client" and (r.averages or r.mode == "aux")
        )
        rng.shuffle(peers)
        if not peers:
            return self.meter.figures()
        return await measure_links(
            self.node,
            [PeerID.from_base58(p) for p in peers],
            self.meter,
            locks=self.locks,
            nbytes=nbytes,
            max_peers=max_peers,
            timeout=self.rpc_timeout * 6,
        )

    async def keep_measured(
        self,
        *,
        nbytes: int | None = None,
        poll: float = 5.0,
        probes: int = 2,
        lead: float | None = None,
    ) -> None:
        """Probe this peer's links once other peers are known and the next averaging is less
        than ``lead`` seconds away (None: a quarter of the meter's window), ``probes`` times
        at random moments ``poll`` to ``3 * poll`` apart, and again before each later
        averaging whose round would find the figure stale (``nbytes``: ``probe_bytes`` unless
        given). Probes of peers that start together contend for the same links and read low;
        the figure is their max, so one probe that ran alone suffices.

        Only a round uses the figure, so probes wait for one (with diloco's outer steps hours
        apart, probing at every expiry would send more than the averaging). Within ``lead`` of
        the round the new figure lasts through it even if it comes later than predicted. A
        peer that sees no rate at all (nothing to predict from) probes on joining. A client
        reduces nothing, so it probes nothing (while it is one)."""
        me = str(self.node.peer_id)
        rng = random.Random(me)
        nbytes = self.probe_bytes if nbytes is None else nbytes
        lead = self.meter.window / 4 if lead is None else lead
        done = 0
        while True:
            await trio.sleep(rng.uniform(poll, 3 * poll) if done else rng.uniform(0, poll))
            known = any(pid != me for pid in self.table.records)
            eta = self.table.current_estimate().eta
            f = self.meter.figures()
            stale = max(f.upload_age, f.download_age) + eta > self.meter.window  # at the round
            due = eta < lead and stale or done < probes and (eta < lead or math.isinf(eta))
            if known and due and self.table.mode != "client" and not self._averaging:
                try:
                    figures = await self.probe(nbytes=nbytes)
                except (ValueError, trio.TooSlowError, P2PError) as e:
                    log.info("probing our links failed: %r", e)
                else:
                    # A probe counts once it measured both ways (partners may all be busy
                    # when we upload, and the uplink went unmeasured for a whole window).
                    if figures.upload_bps is not None and figures.download_bps is not None:
                        done += 1
            if done >= probes and not due and math.isfinite(eta):
                await trio.sleep(min(self.meter.window / 4, max(0.0, eta - lead)))
