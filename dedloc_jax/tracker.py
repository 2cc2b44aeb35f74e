"""The progress tracker: publish this peer's progress, read everyone's, keep an estimate.

Each peer writes one signed subkey (``[owner:<peer-id>]``) under ``<run_id>.progress``; nobody
else can overwrite it, and it expires ``progress_ttl`` seconds after the peer's last report, so
a vanished peer stops counting. Reads happen every :func:`~dedloc_jax.progress.refresh_delay`
seconds: rarely far from the target, often near it.
"""

from __future__ import annotations

import logging
import math

import trio

from dedloc_jax.config import CollaborationConfig
from dedloc_jax.progress import (
    CollaborationEstimate,
    PeerProgress,
    ThroughputMeter,
    estimate_collaboration,
    refresh_delay,
)
from p2p.dht import DHT, InvalidRecordError
from p2p.dht.records import owner_marker, owner_markers
from p2p.errors import P2PError

log = logging.getLogger(__name__)


def progress_key(run_id: str) -> str:
    return f"{run_id}.progress"


class ProgressTracker:
    """Owned by a collaboration; :meth:`run` is its background task."""

    def __init__(self, dht: DHT, run_id: str, config: CollaborationConfig, mode: str) -> None:
        self.dht = dht
        self.run_id = run_id
        self.config = config
        self.mode = mode
        self.peer_id = str(dht.peer_id)
        self.epoch = 0
        self.samples = 0
        self.meter = ThroughputMeter(half_life=10.0)
        self.records: dict[str, PeerProgress] = {}
        self.estimate = estimate_collaboration(
            [], now=0.0, target_batch_size=config.target_batch_size
        )
        self._wake = trio.Event()
        self._published_at = -math.inf
        self._published_epoch = -1
        self._frozen = False
        self.step_interval = 0.0
        self._last_report: float | None = None
        self.dht_latency = 0.05  # smoothed seconds per DHT read, for deadlines

    # --- called by the collaboration (inside the trio loop) -------------------------------
    def report(self, epoch: int, samples: int, batch_size: int) -> None:
        """Record local progress; wakes the publisher when the peer moves to a new epoch."""
        now = trio.current_time()
        self.meter.update(batch_size, now)
        if self._last_report is not None:
            dt = now - self._last_report
            self.step_interval = (
                dt if self.step_interval == 0 else 0.7 * self.step_interval + 0.3 * dt
            )
        self._last_report = now
        new_epoch = epoch != self.epoch
        self.epoch, self.samples = epoch, samples
        if new_epoch:
            self._wake.set()

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` with no samples; the time spent averaging is not training time."""
        self.epoch, self.samples = epoch, 0
        self._frozen = False
        self.meter.pause()
        self._last_report = None
        self._wake.set()

    async def freeze(self) -> None:
        """Publish that this peer stopped accumulating (it is averaging): rate zero."""
        self._frozen = True
        await self.publish()

    def own_progress(self) -> PeerProgress:
        return PeerProgress(
            self.peer_id,
            self.epoch,
            self.samples,
            0.0 if self._frozen else self.meter.samples_per_second,
            self.dht.now(),
            self.mode,
            self.step_interval,
        )

    def current_estimate(self) -> CollaborationEstimate:
        """The estimate extrapolated to now, with this peer's own progress exact."""
        records = dict(self.records)
        records[self.peer_id] = self.own_progress()
        return estimate_collaboration(
            records.values(),
            now=self.dht.now(),
            target_batch_size=self.config.target_batch_size,
            max_extrapolation=self.config.max_refresh * 2 if self.config.extrapolate else 0.0,
        )

    # --- DHT I/O -----------------------------------------------------------------------
    async def publish(self) -> None:
        me = self.own_progress()
        try:
            await self.dht.store(
                progress_key(self.run_id),
                me.to_record(),
                self.dht.now() + self.config.progress_ttl,
                subkey=owner_marker(self.dht.peer_id),
            )
            self._published_at = trio.current_time()
            self._published_epoch = me.epoch
        except (P2PError, InvalidRecordError) as e:
            log.warning("could not publish progress: %s", e)

    async def fetch(self) -> CollaborationEstimate:
        started = trio.current_time()
        try:
            value = await self.dht.get(progress_key(self.run_id))
        except P2PError as e:
            log.warning("could not read progress: %s", e)
            value = None
        self.dht_latency += 0.2 * (trio.current_time() - started - self.dht_latency)
        records: dict[str, PeerProgress] = {}
        if isinstance(value, dict):
            for subkey, item in value.items():
                names = owner_markers(subkey)
                if len(names) != 1:
                    continue
                try:
                    records[names[0]] = PeerProgress.from_record(names[0], item.value)
                except ValueError as e:
                    log.info("ignoring malformed progress of %s: %s", names[0], e)
        self.records = records
        self.estimate = self.current_estimate()
        return self.estimate

    async def refresh(self) -> CollaborationEstimate:
        await self.publish()
        return await self.fetch()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.refresh()
        task_status.started()
        while True:
            delay = refresh_delay(
                self.current_estimate(),
                min_delay=self.config.min_refresh,
                max_delay=self.config.max_refresh,
            )
            with trio.move_on_after(delay):
                await self._wake.wait()
            self._wake = trio.Event()
            # Others extrapolate from our rate, so far from the target a report every couple
            # of refresh periods suffices; a new epoch is published at once.
            # Near the target every refresh publishes, so that others' sums stay exact.
            stale = trio.current_time() - self._published_at > 2 * self.config.max_refresh
            near = self.estimate.eta < 3 * self.config.max_refresh
            if stale or near or self._published_epoch != self.epoch:
                await self.publish()
            await self.fetch()
