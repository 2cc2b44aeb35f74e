"""One logical byte stream of a :class:`p2p.mux.Mux`: its windows, buffers and half-closes.

Why apart from the multiplexer: a stream's flow control (what the peer may still send us,
what we may still send, credit given back in quarters of the window) is a state machine of
its own; the :class:`~p2p.mux.Mux` only routes frames to it and writes what it batches.

The two talk through public methods only: a stream sees its mux as a :class:`StreamHost`,
and the mux drives a stream through the methods under "-- driven by the mux --".

:class:`MessageStream` frames messages (:mod:`p2p.messages`) over one such stream: what the
RPC layer's handlers and callers hold; here, so a message goes down to the stream's window in
one module.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol

import msgpack
import trio

from p2p.errors import ConnectionClosed, ProtocolError, RPCError
from p2p.messages import EXT_ERROR, check_length, decode_body, encode_parts
from p2p.mux_config import MuxConfig
from p2p.mux_frames import BULK, DATA, DATA_EOF, EOF, MAX_WINDOW

Frames = list[tuple[int, list[Any]]]  # (frame kind, payload pieces) of one write


class StreamHost(Protocol):
    """What a stream needs from its multiplexer (:class:`p2p.mux.Mux` implements it)."""

    config: MuxConfig
    max_payload: int  # bytes of one DATA frame's payload
    max_bulk: int  # bytes of one BULK piece
    bulk_min: int  # a buffer this long or longer leaves as BULK

    def raise_if_closed(self) -> None:
        """ConnectionClosed if the connection is closed or closing."""
        ...

    async def send_stream_frames(self, stream: MuxStream, frames: Frames) -> None:
        """Write ``stream``'s frames in one channel write (the first one opens the stream)."""
        ...

    def grant(self, stream_id: int, increment: int) -> None:
        """Queue a WINDOW update: the peer may send ``increment`` more bytes on the stream."""
        ...

    def queue_reset(self, stream_id: int, reason: str) -> None:
        """Queue a RESET of the stream for the peer."""
        ...

    def release(self, n: int) -> None:
        """``n`` received bytes no longer count against the memory limits."""
        ...

    def stream_ended(self, stream: MuxStream) -> None:
        """Drop ``stream`` if it is :attr:`~MuxStream.finished` (idempotent)."""
        ...


class MuxStream:
    """One logical, bidirectional byte stream (a ``trio.abc.HalfCloseableStream`` lookalike).

    ``receive_some`` returns an empty bytes object once the peer sent EOF; after a reset,
    every operation raises :class:`ConnectionClosed` carrying the reason.
    """

    def __init__(self, mux: StreamHost, stream_id: int | None, *, outbound: bool) -> None:
        self._mux = mux
        self.stream_id = stream_id  # None until an outbound stream's first frame is sent
        self.frames_sent = 0  # 0: the peer has seen nothing of this stream (safe to retry)
        self._announced = stream_id is not None  # the peer knows (or is about to know) the id
        self._sending = False
        self._receiving = False
        self.unprocessed = False  # known never to have reached the peer's handler
        self.outbound = outbound
        self.protocol = ""  # named by the RPC layer once known (the mux counts bytes by it)
        self._chunks: deque[memoryview] = deque()
        self._buffered = 0  # bytes queued in _chunks
        self._held = 0  # bytes counted against the memory limits: queued + in messages being read
        self._recv_window = mux.config.initial_window  # what the peer may still send us
        self._consumed = 0  # read by our user but not yet granted back to the peer
        self._send_window = mux.config.initial_window  # what we may still send
        self._remote_eof = False
        self._local_eof = False
        self._reset_reason: str | None = None
        self._recv_lot = trio.lowlevel.ParkingLot()
        self._send_lot = trio.lowlevel.ParkingLot()
        self._cancel_scopes: list[trio.CancelScope] = []

    # -- state ---------------------------------------------------------------------------
    @property
    def is_reset(self) -> bool:
        return self._reset_reason is not None

    @property
    def finished(self) -> bool:
        return self._reset_reason is not None or (self._local_eof and self._remote_eof)

    def cancel_on_reset(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` if the stream is reset (how a remote cancellation reaches a handler)."""
        if self._reset_reason is not None:
            scope.cancel()
        else:
            self._cancel_scopes.append(scope)

    @property
    def remote_eof(self) -> bool:
        """The peer sent EOF: it sends no more data."""
        return self._remote_eof

    @property
    def recv_window(self) -> int:
        """Bytes the peer may still send on this stream."""
        return self._recv_window

    def raise_if_reset(self) -> None:
        if self._reset_reason is not None:
            raise ConnectionClosed(f"stream reset: {self._reset_reason}")

    # -- receiving -----------------------------------------------------------------------
    async def receive_some(self, max_bytes: int | None = None) -> bytes | memoryview:
        """Up to ``max_bytes`` bytes (any amount when None); ``b""`` at EOF.

        Reading buffered data does not yield to the scheduler (only a cancellation point):
        a reader runs out of buffered data within one window and then waits anyway.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._chunks:
            self.raise_if_reset()
            if self._remote_eof:
                return b""
            await self._recv_lot.park()
        chunk = self._chunks[0]
        if max_bytes is not None and len(chunk) > max_bytes:
            out = chunk[:max_bytes]
            self._chunks[0] = chunk[max_bytes:]
        else:
            out = self._chunks.popleft()
        self._consumed_bytes(len(out))
        self._release(len(out))
        return out

    async def receive_exactly(self, n: int, *, eof_ok: bool = False) -> bytes | memoryview | None:
        """Exactly ``n`` bytes, granting credit as they arrive (``n`` may exceed the window).

        At a clean EOF before the first byte, returns None if ``eof_ok``; any other early end
        raises ConnectionClosed.
        """
        parts = await self.receive_parts(n, eof_ok=eof_ok)
        if parts is None:
            return None
        if len(parts) == 1:
            return parts[0]
        return b"".join(parts)

    async def receive_parts(self, n: int, *, eof_ok: bool = False) -> list[memoryview] | None:
        """Like :meth:`receive_exactly`, as the received pieces (the caller joins them once)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._receiving:
            raise trio.BusyResourceError("another task is receiving on this stream")
        self._receiving = True
        parts: list[memoryview] = []
        got = 0
        try:
            while got < n:
                if not self._chunks:
                    self.raise_if_reset()
                    if self._remote_eof:
                        if got == 0 and eof_ok:
                            return None
                        raise ConnectionClosed(f"stream ended after {got} of {n} bytes")
                    await self._recv_lot.park()
                    continue
                chunk = self._chunks[0]
                take = min(len(chunk), n - got)
                if take == len(chunk):
                    parts.append(self._chunks.popleft())
                else:
                    parts.append(chunk[:take])
                    self._chunks[0] = chunk[take:]
                got += take
                self._consumed_bytes(take)
        except trio.Cancelled:
            if got:
                self.reset("receive cancelled mid-message")
            raise
        finally:
            self._receiving = False
            self._release(got)  # the caller owns these bytes now (or they are gone)
        return parts

    def _release(self, n: int) -> None:
        n = min(n, self._held)
        if n:
            self._held -= n
            self._mux.release(n)

    def _consumed_bytes(self, n: int) -> None:
        self._buffered -= n
        if self._reset_reason is not None:
            return
        self._consumed += n
        # Grant credit back once a quarter of the window was read: fewer frames, full pipe.
        if self._consumed >= self._mux.config.initial_window // 4 and not self._remote_eof:
            assert self.stream_id is not None
            self._recv_window += self._consumed
            self._mux.grant(self.stream_id, self._consumed)
            self._consumed = 0

    # -- sending -------------------------------------------------------------------------
    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.send_parts((data,))

    async def send_parts(
        self, parts: Iterable[bytes | bytearray | memoryview], *, eof: bool = False
    ) -> None:
        """Send several buffers back to back as one byte sequence (saves a concatenation).

        With ``eof`` the last frame also carries EOF (one frame for a small request). Buffers of
        ``BULK_MIN`` bytes or more leave as BULK frames, encrypted from the caller's memory.
        """
        views = deque(v for v in (memoryview(p).cast("B") for p in parts) if len(v))
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._local_eof:
            raise trio.ClosedResourceError("stream already closed for sending")
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        self._sending = True
        mux = self._mux
        try:
            while views:
                # a bulk piece waits for window to send it whole (at most half a window, so
                # a reader that keeps reading always grants enough); other data for any window
                head = len(views[0])
                need = min(head, mux.max_bulk) if head >= mux.bulk_min else 1
                while self._send_window < need:
                    self.raise_if_reset()
                    mux.raise_if_closed()
                    await self._send_lot.park()
                self.raise_if_reset()
                batch = self._take_frames(views, eof)
                last = eof and not views
                if last:
                    self._local_eof = True
                await mux.send_stream_frames(self, batch)
                if last:
                    mux.stream_ended(self)
                    return
        except trio.Cancelled:
            # A partly sent message cannot be finished later: the stream is unusable.
            self.reset("send cancelled")
            raise
        finally:
            self._sending = False
        if eof:
            await self.send_eof()

    def _take_frames(self, views: deque[memoryview], eof: bool) -> Frames:
        """The frames of the next write, within the send window: a DATA frame of small pieces
        and/or one BULK frame (one of each at most, so other streams' frames interleave)."""
        mux = self._mux
        window = self._send_window
        batch: Frames = []
        while views and window > 0:
            v = views[0]
            if len(v) >= mux.bulk_min:
                take = min(len(v), mux.max_bulk)
                if take > window:
                    break
                if take == len(v):
                    views.popleft()
                else:
                    views[0] = v[take:]
                    v = v[:take]
                batch.append((BULK, [v]))
                window -= take
                break
            budget = min(window, mux.max_payload)
            frame_parts: list[memoryview] = []
            size = 0
            while views and size < budget:
                v = views[0]
                if len(v) >= mux.bulk_min:
                    break
                take = min(len(v), budget - size)
                if take == len(v):
                    frame_parts.append(views.popleft())
                else:
                    frame_parts.append(v[:take])
                    views[0] = v[take:]
                size += take
            batch.append((DATA, frame_parts))
            window -= size
            if size == budget:
                break
        self._send_window = window
        if eof and not views:
            kind, frame_parts = batch[-1]
            if kind == DATA:
                batch[-1] = (DATA_EOF, frame_parts)
            else:
                batch.append((EOF, []))
        return batch

    async def send_eof(self) -> None:
        """Tell the peer we will send no more (its reads then end with ``b""``)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._local_eof:
            return
        self.raise_if_reset()
        self._local_eof = True
        try:
            await self._mux.send_stream_frames(self, [(EOF, [])])
        except trio.Cancelled:
            self.reset("send_eof cancelled")
            raise
        self._mux.stream_ended(self)

    async def wait_send_all_might_not_block(self) -> None:
        while self._send_window <= 0:
            self.raise_if_reset()
            await self._send_lot.park()

    # -- closing -------------------------------------------------------------------------
    def reset(self, reason: str = "reset") -> None:
        """Abort both directions now (synchronous, so it also works from cancelled code)."""
        if self.finished:
            return
        if self._announced:  # a never-sent stream: the peer does not know it
            assert self.stream_id is not None
            self._mux.queue_reset(self.stream_id, reason)
        self.on_reset(f"local: {reason}", discard=True)

    async def aclose(self) -> None:
        """Finish the stream: EOF if not sent yet, and a reset if the peer may still write."""
        if self.finished:
            await trio.lowlevel.checkpoint()
            return
        if not self._local_eof:
            with trio.move_on_after(5) as cs:
                try:
                    await self.send_eof()
                except (ConnectionClosed, trio.ClosedResourceError):
                    pass
            if cs.cancelled_caught:
                self.reset("close timed out")
        if not self._remote_eof:
            self.reset("closed by reader")

    # -- driven by the mux -----------------------------------------------------------
    def on_reset(self, reason: str, *, discard: bool = False) -> None:
        """The stream is dead (peer's RESET, local reset, connection gone): wake every waiter,
        cancel the handler; ``discard`` drops unread data too."""
        if self._reset_reason is not None:
            return
        self._reset_reason = reason
        if discard:
            self._chunks.clear()
            self._buffered = 0
        self._release(self._held)  # a dead stream's leftovers no longer count
        # cancel handlers first: a parked handler then sees Cancelled, not a reset error
        for scope in self._cancel_scopes:
            scope.cancel()
        self._cancel_scopes.clear()
        self._recv_lot.unpark_all()
        self._send_lot.unpark_all()
        self._mux.stream_ended(self)

    def frames_leaving(self) -> None:
        """The mux is writing this stream's frames: from now on the peer may know its id."""
        self._announced = True

    def frames_cancelled(self) -> None:
        """A write was cancelled before its frames left: a stream never sent stays unknown."""
        if self.frames_sent == 0:
            self._announced = False

    def frames_written(self) -> None:
        self.frames_sent += 1

    def count_received(self, n: int) -> None:
        """``n`` bytes arrived within the window (the mux checked the window first)."""
        self._recv_window -= n

    def queue_received(self, payload: memoryview) -> None:
        """Queue received bytes for the reader (the mux reserved them against its limits)."""
        n = len(payload)
        self._held += n
        self._chunks.append(payload)
        self._buffered += n
        self._recv_lot.unpark_all()

    def on_remote_eof(self) -> None:
        self._remote_eof = True
        self._recv_lot.unpark_all()

    def on_window(self, increment: int) -> None:
        """The peer granted ``increment`` bytes more; ProtocolError past ``MAX_WINDOW``."""
        self._send_window += increment
        if self._send_window > MAX_WINDOW:
            raise ProtocolError(f"stream {self.stream_id}: send window overflow")
        self._send_lot.unpark_all()

    async def __aenter__(self) -> MuxStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.reset("aborted by error")
        else:
            await self.aclose()

    def __repr__(self) -> str:
        return f"MuxStream({self.stream_id}, {'out' if self.outbound else 'in'})"


class MessageStream:
    """Messages (any msgpack value; bytes travel as-is) over one multiplexed stream."""

    def __init__(self, stream: MuxStream, max_message_size: int) -> None:
        self.stream = stream
        self.max_message_size = max_message_size

    async def send(self, msg: Any) -> None:
        """Send one message; ProtocolError when it is too large or not encodable."""
        if isinstance(msg, msgpack.ExtType):
            raise ProtocolError("ext types are reserved for the RPC layer")
        await self.send_raw(msg)

    async def send_raw(self, msg: Any) -> None:
        """Send one message, the RPC layer's control messages (ext types) included."""
        await self.stream.send_parts(encode_parts(msg, self.max_message_size))

    async def receive_raw(self, *, eof_ok: bool = False) -> Any:
        """The next message as sent, control messages included (the RPC layer's reads);
        EndOfStream at a clean EOF when ``eof_ok``."""
        prefix = await self.stream.receive_exactly(4, eof_ok=eof_ok)
        if prefix is None:
            raise EndOfStream
        try:
            n = check_length(prefix, self.max_message_size)
        except ProtocolError:
            self.stream.reset("message too large")
            raise
        body = await self.stream.receive_parts(n)
        assert body is not None
        try:
            return decode_body(body)
        except ProtocolError:
            self.stream.reset("malformed message")
            raise

    async def receive(self) -> Any:
        """The next message; ConnectionClosed when the peer closed its side (or reset)."""
        try:
            msg = await self.receive_raw(eof_ok=True)
        except EndOfStream:
            raise ConnectionClosed("the peer closed the stream") from None
        return check_ext(msg)

    def __aiter__(self) -> MessageStream:
        return self

    async def __anext__(self) -> Any:
        try:
            msg = await self.receive_raw(eof_ok=True)
        except EndOfStream:
            raise StopAsyncIteration from None
        return check_ext(msg)

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    def reset(self, reason: str = "reset") -> None:
        """Abort the stream in both directions (also cancels the remote handler)."""
        self.stream.reset(reason)

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def __aenter__(self) -> MessageStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.reset("aborted")
        else:
            await self.aclose()


class EndOfStream(Exception):
    """Clean EOF at a message boundary (the RPC layer's, not raised to users)."""


def check_ext(msg: Any) -> Any:
    """``msg``, unless it is one of the RPC layer's control messages: an error raises
    RPCError (remote), another one ProtocolError."""
    if isinstance(msg, msgpack.ExtType):
        if msg.code == EXT_ERROR:
            raise RPCError(bytes(msg.data).decode("utf-8", "replace"), remote=True)
        raise ProtocolError(f"unexpected control message (ext type {msg.code})")
    return msg
