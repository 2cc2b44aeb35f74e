"""Per-peer training metrics, published signed in the DHT for the coordinator to aggregate.

Every trainer stores one record under ``<run_id>.metrics`` in its own owner-marked subkey
(``[owner:<peer-id>]``): the DHT only accepts it signed by that peer, so nobody can report loss
or throughput in another's name. The record carries the peer's recent per-epoch figures
(``history``: epoch, mean loss, samples), so a coordinator that polls less often than epochs
pass still sees every epoch. Records expire when a peer stops publishing.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from p2p.dht import owner_marker
from p2p.dht.records import owner_markers

log = logging.getLogger(__name__)

HISTORY = 16  # epochs of history kept in a record
ROW_LAG = 3  # epochs after which a row is final even if a peer did not report it


def metrics_key(run_id: str) -> str:
    return f"{run_id}.metrics"


def checkpoint_key(run_id: str) -> str:
    """Where the coordinator announces its newest saved checkpoint (epoch and path)."""
    return f"{run_id}.checkpoint"


@dataclass(frozen=True)
class EpochFigures:
    """What one peer did during one collaboration epoch."""

    epoch: int
    loss: float  # mean training loss over its micro-batches of that epoch
    samples: int  # samples it contributed
    seconds: float  # time it spent in that epoch


@dataclass(frozen=True)
class PeerMetrics:
    """One peer's signed metrics record."""

    peer: str
    epoch: int  # the collaboration epoch the peer is in now
    loss: float  # mean loss of its latest finished epoch (nan before the first)
    samples_per_second: float
    micro_steps: int  # total micro-steps since the peer started
    samples: int  # total samples since the peer started
    mode: str  # node / client / aux
    upload_bps: float = 0.0  # measured by its averager (0: not measured yet)
    download_bps: float = 0.0
    time: float = 0.0  # DHT time of the report
    devices: int = 1
    history: tuple[EpochFigures, ...] = field(default_factory=tuple)

    def to_record(self) -> dict[str, Any]:
        out = asdict(self)
        del out["peer"]  # the subkey names the peer, and the signature proves it
        out["history"] = [[h.epoch, h.loss, h.samples, h.seconds] for h in self.history]
        return out

    @classmethod
    def from_record(cls, peer: str, value: Any) -> PeerMetrics:
        """Parse a record read from the DHT; ValueError when it is malformed."""
        if not isinstance(value, dict):
            raise ValueError("metrics record is not a map")
        try:
            history = tuple(
                EpochFigures(int(e), float(loss), int(s), float(sec))
                for e, loss, s, sec in value.get("history", [])[:HISTORY]
            )
            record = cls(
                peer=peer,
                epoch=int(value["epoch"]),
                loss=float(value["loss"]),
                samples_per_second=float(value["samples_per_second"]),
                micro_steps=int(value["micro_steps"]),
                samples=int(value["samples"]),
                mode=str(value["mode"]),
                upload_bps=float(value.get("upload_bps", 0.0)),
                download_bps=float(value.get("download_bps", 0.0)),
                time=float(value.get("time", 0.0)),
                devices=int(value.get("devices", 1)),
                history=history,
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"bad metrics record: {e!r}") from e
        numbers = (record.samples_per_second, record.upload_bps, record.download_bps)
        if record.epoch < 0 or record.samples < 0 or not all(math.isfinite(x) for x in numbers):
            raise ValueError("metrics record out of range")
        return record


def parse_records(value: Any) -> dict[str, PeerMetrics]:
    """Peer ID -> metrics from the value of ``metrics_key`` (a map of signed subkeys)."""
    found: dict[str, PeerMetrics] = {}
    if not isinstance(value, dict):
        return found
    for subkey, item in value.items():
        names = owner_markers(subkey)
        if len(names) != 1:
            continue  # not a signed per-peer slot
        try:
            found[names[0]] = PeerMetrics.from_record(names[0], getattr(item, "value", item))
        except ValueError as e:
            log.info("ignoring the metrics of %s: %s", names[0], e)
    return found


async def publish(core: Any, record: PeerMetrics, ttl: float) -> None:
    """Store ``record`` in this peer's signed slot (run inside the collaboration's trio loop)."""
    dht = core.dht
    await dht.store(
        metrics_key(core.run_id),
        record.to_record(),
        dht.now() + ttl,
        subkey=owner_marker(dht.peer_id),
    )


async def fetch(core: Any) -> dict[str, PeerMetrics]:
    """Every live peer's metrics (run inside the collaboration's trio loop)."""
    return parse_records(await core.dht.get(metrics_key(core.run_id)))


class EpochTable:
    """Aggregates peers' per-epoch figures into one row per collaboration epoch.

    A peer publishes its figures for epoch e in the same record that says it moved past e, so
    a row for e is final once every trainer's latest record is past it. A peer that stopped
    publishing (it died; its record lives until it expires) holds a row back at most until the
    collaboration is :data:`ROW_LAG` epochs past it. :meth:`flush` finalises the rest.
    """

    def __init__(self) -> None:
        self._pending: dict[int, dict[str, EpochFigures]] = {}
        self._epochs: dict[str, int] = {}  # each trainer's epoch in its latest record
        self.rows: list[dict[str, Any]] = []
        self._done: set[int] = set()

    def add(self, records: dict[str, PeerMetrics], *, now: float) -> None:
        for peer, rec in records.items():
            for h in rec.history:
                if h.epoch not in self._done:
                    self._pending.setdefault(h.epoch, {})[peer] = h
        if records:  # an empty read (the DHT failed) says nothing about where peers are
            self._epochs = {p: r.epoch for p, r in records.items() if r.mode != "aux"}
        self._now = now

    def ready(self, global_epoch: int) -> list[dict[str, Any]]:
        """Finalise the rows every trainer has moved past (or :data:`ROW_LAG` behind
        ``global_epoch``); return the new rows."""
        passed = min(self._epochs.values()) if self._epochs else -1
        return self._finalise(
            [e for e in self._pending if e < passed or e <= global_epoch - ROW_LAG]
        )

    def flush(self) -> list[dict[str, Any]]:
        return self._finalise(list(self._pending))

    def _finalise(self, epochs: list[int]) -> list[dict[str, Any]]:
        new = []
        for e in sorted(epochs):
            figures = self._pending.pop(e)
            samples = sum(f.samples for f in figures.values())
            weighted = [(f.loss, f.samples) for f in figures.values() if math.isfinite(f.loss)]
            total = sum(s for _, s in weighted)
            loss = sum(loss * s for loss, s in weighted) / total if total else math.nan
            seconds = max((f.seconds for f in figures.values()), default=0.0)
            row = {
                "epoch": e,
                "loss": loss,
                "samples": samples,
                "peers": len(figures),
                "seconds": seconds,
                "samples_per_second": samples / seconds if seconds > 0 else 0.0,
                "time": getattr(self, "_now", 0.0),
            }
            self._done.add(e)
            self.rows.append(row)
            new.append(row)
        return new
