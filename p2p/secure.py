"""The secure channel: an authenticated, encrypted frame pipe over any ``trio.abc.Stream``.

``secure_outbound`` (dialer) and ``secure_inbound`` (listener) run the handshake of
:mod:`p2p.handshake` under a deadline, then return a :class:`SecureChannel` that sends and
receives whole frames. On the wire each frame is a 4-byte big-endian ciphertext length followed by
the AEAD ciphertext (plaintext + 16-byte tag); the nonce is a per-direction 64-bit counter that is
never sent, so a replayed, reordered, dropped or altered frame fails authentication. Any such
failure, a length prefix above ``max_frame + 16`` or a truncated frame closes the connection and
raises :class:`ConnectionClosed`; the reason is logged.

Speed: on a trio ``SocketStream`` the channel reads into one reusable buffer and encrypts with
``encrypt_into`` into one reusable send buffer (header and ciphertext leave in one write), so a
frame costs one cipher pass and no Python-level copies; ``send_frames`` batches several frames
into one write. Other streams (memory streams, the simulator) get a fresh buffer per write, since
they may keep what they are given. While a big frame is incomplete the socket's SO_RCVLOWAT is
the number of bytes still missing, so the kernel wakes the reader once per frame rather than
once per burst of segments (fewer wake-ups on both sides). On POSIX the socket's descriptor is
read and written directly (``os.readv`` / ``os.write``, waiting with trio's
``wait_readable``/``wait_writable`` only when the kernel says it would block): trio's socket
methods pass through the scheduler twice per call, and each pass costs about as much as
encrypting 10 KiB. Every read or write still makes exactly one schedule point (the wait, or a
checkpoint after an immediate success), so a busy connection cannot starve other tasks. Big
frames decrypt into a fresh bytes object that is not zero-filled first (:mod:`secure_buffers`).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import struct
import sys
from collections.abc import Awaitable, Callable, Sequence

import trio
from cryptography.exceptions import InvalidTag

from p2p import secure_buffers
from p2p.aead import MAX_COUNTER, TAG_BYTES, local_offers, make_aead, nonce_for
from p2p.errors import ConnectionClosed, HandshakeError
from p2p.handshake import (
    MAX_HANDSHAKE_MESSAGE,
    InitiatorHandshake,
    ResponderHandshake,
    SessionKeys,
)
from p2p.identity import Identity, PeerID

logger = logging.getLogger(__name__)

DEFAULT_MAX_FRAME = 1 << 20  # plaintext bytes per frame
MAX_FRAME_LIMIT = 1 << 30  # far below what the 4-byte length prefix could express
HEADER_BYTES = 4
_HEADER = struct.Struct(">I")
_HS_HEADER = struct.Struct(">H")
_INITIAL_BUFFER = 4096  # grows on demand: half-open connections stay cheap
_SLACK = 64 * 1024  # room to read ahead past the current frame
_STREAM_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
_SO_RCVLOWAT: int | None = getattr(socket, "SO_RCVLOWAT", None) if sys.platform == "linux" else None
_LOWAT_MIN = 64 << 10  # frames missing less than this are read as bytes come
_FRESH_MIN = 64 << 10  # frames at least this long decrypt into unzeroed bytes (secure_buffers)
# Direct descriptor I/O where sockets are file descriptors (not Windows).
_RAW_IO = hasattr(os, "readv") and sys.platform != "win32"


class _EOF(Exception):
    """The peer closed its side (internal; becomes ConnectionClosed or HandshakeError)."""


class _Reader:
    """Buffered reader over a stream: reads greedily into one buffer, hands out memoryviews.

    Views returned by :meth:`take` stay valid until the next :meth:`ensure`.
    """

    def __init__(self, stream: trio.abc.Stream, max_capacity: int) -> None:
        self._stream = stream
        sock = getattr(stream, "socket", None)
        self._sock = sock if isinstance(sock, trio.socket.SocketType) else None
        self._max_capacity = max_capacity
        self._buf = bytearray(min(_INITIAL_BUFFER, max_capacity))
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._lowat = 1  # the socket's SO_RCVLOWAT, as last set

    @property
    def buffered(self) -> int:
        return self._end - self._start

    def peek(self) -> memoryview:
        return self._view[self._start : self._end]

    def _make_room(self, n: int) -> None:
        """Arrange that ``n`` bytes fit from the read position (compacting or growing)."""
        start, end = self._start, self._end
        if start == end:
            self._start = self._end = start = end = 0
        if start + n <= len(self._buf):
            return
        pending = end - start
        if n <= len(self._buf):
            self._view[:pending] = self._view[start:end]  # memmove, overlap-safe
        else:
            size = min(max(n + _SLACK, 2 * len(self._buf)), self._max_capacity)
            if size < n:
                raise ValueError(f"cannot buffer {n} bytes (limit {self._max_capacity})")
            buf = bytearray(size)
            buf[:pending] = self._view[start:end]
            self._buf, self._view = buf, memoryview(buf)
        self._start, self._end = 0, pending

    def _wake_after(self, missing: int) -> None:
        """Have the kernel report the socket readable only once ``missing`` bytes are there
        (SO_RCVLOWAT), for big frames: one wake-up per frame rather than one per segment
        burst. Never above what is missing, so the wait always ends (EOF ends it too)."""
        lowat = missing if missing >= _LOWAT_MIN else 1
        if lowat == self._lowat:
            return
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, _SO_RCVLOWAT, lowat)  # type: ignore[union-attr]
        except OSError:
            return
        self._lowat = lowat

    async def _fill(self, missing: int) -> None:
        """One read from a stream that is not a socket, or where sockets are not descriptors."""
        free = self._view[self._end :]
        sock = self._sock
        if sock is not None:
            if _SO_RCVLOWAT is not None:
                self._wake_after(missing)
            got = await sock.recv_into(free)
        else:
            data = await self._stream.receive_some(len(free))
            got = len(data)
            free[:got] = data
        if not got:
            raise _EOF
        self._end += got

    async def _fill_raw(self, n: int) -> None:
        """Read the socket's descriptor until ``n`` bytes are buffered, with one schedule
        point: the first wait, or a checkpoint if the kernel had everything already (the bytes
        are buffered by then, so a cancellation there loses nothing). SO_RCVLOWAT is set only
        before a wait: a read that does not block returns what is there whatever the mark."""
        sock = self._sock
        assert sock is not None
        waited = False
        while self._end - self._start < n:
            try:
                # fileno() each time: -1 (EBADF) once closed, never a reused number
                got = os.readv(sock.fileno(), (self._view[self._end :],))
            except BlockingIOError:
                if _SO_RCVLOWAT is not None:
                    self._wake_after(n - (self._end - self._start))
                await trio.lowlevel.wait_readable(sock)
                waited = True
                continue
            if not got:
                raise _EOF
            self._end += got
        if not waited:
            await trio.lowlevel.checkpoint()

    async def ensure(self, n: int) -> None:
        """Wait until at least ``n`` bytes are buffered; raises _EOF if the peer closes first."""
        if self._end - self._start >= n:
            return
        self._make_room(n)
        if self._sock is not None and _RAW_IO:
            await self._fill_raw(n)
            return
        while self._end - self._start < n:
            await self._fill(n - (self._end - self._start))

    def take(self, n: int) -> memoryview:
        start = self._start
        self._start = start + n
        return self._view[start : start + n]


class SecureChannel:
    """An encrypted, authenticated frame channel to a peer whose identity has been proven.

    ``send_frame`` and ``receive_frame`` may run concurrently with each other, but each allows one
    caller at a time. A send cancelled once its bytes began to leave finishes its frames (within
    ``finish_timeout``, else the channel closes) and returns; the cancellation takes effect at
    the caller's next checkpoint. Half a frame would close the channel, and with it every stream
    of a multiplexed connection, for one stream's cancelled send.
    """

    finish_timeout: float = 60.0
    """Seconds a cancelled send may take to finish the frames it began."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        reader: _Reader,
        keys: SessionKeys,
        local_peer: PeerID,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        frame_timeout: float | None = None,
    ) -> None:
        self.transport_stream = stream
        self.local_peer = local_peer
        self.remote_peer: PeerID = keys.remote_peer
        self.remote_public_key: bytes = keys.remote_public_key
        self.cipher: str = keys.cipher
        self.max_frame = max_frame
        self.frame_timeout = frame_timeout
        self._reader = reader
        self._sock = reader._sock
        self._send_aead = make_aead(keys.cipher, keys.send_key)
        self._recv_aead = make_aead(keys.cipher, keys.recv_key)
        self._send_counter = 0
        self._recv_counter = 0
        self._send_buf = bytearray(0)
        self._send_view = memoryview(self._send_buf)
        self._closed_reason: str | None = None
        self._sending = False
        self._receiving = False
        self._watched = False  # watch_frames is running: frames are timed without scopes
        self._frame_started: float | None = None  # when the frame being read began arriving

    def __repr__(self) -> str:
        return f"SecureChannel({self.local_peer} <-> {self.remote_peer}, {self.cipher})"

    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    @property
    def frame_overhead(self) -> int:
        """Bytes each frame adds on the wire: its length prefix and authentication tag."""
        return HEADER_BYTES + TAG_BYTES

    async def _fail(self, reason: str, *, level: int = logging.WARNING) -> ConnectionClosed:
        """Close the connection for ``reason`` and return the error to raise."""
        if self._closed_reason is None:
            self._closed_reason = reason
            logger.log(level, "closing secure channel to %s: %s", self.remote_peer, reason)
            await trio.aclose_forcefully(self.transport_stream)
        return self._closed_error()

    def _closed_error(self) -> ConnectionClosed:
        return ConnectionClosed(f"connection to {self.remote_peer} closed: {self._closed_reason}")

    # ---- sending -------------------------------------------------------------------------

    def _frame_buffer(self, total: int) -> memoryview:
        cap = HEADER_BYTES + self.max_frame + TAG_BYTES + _SLACK  # a big frame + small ones
        if self._sock is None or total > cap:
            return memoryview(bytearray(total))  # the stream may keep it / too big to keep
        if len(self._send_buf) < total:
            self._send_buf = bytearray(max(total, min(2 * len(self._send_buf), cap)))
            self._send_view = memoryview(self._send_buf)
        return self._send_view[:total]

    async def send_frame(self, data: bytes | bytearray | memoryview) -> None:
        """Encrypt and send one frame of at most ``max_frame`` bytes."""
        await self.send_frames((data,))

    async def send_frames(self, frames: Sequence[bytes | bytearray | memoryview]) -> None:
        """Encrypt several frames and send them with one write (fewer syscalls for small ones).

        The receiver sees ordinary frames, one ``receive_frame`` each.
        """
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this channel")
        self._sending = True
        try:
            await self._send_frames(frames)
        finally:
            self._sending = False

    async def _send_frames(self, frames: Sequence[bytes | bytearray | memoryview]) -> None:
        if self._closed_reason is not None:
            raise self._closed_error()
        sizes = [f.nbytes if isinstance(f, memoryview) else len(f) for f in frames]
        if sizes and max(sizes) > self.max_frame:
            raise ValueError(f"frame of {max(sizes)} bytes exceeds max_frame {self.max_frame}")
        counter = self._send_counter
        if counter + len(sizes) > MAX_COUNTER:
            raise await self._fail("send nonce counter exhausted")
        total = len(sizes) * (HEADER_BYTES + TAG_BYTES) + sum(sizes)
        buf = self._frame_buffer(total)
        offset = 0
        encrypt_into = self._send_aead.encrypt_into
        for i, (data, size) in enumerate(zip(frames, sizes, strict=True)):
            _HEADER.pack_into(buf, offset, size + TAG_BYTES)
            end = offset + HEADER_BYTES + size + TAG_BYTES
            encrypt_into(nonce_for(counter + i), data, None, buf[offset + HEADER_BYTES : end])
            offset = end
        sent = 0
        try:
            sock = self._sock
            if sock is not None and _RAW_IO:
                await trio.lowlevel.checkpoint_if_cancelled()
                waited = False
                while sent < total:
                    try:
                        # fileno() each time: -1 (EBADF) once closed, never a reused number
                        sent += os.write(sock.fileno(), buf[sent:])
                    except BlockingIOError:
                        try:
                            await trio.lowlevel.wait_writable(sock)
                        except trio.Cancelled:
                            if not sent:
                                raise  # nothing left: the channel is intact
                            await self._finish_raw(sock, buf, sent, total)
                            break
                        waited = True
                if not waited:
                    await trio.lowlevel.cancel_shielded_checkpoint()
            elif sock is not None:
                while sent < total:
                    sent += await sock.send(buf[sent:])
            else:
                # Cancellable until the stream takes bytes; from then on the frames finish.
                await self.transport_stream.wait_send_all_might_not_block()
                sent = -1  # unknown progress once send_all starts
                with trio.CancelScope(shield=True) as scope:
                    scope.deadline = trio.current_time() + self.finish_timeout
                    await self.transport_stream.send_all(buf)
                if scope.cancelled_caught:
                    raise await self._fail("send interrupted mid-frame", level=logging.INFO)
        except _STREAM_ERRORS as e:
            raise await self._fail(f"send failed: {e!r}", level=logging.INFO) from None
        except BaseException:
            if sent:
                await self._fail("send interrupted mid-frame", level=logging.INFO)
            raise
        self._send_counter = counter + len(sizes)

    async def _finish_raw(
        self, sock: socket.socket, buf: memoryview, sent: int, total: int
    ) -> None:
        """Write the rest of frames a cancellation cut, within ``finish_timeout`` (else the
        channel closes)."""
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + self.finish_timeout
            while sent < total:
                try:
                    sent += os.write(sock.fileno(), buf[sent:])
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(sock)
        if scope.cancelled_caught:
            raise await self._fail("send interrupted mid-frame", level=logging.INFO)

    # ---- receiving -----------------------------------------------------------------------

    async def receive_frame(self) -> bytes:
        """Receive and authenticate the next frame; ConnectionClosed on EOF or any violation."""
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this channel")
        self._receiving = True
        try:
            return await self._receive_frame()
        finally:
            self._receiving = False

    async def _receive_frame(self) -> bytes:
        if self._closed_reason is not None:
            raise self._closed_error()
        reader = self._reader
        try:
            buffered = reader.buffered
            length = _HEADER.unpack_from(reader.peek())[0] if buffered >= HEADER_BYTES else -1
            if 0 <= length <= buffered - HEADER_BYTES:
                # the whole frame is here already (small frames after a big read): no deadline
                if length < TAG_BYTES or length > self.max_frame + TAG_BYTES:
                    raise await self._fail(f"invalid frame length {length}")
            elif self.frame_timeout is None:
                length = await self._read_frame(reader)
            elif self._watched:
                await reader.ensure(1)  # idle time between frames is not limited here
                self._frame_started = trio.current_time()
                try:
                    length = await self._read_frame(reader)
                finally:
                    self._frame_started = None
            else:
                await reader.ensure(1)
                with trio.move_on_after(self.frame_timeout) as scope:
                    length = await self._read_frame(reader)
                if scope.cancelled_caught:
                    raise await self._fail(f"frame not completed within {self.frame_timeout} s")
        except _EOF:
            if reader.buffered:
                raise await self._fail("connection ended inside a frame") from None
            raise await self._fail("peer closed the connection", level=logging.DEBUG) from None
        except _STREAM_ERRORS as e:
            raise await self._fail(f"receive failed: {e!r}", level=logging.INFO) from None
        if self._recv_counter >= MAX_COUNTER:
            raise await self._fail("receive nonce counter exhausted")
        reader.take(HEADER_BYTES)
        ciphertext = reader.take(length)
        nonce = nonce_for(self._recv_counter)
        try:
            if length >= _FRESH_MIN and secure_buffers.AVAILABLE:
                plaintext, out = secure_buffers.fresh_bytes(length - TAG_BYTES)
                try:
                    self._recv_aead.decrypt_into(nonce, ciphertext, None, out)
                finally:
                    out.release()  # nothing may write into the bytes object after this
            else:
                plaintext = self._recv_aead.decrypt(nonce, ciphertext, None)
        except InvalidTag:
            raise await self._fail(
                "frame failed authentication (tampered, replayed or reordered)"
            ) from None
        self._recv_counter += 1
        return plaintext

    async def _read_frame(self, reader: _Reader) -> int:
        """Buffer the next whole frame; its ciphertext length."""
        await reader.ensure(HEADER_BYTES)
        length = _HEADER.unpack_from(reader.peek())[0]
        if length < TAG_BYTES or length > self.max_frame + TAG_BYTES:
            raise await self._fail(f"invalid frame length {length}")
        await reader.ensure(HEADER_BYTES + length)
        return length

    async def watch_frames(self) -> None:
        """Enforce ``frame_timeout`` from this task until the channel closes (run it in a
        nursery that lives as long as the channel; the mux does).

        Why: a cancel scope per frame costs more than the rest of receiving a 1 MiB frame
        outside the cipher; with a watcher, a frame in progress only records when it started.
        Only over sockets, whose closing wakes a blocked reader.
        """
        timeout = self.frame_timeout
        if timeout is None or self._sock is None or self._watched:
            return
        self._watched = True
        try:
            while self._closed_reason is None:
                started = self._frame_started
                now = trio.current_time()
                if started is not None and now - started >= timeout:
                    await self._fail(f"frame not completed within {timeout} s")
                    return
                await trio.sleep_until((now if started is None else started) + timeout)
        finally:
            self._watched = False

    async def aclose(self) -> None:
        """Close the connection (idempotent)."""
        if self._closed_reason is None:
            self._closed_reason = "closed locally"
            await self.transport_stream.aclose()
        else:
            await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> SecureChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# ---- handshake I/O ---------------------------------------------------------------------------


async def _send_message(stream: trio.abc.Stream, message: bytes) -> None:
    await stream.send_all(_HS_HEADER.pack(len(message)) + message)


async def _receive_message(reader: _Reader) -> bytes:
    await reader.ensure(2)
    size = _HS_HEADER.unpack_from(reader.peek())[0]
    if size > MAX_HANDSHAKE_MESSAGE:
        raise HandshakeError(f"handshake message of {size} bytes exceeds {MAX_HANDSHAKE_MESSAGE}")
    await reader.ensure(2 + size)
    reader.take(2)
    return bytes(reader.take(size))


def _check_timeout(timeout: float) -> None:
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"handshake timeout must be a positive number of seconds, got {timeout}")


async def _run_handshake(
    stream: trio.abc.Stream,
    steps: Callable[[_Reader], Awaitable[SessionKeys]],
    role: str,
    timeout: float,
    max_frame: int,
) -> tuple[_Reader, SessionKeys]:
    """Run ``steps(reader)`` under the deadline; on any failure close the stream and raise."""
    _check_timeout(timeout)
    if not 0 < max_frame <= MAX_FRAME_LIMIT:
        raise ValueError(f"max_frame must be in 1..{MAX_FRAME_LIMIT}, got {max_frame}")
    reader = _Reader(stream, HEADER_BYTES + max_frame + TAG_BYTES + _SLACK)
    try:
        try:
            with trio.fail_after(timeout):
                keys = await steps(reader)
        except trio.TooSlowError:
            raise HandshakeError(f"{role} handshake timed out after {timeout} s") from None
        except _EOF:
            raise HandshakeError(f"peer closed the connection in the {role} handshake") from None
        except _STREAM_ERRORS as e:
            raise HandshakeError(f"connection failed during the {role} handshake: {e!r}") from None
    except HandshakeError as e:
        logger.info("%s handshake failed: %s", role, e)
        await trio.aclose_forcefully(stream)
        raise
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return reader, keys


async def secure_outbound(
    stream: trio.abc.Stream,
    identity: Identity,
    expected: PeerID | None = None,
    *,
    timeout: float = 10.0,
    cipher: str | None = None,
    max_frame: int = DEFAULT_MAX_FRAME,
    frame_timeout: float | None = None,
) -> SecureChannel:
    """Secure a dialed stream. Raises PeerIDMismatch if the answering key is not ``expected``.

    ``cipher`` overrides AES hardware detection (see :func:`p2p.aead.local_offers`). On any
    failure, cancellation included, the stream is closed.
    """
    handshake = InitiatorHandshake(identity, local_offers(cipher), expected)

    async def steps(reader: _Reader) -> SessionKeys:
        await _send_message(stream, handshake.hello())
        reply = await _receive_message(reader)
        finish, keys = handshake.process_reply(reply)
        await _send_message(stream, finish)
        return keys

    reader, keys = await _run_handshake(stream, steps, "outbound", timeout, max_frame)
    return SecureChannel(
        stream, reader, keys, identity.peer_id, max_frame=max_frame, frame_timeout=frame_timeout
    )


async def secure_inbound(
    stream: trio.abc.Stream,
    identity: Identity,
    *,
    timeout: float = 10.0,
    cipher: str | None = None,
    max_frame: int = DEFAULT_MAX_FRAME,
    frame_timeout: float | None = None,
) -> SecureChannel:
    """Secure an accepted stream; the returned channel's ``remote_peer`` is proven."""
    handshake = ResponderHandshake(identity, local_offers(cipher))

    async def steps(reader: _Reader) -> SessionKeys:
        hello = await _receive_message(reader)
        await _send_message(stream, handshake.process_hello(hello))
        return handshake.process_finish(await _receive_message(reader))

    reader, keys = await _run_handshake(stream, steps, "inbound", timeout, max_frame)
    return SecureChannel(
        stream, reader, keys, identity.peer_id, max_frame=max_frame, frame_timeout=frame_timeout
    )
