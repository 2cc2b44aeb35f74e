"""Measured upload/download throughput of this peer: what it announces for load balancing.

Each all-reduce round reports the bytes it moved in each direction and over how long; the meter
keeps an exponentially smoothed estimate per direction. Before any round, :func:`probe` times a
short transfer to a peer. A user-supplied value overrides the measurement (for a link the
measurements cannot see, e.g. a shaped uplink shared with other traffic).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import trio

from p2p.identity import PeerID
from p2p.rpc import CallContext, MessageStream

logger = logging.getLogger(__name__)

PROBE_PROTOCOL = "dedloc/bwprobe/1"
MAX_PROBE_BYTES = 16 << 20
_PROBE_CHUNK = 256 << 10


@dataclass
class BandwidthMeter:
    """Smoothed throughput per direction (bytes/s); ``alpha`` is the weight of a new sample."""

    alpha: float = 0.3
    upload_override: float | None = None
    download_override: float | None = None
    _estimates: dict[str, float] = field(default_factory=dict)

    def record(self, direction: str, nbytes: int, seconds: float) -> None:
        """Fold one transfer (``direction`` is "up" or "down") into the estimate."""
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        if nbytes <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        sample = nbytes / seconds
        old = self._estimates.get(direction)
        self._estimates[direction] = (
            sample if old is None else (self.alpha * sample + (1 - self.alpha) * old)
        )

    def _get(self, direction: str, override: float | None) -> float | None:
        return override if override is not None else self._estimates.get(direction)

    @property
    def upload_bps(self) -> float | None:
        return self._get("up", self.upload_override)

    @property
    def download_bps(self) -> float | None:
        return self._get("down", self.download_override)

    @property
    def measured(self) -> bool:
        return self.upload_bps is not None and self.download_bps is not None


async def _serve_probe(ctx: CallContext, ms: MessageStream) -> None:
    """Echo side of a probe: count what we receive, then send back what was asked for."""
    request = await ms.receive()
    if not isinstance(request, dict):
        raise ValueError("malformed probe request")
    up, down = request.get("up"), request.get("down")
    if not all(isinstance(v, int) and 0 <= v <= MAX_PROBE_BYTES for v in (up, down)):
        raise ValueError("probe sizes out of range")
    got = 0
    while got < up:
        msg = await ms.receive()
        if not isinstance(msg, bytes):
            raise ValueError("probe payload must be bytes")
        got += len(msg)
    await ms.send({"got": got})
    sent = 0
    while sent < down:
        n = min(_PROBE_CHUNK, down - sent)
        await ms.send(os.urandom(n))
        sent += n


def install_probe(node: Any) -> None:
    """Answer other peers' probes (idempotent per node is up to the caller)."""
    node.add_stream_handler(PROBE_PROTOCOL, _serve_probe)


async def probe(
    node: Any, peer: PeerID, meter: BandwidthMeter, *, nbytes: int = 4 << 20, timeout: float = 30.0
) -> BandwidthMeter:
    """Time sending and receiving ``nbytes`` to/from ``peer`` and record both into ``meter``.

    A lower bound of this peer's link speeds (the other peer's link may be the slower one).
    """
    nbytes = min(nbytes, MAX_PROBE_BYTES)
    with trio.fail_after(timeout):
        async with node.open_stream(peer, PROBE_PROTOCOL, timeout=timeout) as ms:
            await ms.send({"up": nbytes, "down": nbytes})
            t0 = trio.current_time()
            payload = os.urandom(_PROBE_CHUNK)
            sent = 0
            while sent < nbytes:
                n = min(_PROBE_CHUNK, nbytes - sent)
                await ms.send(payload[:n])
                sent += n
            reply = await ms.receive()
            t1 = trio.current_time()
            if not isinstance(reply, dict) or reply.get("got") != nbytes:
                raise ValueError("probe peer did not receive everything")
            got = 0
            while got < nbytes:
                msg = await ms.receive()
                if not isinstance(msg, bytes):
                    raise ValueError("probe payload must be bytes")
                got += len(msg)
            t2 = trio.current_time()
    meter.record("up", nbytes, t1 - t0)
    meter.record("down", nbytes, t2 - t1)
    logger.info(
        "probe to %s: up %.3g B/s, down %.3g B/s",
        peer,
        nbytes / max(t1 - t0, 1e-9),
        nbytes / max(t2 - t1, 1e-9),
    )
    return meter
