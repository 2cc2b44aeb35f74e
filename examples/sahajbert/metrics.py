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
import re
import statistics
from dataclasses import asdict, dataclass, field, replace
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


# Bounds on what one peer may report: anything outside is a broken or hostile peer, and its
# record is dropped whole (the figures feed the run's curves and the organiser's dashboard).
MAX_EPOCH = 10**9
MAX_LOSS = 1e4  # a cross-entropy; sahajBERT starts near ln(32000) + ln(2) = 11.1
MAX_RATE = 1e6  # samples/s of one peer
MAX_SAMPLES = 10**13  # samples of one peer since it started
MAX_SECONDS = 1e8  # seconds one peer spent in one epoch (about three years)
MAX_BPS = 1e12  # bytes/s measured by one peer's averager
MAX_TIME = 1e12  # a DHT time
MAX_DEVICES = 1 << 16
MODES = ("node", "client", "aux")
MAX_GROUP = 1 << 16  # peers one step averaged
STATE_HEX = 16  # hex digits of a state's digest a record names
_STATE = re.compile(rf"(?:[0-9a-f]{{{STATE_HEX}}})?")
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{1,100}")  # base58, as owner markers carry them


def parse_checkpoint(value: Any) -> tuple[int, str] | None:
    """(epoch, path) from the value of ``checkpoint_key``, or None when it is not a sane
    announcement. The coordinator writes it in its signed subkey, but others may write
    theirs, so nothing here trusts the value: a trainer reads it only to know when it may stop
    serving. Of several subkeys, the newest sane announcement counts."""
    value = getattr(value, "value", value)
    if isinstance(value, dict) and "epoch" not in value:  # subkey -> value
        found = [_announcement(v) for v in list(value.values())[:64]]
        return max((f for f in found if f is not None), default=None)
    return _announcement(value)


def _announcement(value: Any) -> tuple[int, str] | None:
    value = getattr(value, "value", value)
    if not isinstance(value, dict):
        return None
    epoch, path = value.get("epoch"), value.get("path", "")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= MAX_EPOCH:
        return None
    if not isinstance(path, str) or len(path) > 4096:
        return None
    return epoch, path


@dataclass(frozen=True)
class EpochFigures:
    """What one peer did during one collaboration epoch."""

    epoch: int
    loss: float  # mean training loss over its micro-batches of that epoch
    samples: int  # samples it contributed
    seconds: float  # time it spent in that epoch
    # How the epoch ended for it: the peers it stepped with, itself included (1: alone; 0: not
    # said), and the state it went on with (its digest's first STATE_HEX hex digits; "": not
    # said). Two peers that each stepped alone are two lone steps, not one averaged epoch.
    group: int = 0
    state: str = ""


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
    upload_bps: float = 0.0  # link capacity its averager measured (0: not measured yet)
    download_bps: float = 0.0
    time: float = 0.0  # DHT time of the report
    devices: int = 1
    history: tuple[EpochFigures, ...] = field(default_factory=tuple)
    # The epoch after which this peer found the run diverged (a non-finite loss or state) and
    # stopped; None while it trains. A claim like any other: it names the peer that made it.
    diverged: int | None = None
    # The epoch at which this peer stopped training (its --max-epochs) and serves its state
    # until the coordinator saved it; None while it trains. A claim: the coordinator acts on
    # it only when most trainers make it.
    stopped: int | None = None
    sent_bps: float = 0.0  # traffic: bytes/s it sent and received over the last half minute
    received_bps: float = 0.0

    def to_record(self) -> dict[str, Any]:
        out = asdict(self)
        del out["peer"]  # the subkey names the peer, and the signature proves it
        out["history"] = [[h.epoch, h.loss, h.samples, h.seconds] for h in self.history]
        for optional in ("diverged", "stopped"):
            if out[optional] is None:
                del out[optional]
        # apart from the history, so that a coordinator that does not know them still parses
        out["stepped"] = [[h.epoch, h.group, h.state] for h in self.history if h.group]
        return out

    @classmethod
    def from_record(cls, peer: str, value: Any) -> PeerMetrics:
        """Parse a record read from the DHT; ValueError (naming the field) when any field has
        the wrong type or lies outside its bounds."""
        if not isinstance(value, dict):
            raise ValueError("metrics record is not a map")
        try:
            epoch = _integer(value["epoch"], "epoch", 0, MAX_EPOCH)
            record = cls(
                peer=peer,
                epoch=epoch,
                loss=_number(value["loss"], "loss", 0.0, MAX_LOSS, unknown_ok=True),
                samples_per_second=_number(
                    value["samples_per_second"], "samples_per_second", 0.0, MAX_RATE
                ),
                micro_steps=_integer(value["micro_steps"], "micro_steps", 0, MAX_SAMPLES),
                samples=_integer(value["samples"], "samples", 0, MAX_SAMPLES),
                mode=_mode(value["mode"]),
                upload_bps=_number(value.get("upload_bps", 0.0), "upload_bps", 0.0, MAX_BPS),
                download_bps=_number(value.get("download_bps", 0.0), "download_bps", 0.0, MAX_BPS),
                sent_bps=_number(value.get("sent_bps", 0.0), "sent_bps", 0.0, MAX_BPS),
                received_bps=_number(value.get("received_bps", 0.0), "received_bps", 0.0, MAX_BPS),
                time=_number(value.get("time", 0.0), "time", 0.0, MAX_TIME),
                devices=_integer(value.get("devices", 1), "devices", 1, MAX_DEVICES),
                history=_with_steps(
                    _history(value.get("history", [])), _stepped(value.get("stepped", []))
                ),
                diverged=None
                if value.get("diverged") is None
                else _integer(value["diverged"], "diverged", 0, MAX_EPOCH),
                stopped=None
                if value.get("stopped") is None
                else _integer(value["stopped"], "stopped", 0, MAX_EPOCH),
            )
        except KeyError as e:
            raise ValueError(f"metrics record lacks {e}") from None
        return record


def reportable_loss(loss: float) -> float:
    """``loss`` as a record carries it: NaN (no figure) for one outside [0, MAX_LOSS]."""
    return loss if 0.0 <= loss <= MAX_LOSS else math.nan


def _shown(value: Any) -> str:
    return repr(value)[:40]


def _integer(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {_shown(value)}")
    if not low <= value <= high:
        raise ValueError(f"{name} {_shown(value)} is outside [{low}, {high}]")
    return value


def _number(value: Any, name: str, low: float, high: float, *, unknown_ok: bool = False) -> float:
    """A finite number in [low, high]; NaN only where ``unknown_ok`` (no figure yet)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {_shown(value)}")
    try:
        x = float(value)
    except OverflowError:
        raise ValueError(f"{name} {_shown(value)} is out of range") from None
    if math.isnan(x) and unknown_ok:
        return x
    if not low <= x <= high:  # False for NaN and for the infinities
        raise ValueError(f"{name} {_shown(value)} is outside [{low:g}, {high:g}]")
    return x


def _mode(value: Any) -> str:
    if value not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {_shown(value)}")
    return value


def _history(value: Any) -> tuple[EpochFigures, ...]:
    """The per-epoch figures: at most :data:`HISTORY` finished epochs, each once. (An epoch
    may exceed the record's own: a peer that loaded an older state goes back.)"""
    if not isinstance(value, list | tuple):
        raise ValueError("history must be a list")
    if len(value) > HISTORY:
        raise ValueError(f"history holds {len(value)} epochs, more than {HISTORY}")
    out = []
    for item in value:
        if not isinstance(item, list | tuple) or len(item) != 4:
            raise ValueError("a history entry is [epoch, loss, samples, seconds]")
        e, loss, samples, seconds = item
        out.append(
            EpochFigures(
                _integer(e, "history epoch", 0, MAX_EPOCH),
                # NaN: no figure (a diverged epoch's loss, which a record cannot carry)
                _number(loss, "history loss", 0.0, MAX_LOSS, unknown_ok=True),
                _integer(samples, "history samples", 0, MAX_SAMPLES),
                _number(seconds, "history seconds", 0.0, MAX_SECONDS),
            )
        )
    if len({h.epoch for h in out}) != len(out):
        raise ValueError("history names an epoch twice")
    return tuple(out)


def _stepped(value: Any) -> dict[int, tuple[int, str]]:
    """epoch -> (group, state) from a record's ``stepped`` list (see :class:`EpochFigures`)."""
    if not isinstance(value, list | tuple):
        raise ValueError("stepped must be a list")
    if len(value) > HISTORY:
        raise ValueError(f"stepped holds {len(value)} epochs, more than {HISTORY}")
    out = {}
    for item in value:
        if not isinstance(item, list | tuple) or len(item) != 3:
            raise ValueError("a stepped entry is [epoch, group, state]")
        e, group, state = item
        epoch = _integer(e, "stepped epoch", 0, MAX_EPOCH)
        group = _integer(group, "stepped group", 0, MAX_GROUP)
        if not isinstance(state, str) or not _STATE.fullmatch(state):
            raise ValueError(f"stepped state must be {STATE_HEX} hex digits or empty")
        out[epoch] = (group, state)
    return out


def _with_steps(
    history: tuple[EpochFigures, ...], steps: dict[int, tuple[int, str]]
) -> tuple[EpochFigures, ...]:
    return tuple(
        replace(h, group=steps[h.epoch][0], state=steps[h.epoch][1]) if h.epoch in steps else h
        for h in history
    )


# The reason last logged per peer: a bad record is re-read on every poll, and is worth one
# warning per change, not one per poll. Bounded (cleared when it grows past this).
_WARNED_MAX = 4096
_warned: dict[str, str] = {}


def parse_records(value: Any) -> dict[str, PeerMetrics]:
    """Peer ID -> metrics from the value of ``metrics_key`` (a map of signed subkeys).
    Malformed records are dropped and logged."""
    found: dict[str, PeerMetrics] = {}
    if not isinstance(value, dict):
        return found
    for subkey, item in value.items():
        names = owner_markers(subkey) if isinstance(subkey, str) else []
        if len(names) != 1 or not _PEER_ID.fullmatch(names[0]):
            continue  # not a signed per-peer slot
        peer = names[0]
        try:
            found[peer] = PeerMetrics.from_record(peer, getattr(item, "value", item))
        except ValueError as e:
            if _warned.get(peer) != str(e):
                if len(_warned) >= _WARNED_MAX:
                    _warned.clear()
                _warned[peer] = str(e)
                log.warning("dropping the metrics record of %s: %s", peer, e)
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

    Rows are robust to one lying peer (of three or more): the loss and the epoch's duration
    are medians over the peers, and one peer's samples count at most twice the target batch
    (the collaboration steps once all peers together reach the target, so an honest peer
    stays below that).
    Figures for epochs more than :data:`ROW_LAG` past the collaboration's are not kept.
    """

    def __init__(self, target_batch_size: int) -> None:
        if target_batch_size < 1:
            raise ValueError("target_batch_size must be positive")
        self.peer_samples_cap = 2 * target_batch_size
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
        for e in [e for e in self._pending if e > global_epoch + ROW_LAG]:
            log.info("ignoring figures for epoch %d: the collaboration is in %d", e, global_epoch)
            del self._pending[e]
        passed = min(self._epochs.values()) if self._epochs else -1
        return self._finalise(
            [e for e in self._pending if e < passed or e <= global_epoch - ROW_LAG]
        )

    def flush(self) -> list[dict[str, Any]]:
        return self._finalise(list(self._pending))

    def _finalise(self, epochs: list[int]) -> list[dict[str, Any]]:
        new = []
        for e in sorted(epochs):
            figures = list(self._pending.pop(e).values())
            samples = sum(min(f.samples, self.peer_samples_cap) for f in figures)
            losses = [f.loss for f in figures if math.isfinite(f.loss)]
            loss = statistics.median(losses) if losses else math.nan
            # the upper median: a peer that joined late spent less of the epoch than the others
            seconds = statistics.median_high(f.seconds for f in figures) if figures else 0.0
            said = [f for f in figures if f.group]
            row = {
                "epoch": e,
                "loss": loss,
                "samples": samples,
                "peers": len(figures),
                # Peers that stepped alone, and the states the peers went on with: "peers 2,
                # lone 2, lineages 2" is two lone steps on two lineages, not an averaged epoch
                # (None: no peer said, e.g. an older trainer).
                "lone": sum(f.group == 1 for f in said) if said else None,
                "lineages": len({f.state for f in said if f.state}) or None,
                "seconds": seconds,
                "samples_per_second": samples / seconds if seconds > 0 else 0.0,
                "time": getattr(self, "_now", 0.0),
            }
            self._done.add(e)
            self.rows.append(row)
            new.append(row)
        return new
