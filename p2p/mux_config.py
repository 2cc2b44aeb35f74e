"""Limits of a multiplexed connection (:class:`MuxConfig`), and the node-wide budget of
received bytes that all its connections share (:class:`MemoryBudget`)."""

from __future__ import annotations

from dataclasses import dataclass

from p2p.mux_frames import MAX_WINDOW


@dataclass(frozen=True)
class MuxConfig:
    """Limits and window sizes of one multiplexed connection."""

    initial_window: int = 16 << 20
    """Bytes a peer may send on a stream before the reader grants more. Credit goes back in
    quarters of it: with 4 MiB a 1 MiB-message stream cost one WINDOW frame, and a wake-up of
    the sender, per message (node 1-stream CPU +0.5 s/GB over both sides, bench.transport)."""
    max_frame_payload: int = 1 << 20
    """Largest DATA payload per frame (also capped by the channel's ``max_frame``)."""
    max_inbound_streams: int = 512
    """Streams the remote side may have open at once; more are reset ("too many streams")."""
    max_outbound_streams: int = 256
    """Streams we open at once; further opens wait for a slot (stays below a peer's limit)."""
    max_pending_control: int = 1024
    """Queued control frames (resets, window updates); a peer provoking more is cut off."""
    max_buffered_bytes: int = 96 << 20
    """Received bytes held at once on this connection: queued in streams or in messages being
    assembled (granted credit frees window space, so windows alone do not bound a message).
    Data that would exceed it resets its stream ("memory limit")."""

    def __post_init__(self) -> None:
        if not 0 < self.max_frame_payload <= self.initial_window <= MAX_WINDOW:
            raise ValueError("need 0 < max_frame_payload <= initial_window < 2**31")
        if self.max_buffered_bytes < self.initial_window:
            raise ValueError("max_buffered_bytes must be at least initial_window")


class MemoryBudget:
    """Received bytes held by all connections of a node, against one limit (shared by muxes)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def try_reserve(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def release(self, n: int) -> None:
        self.used -= n
