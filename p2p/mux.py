"""Stream multiplexer: many logical byte streams over one frame channel.

Why: one (encrypted) connection per peer pair carries everything, from 100 MB gradient
transfers to tiny DHT queries. Each logical stream has its own receive window: a peer may
send a stream only as many bytes as the reader granted, so a slow reader stalls only its
own stream, and a big transfer cannot starve a small call (writers take a fair FIFO lock per
frame, so frames of concurrent streams interleave). A peer sending beyond its window, or
otherwise breaking the protocol, gets its whole connection closed; memory per connection is
bounded by ``max_inbound_streams * initial_window``.

The wire format is in :mod:`p2p.mux_frames`.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from p2p.errors import ConnectionClosed, ProtocolError
from p2p.mux_config import MemoryBudget, MuxConfig
from p2p.mux_frames import (
    BULK,
    BULK_MIN,
    BULK_PAYLOAD,
    DATA,
    DATA_EOF,
    EOF,
    GOAWAY,
    HEADER,
    KIND_NAMES,
    MAX_STREAM_ID,
    MAX_WINDOW,
    OPEN,
    OPEN_DATA,
    OPEN_DATA_EOF,
    OPENING,
    PING,
    PONG,
    RESET,
    ROUTINE_CLOSES,
    WINDOW,
    WINDOW_PAYLOAD,
    decode_frame,
    encode_frame,
    reason_bytes,
)
from p2p.mux_stream import Frames, MuxStream

logger = logging.getLogger(__name__)


class FrameChannel(Protocol):
    """A reliable, ordered channel of frames (the secure channel, or a test stand-in)."""

    async def send_frame(self, data: bytes | bytearray | memoryview) -> None: ...

    # optional: ``async def send_frames(self, frames: Sequence[...]) -> None`` (one write)

    async def receive_frame(self) -> bytes | bytearray | memoryview: ...

    async def aclose(self) -> None: ...


StreamHandler = Callable[[MuxStream], Awaitable[None]]

CONTROL = "mux/"  # frames of no stream count in ``Mux.bytes_sent`` as mux/<kind>: mux/ping


class ByteCount:
    """A running total of bytes (what a node's muxes read, all connections together)."""

    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total = 0


class Mux:
    """The multiplexer of one connection. Run :meth:`run` in a nursery; it owns the tasks.

    ``handle_stream`` runs for each stream the peer opens, in the mux's nursery, inside a
    cancel scope that a reset of that stream (or the end of the connection) cancels.
    To its streams it is a :class:`p2p.mux_stream.StreamHost` (the methods under "-- for
    the streams --").
    """

    def __init__(
        self,
        channel: FrameChannel,
        *,
        initiator: bool,
        handle_stream: StreamHandler,
        config: MuxConfig = MuxConfig(),
        label: str = "",
        budget: MemoryBudget | None = None,
        bytes_sent: Counter[str] | None = None,
        bytes_received: ByteCount | None = None,
    ) -> None:
        self.channel = channel
        # Bytes read from the channel (every frame, with its framing); shared like bytes_sent.
        self.bytes_received = ByteCount() if bytes_received is None else bytes_received
        # Bytes written to the channel per stream protocol (control frames as CONTROL + kind),
        # each frame with the channel's framing; a node passes one Counter to all its muxes.
        self.bytes_sent: Counter[str] = Counter() if bytes_sent is None else bytes_sent
        self._frame_overhead = int(getattr(channel, "frame_overhead", 0))
        self.config = config
        self.initiator = initiator
        self.label = label
        self._handle_stream = handle_stream
        channel_max = getattr(channel, "max_frame", None)
        payload = bulk = config.max_frame_payload
        if channel_max is not None:
            payload = min(payload, int(channel_max) - HEADER.size)
            bulk = min(bulk, int(channel_max))
        self.max_payload = payload
        # at most half a window: see MuxStream.send_parts
        self.max_bulk = min(bulk, config.initial_window // 2)
        self.bulk_min = BULK_MIN if self.max_bulk >= BULK_MIN else MAX_WINDOW + 1
        self._bulk: tuple[int, int] | None = None  # (stream id, bytes) of an announced BULK
        self._streams: dict[int, MuxStream] = {}
        self.budget = budget
        self._held_total = 0
        # outbound streams whose first frame is unsent (a set in opening order: repeatable)
        self._unopened: dict[MuxStream, None] = {}
        self._next_id = 1 if initiator else 2
        self._last_remote_id = 0
        self._inbound = 0
        self._outbound_slots = trio.Semaphore(config.max_outbound_streams)
        self._send_lock = trio.Lock()
        self._control: deque[bytes] = deque()
        self._window_updates: dict[int, int] = {}
        self._control_lot = trio.lowlevel.ParkingLot()
        self.activity = 0  # bumped whenever a stream opens or finishes (idle detection)
        self.frames_received = 0  # any frame, PONG included (liveness; keepalive)
        self._pong_queued = False
        self._nursery: trio.Nursery | None = None
        self._closed_reason: str | None = None
        self._closing = False
        self._pending_close: str | None = None
        self.closed = trio.Event()

    # -- public --------------------------------------------------------------------------
    @property
    def is_closed(self) -> bool:
        return self._closed_reason is not None

    @property
    def close_reason(self) -> str | None:
        return self._closed_reason

    @property
    def num_streams(self) -> int:
        return len(self._streams) + len(self._unopened)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the connection until it closes; returns after the channel is closed."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._control_loop)
                watch = getattr(self.channel, "watch_frames", None)  # optional: SecureChannel
                if watch is not None:
                    nursery.start_soon(watch)
                task_status.started()
                await self._receive_loop()
                nursery.cancel_scope.cancel()
        finally:
            self._teardown(self._closed_reason or "connection closed")
            # no stream is served any more: drop the handler (it often holds the connection
            # that holds this mux, a cycle only the cyclic collector would free) and the nursery
            self._handle_stream = _refuse_stream
            self._nursery = None
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self.channel)  # type: ignore[arg-type]

    async def open_stream(self) -> MuxStream:
        """A new outbound stream; waits while ``max_outbound_streams`` are open.

        Nothing is sent yet: the peer learns of the stream with its first data (or EOF).
        """
        self.raise_if_closed()
        await self._outbound_slots.acquire()
        if self._closed_reason is not None or self._closing:
            self._outbound_slots.release()
            self.raise_if_closed()
        stream = MuxStream(self, None, outbound=True)
        self._unopened[stream] = None
        self._streams_changed()
        return stream

    async def aclose(self, reason: str = "closed") -> None:
        """Tell the peer why (GOAWAY, best effort) and close the connection."""
        if self.is_closed or self._closing:
            await trio.lowlevel.checkpoint()
            return
        self._closing = True
        with trio.move_on_after(2) as cs:
            cs.shield = True
            try:
                async with self._send_lock:
                    await self._send_control(self._goaway(reason))
            except _CHANNEL_ERRORS:
                pass
        self._close_now(reason)
        await trio.lowlevel.checkpoint()

    def close_nowait(self, reason: str) -> None:
        """Close without waiting (queue a GOAWAY the control task flushes first if it can)."""
        if self.is_closed:
            return
        self._closing = True
        self._control.appendleft(self._goaway(reason))
        self._control_lot.unpark_all()
        self._pending_close = reason

    def ping(self, payload: bytes = b"") -> None:
        """Queue a PING (the peer answers with a PONG, which counts in ``frames_received``).
        Pings are no stream activity: they keep NAT mappings open, not idle connections."""
        if self.is_closed or self._closing:
            return
        self._control.append(encode_frame(PING, 0, payload[:8]))
        self._control_lot.unpark_all()

    # -- for the streams (StreamHost) ----------------------------------------------------
    def raise_if_closed(self) -> None:
        if self._closed_reason is not None:
            raise ConnectionClosed(f"connection closed: {self._closed_reason}")
        if self._closing:
            raise ConnectionClosed("connection is closing")

    async def send_stream_frames(self, stream: MuxStream, batch: Frames) -> None:
        """Send ``stream``'s frames (kind, payload pieces) in one channel write.

        The lock is taken without a pass through the scheduler when it is free (the channel's
        write is this send's schedule point); a waiting writer is handed it on release, so
        streams still take turns frame by frame.
        """
        lock = self._send_lock
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            await self._send_batch_locked(stream, batch)
        finally:
            lock.release()

    def grant(self, stream_id: int, increment: int) -> None:
        """Queue a WINDOW update (merged with others of the same stream until flushed)."""
        if self.is_closed:
            return
        self._window_updates[stream_id] = self._window_updates.get(stream_id, 0) + increment
        self._control_lot.unpark_all()

    def queue_reset(self, stream_id: int, reason: str, *, refusal: bool = False) -> None:
        """Queue a RESET. Refusals of streams the peer opens are unbounded in number, so a
        peer that keeps opening while not reading our answers is cut off."""
        if self.is_closed:
            return
        if refusal and len(self._control) >= self.config.max_pending_control:
            self._fail("too many refused streams queued (peer not reading?)")
            return
        self._window_updates.pop(stream_id, None)
        self._control.append(encode_frame(RESET, stream_id, reason_bytes(reason)))
        self._control_lot.unpark_all()

    def release(self, n: int) -> None:
        self._held_total -= n
        if self.budget is not None:
            self.budget.release(n)

    def stream_ended(self, stream: MuxStream) -> None:
        """Forget a finished stream (its id, its outbound slot or inbound count); idempotent."""
        if not stream.finished:
            return
        if stream.stream_id is None:
            if stream not in self._unopened:
                return
            del self._unopened[stream]
        else:
            if self._streams.get(stream.stream_id) is not stream:
                return
            del self._streams[stream.stream_id]
            self._window_updates.pop(stream.stream_id, None)
        if stream.outbound:
            self._outbound_slots.release()
        else:
            self._inbound -= 1
        self._streams_changed()

    # -- sending -------------------------------------------------------------------------
    async def _send_batch_locked(self, stream: MuxStream, batch: Frames) -> None:
        if self._closed_reason is not None:
            raise ConnectionClosed(f"connection closed: {self._closed_reason}")
        sid = stream.stream_id
        if sid is None:  # the stream's first frame: give it the next id now
            stream.raise_if_reset()
            if self._next_id > MAX_STREAM_ID:
                raise ConnectionClosed("stream ids exhausted on this connection")
            sid = stream.stream_id = self._next_id
            self._next_id += 2  # ids may skip (a failed first send): only order matters
            self._unopened.pop(stream, None)
            self._streams[sid] = stream
            kind, parts = batch[0]
            if kind == BULK:
                batch = [(OPEN, []), *batch]
            else:
                batch = [(OPENING[kind], parts), *batch[1:]]
        frames: list[Any] = []
        prev: tuple[int, list[Any]] | None = None
        for kind, parts in batch:
            if kind == BULK:
                (piece,) = parts
                head = HEADER.pack(BULK, sid) + BULK_PAYLOAD.pack(len(piece))
                if prev is not None and prev[0] == DATA and self._fits_bulk_head(prev[1]):
                    # the small data just before the piece rides in its BULK frame
                    frames[-1] = b"".join((head, *prev[1]))
                else:
                    frames.append(head)
                frames.append(piece)  # its own channel frame, no mux header, no copy
            else:
                frames.append(b"".join((HEADER.pack(kind, sid), *parts)))
            prev = (kind, parts)
        stream.frames_leaving()
        try:
            await self._send_frames(frames)
        except _CHANNEL_ERRORS as e:
            self._close_now(f"send failed: {e!r}")
            raise ConnectionClosed(f"connection closed: {e!r}") from e
        except trio.Cancelled:
            # cancelled before the frames left (a cut frame closes the channel anyway)
            stream.frames_cancelled()
            raise
        stream.frames_written()
        self.bytes_sent[stream.protocol] += (
            sum(map(len, frames)) + len(frames) * self._frame_overhead
        )

    def _fits_bulk_head(self, parts: list[Any]) -> bool:
        return sum(len(p) for p in parts) + BULK_PAYLOAD.size <= self.max_payload

    async def _send_frames(self, frames: list[Any]) -> None:
        """One write when the channel batches; else frame by frame (a cut batch closes)."""
        send_frames = getattr(self.channel, "send_frames", None)
        if send_frames is not None:
            await send_frames(frames)
            return
        for i, frame in enumerate(frames):
            try:
                await self.channel.send_frame(frame)
            except trio.Cancelled:
                if i:  # the peer may be waiting for the rest of a BULK: nothing may follow
                    self._close_now("send cancelled between the frames of one write")
                raise

    async def _send_control(self, frame: bytes) -> None:
        await self.channel.send_frame(frame)
        self.bytes_sent[CONTROL + KIND_NAMES[frame[0]].lower()] += len(frame) + self._frame_overhead

    async def _control_loop(self) -> None:
        """Flush control frames; the receive loop never blocks on sending."""
        while True:
            if not self._control and not self._window_updates:
                if self._pending_close is not None:
                    self._close_now(self._pending_close)
                    return
                await self._control_lot.park()
                continue
            async with self._send_lock:
                while self._control or self._window_updates:
                    if self._control:
                        frame = self._control.popleft()
                        if frame[0] == PONG:
                            self._pong_queued = False
                    else:
                        sid, inc = self._window_updates.popitem()
                        frame = encode_frame(WINDOW, sid, WINDOW_PAYLOAD.pack(inc))
                    try:
                        await self._send_control(frame)
                    except _CHANNEL_ERRORS as e:
                        self._close_now(f"send failed: {e!r}")
                        return

    # -- receiving -----------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        while self._closed_reason is None:
            try:
                frame = await self.channel.receive_frame()
            except _CHANNEL_ERRORS as e:
                self._close_now(f"channel closed: {e}")
                return
            self.frames_received += 1
            self.bytes_received.total += len(frame) + self._frame_overhead
            try:
                self.handle_frame(frame)
            except ProtocolError as e:
                self._fail(str(e))
                with trio.move_on_after(1) as cs:
                    cs.shield = True
                    try:
                        async with self._send_lock:
                            await self._send_control(self._goaway(f"protocol violation: {e}"))
                    except _CHANNEL_ERRORS:
                        pass
                return

    def handle_frame(self, frame: bytes | bytearray | memoryview) -> None:
        """Apply one received frame (pure state change; ProtocolError on a violation)."""
        if self._bulk is not None:
            self._handle_bulk_data(frame)
            return
        kind, sid, payload = decode_frame(frame)
        if not isinstance(frame, bytes):
            payload = memoryview(bytes(payload))  # the channel may reuse its buffer: keep a copy
        if kind == PING:
            if not self._pong_queued:  # one answer pending at most, however many pings come
                self._pong_queued = True
                self._control.append(encode_frame(PONG, 0, payload))
                self._control_lot.unpark_all()
            return
        if kind == PONG:
            return
        if kind == GOAWAY:
            reason = bytes(payload).decode("utf-8", "replace")
            level = logging.DEBUG if reason in ROUTINE_CLOSES else logging.INFO
            logger.log(level, "%s: peer is closing the connection: %s", self.label, reason)
            for stream in self._streams.values():
                if stream.outbound and stream.stream_id is not None and stream.stream_id > sid:
                    stream.unprocessed = True
            self._close_now(f"peer closed: {reason}")
            return
        remote_parity = 0 if self.initiator else 1  # ids the peer opens
        from_remote = sid % 2 == remote_parity
        if kind in (OPEN, OPEN_DATA, OPEN_DATA_EOF):
            if not from_remote:
                raise ProtocolError(f"peer opened stream {sid} with our parity")
            if sid <= self._last_remote_id:
                raise ProtocolError(f"peer reused or reordered stream id {sid}")
            self._last_remote_id = sid
            if self._closing:
                self.queue_reset(sid, "connection closing", refusal=True)
                return
            if self._inbound >= self.config.max_inbound_streams:
                logger.info("%s: refusing stream %d: too many streams", self.label, sid)
                self.queue_reset(sid, "too many streams", refusal=True)
                return
            new = MuxStream(self, sid, outbound=False)
            self._streams[sid] = new
            self._inbound += 1
            self._streams_changed()
            assert self._nursery is not None
            self._nursery.start_soon(self._run_handler, new)
            if kind == OPEN:
                return
            kind = DATA if kind == OPEN_DATA else DATA_EOF
        stream = self._streams.get(sid)
        if stream is None:
            known = sid <= self._last_remote_id if from_remote else sid < self._next_id
            if not known:
                raise ProtocolError(f"{KIND_NAMES[kind]} frame for unopened stream {sid}")
            if kind == BULK:  # its data frame follows: drop that too
                self._bulk = (sid, BULK_PAYLOAD.unpack_from(payload)[0])
            return  # a frame for a stream that already finished: harmless, drop it
        if kind in (DATA, DATA_EOF):
            n = len(payload)
            if stream.remote_eof:
                raise ProtocolError(f"DATA after EOF on stream {sid}")
            if n > stream.recv_window:
                raise ProtocolError(
                    f"stream {sid}: peer sent {n} bytes with only {stream.recv_window} granted"
                )
            if n:
                stream.count_received(n)
                if not self._deliver(stream, payload):
                    return
            if kind == DATA_EOF:
                stream.on_remote_eof()
                self.stream_ended(stream)
        elif kind == BULK:
            (n,) = BULK_PAYLOAD.unpack_from(payload)
            head = payload[BULK_PAYLOAD.size :]  # stream bytes that come before the piece
            if stream.remote_eof:
                raise ProtocolError(f"BULK after EOF on stream {sid}")
            if n <= 0 or n + len(head) > stream.recv_window:
                raise ProtocolError(
                    f"stream {sid}: BULK of {len(head)}+{n} bytes with {stream.recv_window} granted"
                )
            stream.count_received(n + len(head))
            self._bulk = (sid, n)  # set first: the piece must be consumed even if head is refused
            if head:
                self._deliver(stream, head)
        elif kind == WINDOW:
            (inc,) = WINDOW_PAYLOAD.unpack(payload)
            stream.on_window(inc)
        elif kind == EOF:
            if stream.remote_eof:
                raise ProtocolError(f"duplicate EOF on stream {sid}")
            stream.on_remote_eof()
            self.stream_ended(stream)
        elif kind == RESET:
            reason = bytes(payload).decode("utf-8", "replace")
            stream.on_reset(f"remote: {reason}")

    def _handle_bulk_data(self, frame: bytes | bytearray | memoryview) -> None:
        """The raw frame a BULK announced: the stream's next bytes, kept as they arrived."""
        assert self._bulk is not None
        sid, n = self._bulk
        self._bulk = None
        if len(frame) != n:
            raise ProtocolError(f"stream {sid}: BULK announced {n} bytes, got {len(frame)}")
        stream = self._streams.get(sid)
        if stream is None or stream.is_reset:
            return  # finished or reset meanwhile: drop the data
        data = frame if isinstance(frame, bytes) else bytes(frame)  # the channel may reuse it
        self._deliver(stream, memoryview(data))

    def _deliver(self, stream: MuxStream, payload: memoryview) -> bool:
        """Queue received bytes on ``stream``; False (and a reset) past the memory limits."""
        n = len(payload)
        if not self._reserve(n):
            logger.info(
                "%s: resetting stream %d: memory limit (%d bytes held)",
                self.label,
                stream.stream_id,
                self._held_total,
            )
            stream.reset("memory limit")
            return False
        stream.queue_received(payload)
        return True

    async def _run_handler(self, stream: MuxStream) -> None:
        with trio.CancelScope() as scope:
            stream.cancel_on_reset(scope)
            try:
                await self._handle_stream(stream)
            except ConnectionClosed as e:
                if not stream.is_reset and not self.is_closed:
                    raise
                logger.debug("%s: stream %d handler ended: %s", self.label, stream.stream_id, e)
            finally:
                if not stream.finished:
                    stream.reset("handler finished")

    # -- bookkeeping ---------------------------------------------------------------------
    def _goaway(self, reason: str) -> bytes:
        return encode_frame(GOAWAY, self._last_remote_id, reason_bytes(reason))

    def _reserve(self, n: int) -> bool:
        if self._held_total + n > self.config.max_buffered_bytes:
            return False
        if self.budget is not None and not self.budget.try_reserve(n):
            return False
        self._held_total += n
        return True

    @property
    def held_bytes(self) -> int:
        """Received bytes currently counted against the memory limits."""
        return self._held_total

    def _streams_changed(self) -> None:
        self.activity += 1

    def _fail(self, reason: str) -> None:
        """A protocol violation: log it and close the connection."""
        if self._closed_reason is None:
            logger.warning("%s: closing connection: protocol violation: %s", self.label, reason)
        self._close_now(f"protocol violation: {reason}")

    def _close_now(self, reason: str) -> None:
        if self._closed_reason is not None:
            return
        self._closed_reason = reason
        self._teardown(reason)
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def _teardown(self, reason: str) -> None:
        if self._closed_reason is None:
            self._closed_reason = reason
        for stream in self._unopened:
            stream.unprocessed = True
        for stream in [*self._streams.values(), *self._unopened]:
            stream.on_reset(f"connection closed: {reason}", discard=True)
        self._control.clear()
        self._window_updates.clear()
        self._control_lot.unpark_all()
        self.closed.set()


async def _refuse_stream(stream: MuxStream) -> None:
    raise ConnectionClosed("the connection is closed")


_CHANNEL_ERRORS = (
    ConnectionClosed,
    ProtocolError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    trio.EndOfChannel,
    OSError,
)
