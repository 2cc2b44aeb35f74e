"""A node's limits and timeouts as one frozen config with named presets.

Why apart from :mod:`p2p.node`: the DHT, the NAT layer and the benchmarks pick a preset
(``internet``, ``bulk``, ``testing``) without needing the node's machinery.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from p2p.mux_config import MuxConfig


@dataclass(frozen=True)
class NodeConfig:
    """Limits and timeouts of a node. ``NodeConfig()`` is the Internet-facing default."""

    max_message_size: int = 32 << 20
    """Largest msgpack message accepted or sent on a stream (bytes)."""
    handshake_timeout: float = 10.0
    """An accepted connection must finish the secure handshake within this (slowloris)."""
    dial_timeout: float = 10.0
    """Opening the raw transport connection must finish within this."""
    dial_stagger: float = 0.25
    """A peer's next address is dialed this long after the previous one (or as soon as that
    one failed), all in parallel, the first connection winning (Happy Eyeballs, RFC 8305)."""
    dial_deadline_share: float = 0.75
    """One dial attempt takes at most this share of the time left before the caller's
    deadline (e.g. of a 2 s DHT request), so it ends as a DialError, not as the caller's
    timeout."""
    frame_timeout: float | None = 30.0
    """A frame, once started, must arrive completely within this (slowloris mid-frame)."""
    call_timeout: float | None = 60.0
    """Deadline of :meth:`Node.call` when the caller gives none (None: no deadline)."""
    header_timeout: float = 10.0
    """A new stream must name its protocol within this."""
    request_timeout: float = 30.0
    """A unary request must arrive completely within this."""
    idle_timeout: float = 120.0
    """A connection with no streams for this long is closed."""
    keepalive_interval: float | None = 60.0
    """A connection on which nothing arrived for this long is pinged (a mux PING, no stream),
    so that the NAT mappings and firewall states on its path stay open; None: never. A minute:
    home routers keep an idle TCP mapping for minutes (RFC 5382 asks for two hours)."""
    keepalive_timeout: float = 60.0
    """A pinged connection on which nothing at all arrives for this long more is closed as
    dead (a NAT that dropped its mapping black-holes it silently): calls fail over to a new
    connection and relay reservations are taken again."""
    drain_grace: float = 1.0
    """A duplicate connection (simultaneous dial) is closed after being idle this long."""
    max_connections: int = 1024
    """Connections in total (inbound, outbound, still handshaking)."""
    max_connections_per_ip: int = 64
    """Inbound connections from one IP address (or simulated host)."""
    max_streams_per_connection: int = 512
    """Streams a peer may have open to us on one connection; more are reset."""
    max_outbound_streams_per_connection: int = 256
    """Streams we open on one connection at once; more wait for a free slot."""
    stream_window: int = 16 << 20
    """Per-stream receive window (bytes a peer may send before we grant more; see
    :attr:`p2p.mux.MuxConfig.initial_window`). Memory is bounded by the limits below, not by it."""
    max_frame_payload: int = 1 << 20
    """Largest mux DATA frame (also capped by the secure channel's frame size). Bigger frames
    cost less CPU per byte; a small call waits behind at most one frame per busy stream."""
    max_buffered_per_connection: int = 96 << 20
    """Received bytes one connection may make us hold (queued or in half-read messages);
    a stream whose data would exceed it is reset."""
    max_buffered_total: int = 1 << 30
    """The same, summed over every connection of the node."""
    cipher: str | None = None
    """Force "chacha20-poly1305", "aes-256-gcm" or "aes-256-ocb"; None picks by hardware."""
    retain_freed_memory: bool = True
    """Let glibc keep freed memory for reuse, process-wide, from the first such node on (see
    :func:`retain_freed_memory`): received chunks then cost no page faults. Set False in every
    node of a process that must return freed memory to the OS at once; the setting, once
    made, lasts for the life of the process."""

    @classmethod
    def internet(cls) -> NodeConfig:
        """The default: peers on home connections across the Internet."""
        return cls()

    @classmethod
    def bulk(cls) -> NodeConfig:
        """Large transfers between few peers (gradients): bigger windows and messages."""
        return cls(
            stream_window=32 << 20,
            max_frame_payload=1 << 20,
            max_message_size=128 << 20,
            max_buffered_per_connection=320 << 20,
            max_buffered_total=2 << 30,
        )

    @classmethod
    def testing(cls) -> NodeConfig:
        """Short timeouts so tests of misbehaving peers finish quickly."""
        return cls(
            handshake_timeout=2.0,
            dial_timeout=2.0,
            frame_timeout=2.0,
            call_timeout=10.0,
            header_timeout=2.0,
            request_timeout=2.0,
            idle_timeout=10.0,
        )

    def __post_init__(self) -> None:
        if not self.dial_stagger >= 0:
            raise ValueError("dial_stagger must be >= 0")
        if not 0 < self.dial_deadline_share <= 1:
            raise ValueError("dial_deadline_share must be in (0, 1]")
        if self.keepalive_interval is not None and not self.keepalive_interval > 0:
            raise ValueError("keepalive_interval must be > 0 (None: no keepalive)")
        if not self.keepalive_timeout > 0:
            raise ValueError("keepalive_timeout must be > 0")

    def replace(self, **changes: Any) -> NodeConfig:
        return replace(self, **changes)

    def mux_config(self, channel_max_frame: int | None = None) -> MuxConfig:
        payload = self.max_frame_payload
        if channel_max_frame is not None:
            payload = min(payload, channel_max_frame)  # the mux leaves room for its header
        return MuxConfig(
            initial_window=max(self.stream_window, payload),
            max_frame_payload=payload,
            max_inbound_streams=self.max_streams_per_connection,
            max_outbound_streams=self.max_outbound_streams_per_connection,
            max_buffered_bytes=max(self.max_buffered_per_connection, self.stream_window, payload),
        )
