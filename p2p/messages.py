"""Message framing on a stream: a 4-byte big-endian length, then a msgpack body.

Why a length prefix: the reader learns a message's size before reading it, so a message
above ``max_size`` is rejected without buffering it (a 4 GB prefix costs nothing). msgpack
carries bytes values natively, so tensor chunks travel without base64 or pickling (pickle
would let a peer run code). Everything here is pure: no I/O, easy to fuzz.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Any

import msgpack

from p2p.errors import ProtocolError

LENGTH = struct.Struct("!I")
DEFAULT_MAX_MESSAGE_SIZE = 64 << 20
BIG_BYTES = 32 << 10
"""Byte values at least this long are framed without copying (see :func:`encode_parts`)."""
_BIN16 = struct.Struct("!BH")
_BIN32 = struct.Struct("!BI")
_PACKER = msgpack.Packer(use_bin_type=True)
_BYTES_TYPES = (bytes, bytearray, memoryview)

# Extension type codes the RPC layer uses for its own control messages.
EXT_ERROR = 1
EXT_ACCEPT = 2


def pack(obj: Any) -> bytes:
    """The msgpack body of a message; ProtocolError when ``obj`` cannot be encoded."""
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"cannot encode message: {e}") from None


def unpack(body: bytes | bytearray | memoryview) -> Any:
    """Decode one msgpack body; ProtocolError for anything malformed."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise ProtocolError(f"malformed message: {e!r:.200}") from None


def bin_header(n: int) -> bytes:
    """The msgpack header of a byte string of length ``n``."""
    if n < 256:
        return bytes((0xC4, n))
    if n < 65536:
        return _BIN16.pack(0xC5, n)
    return _BIN32.pack(0xC6, n)


def _big(value: Any) -> memoryview | None:
    if type(value) in _BYTES_TYPES:
        view = memoryview(value)
        if view.nbytes >= BIG_BYTES:
            return view.cast("B") if view.format != "B" or view.ndim != 1 else view
    return None


def _item_parts(value: Any, parts: list[Any]) -> None:
    view = _big(value)
    if view is not None:
        parts.append(bin_header(len(view)))
        parts.append(view)
    else:
        parts.append(pack(value))


def encode_parts(obj: Any, max_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> list[Any]:
    """A message as buffers to send back to back: the length prefix, then the body in pieces.

    Why pieces: a large byte string (a tensor chunk), alone or as a direct value of a dict or
    list, is referenced rather than copied into a msgpack buffer, so a 1 MiB chunk costs no
    extra pass over memory. The bytes on the wire are exactly ``msgpack.packb(obj)``.
    """
    t = type(obj)
    parts: list[Any] = []
    if t is dict and any(_big(v) is not None for v in obj.values()):
        parts.append(_PACKER.pack_map_header(len(obj)))
        for key, value in obj.items():
            parts.append(pack(key))
            _item_parts(value, parts)
    elif (t is list or t is tuple) and any(_big(v) is not None for v in obj):
        parts.append(_PACKER.pack_array_header(len(obj)))
        for value in obj:
            _item_parts(value, parts)
    else:
        _item_parts(obj, parts)
    size = sum(len(p) for p in parts)
    if size > max_size:
        raise ProtocolError(f"message of {size} bytes exceeds the limit of {max_size}")
    return [LENGTH.pack(size), *parts]


def encode_message(obj: Any, max_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> tuple[bytes, bytes]:
    """(length prefix, body) of ``obj``; ProtocolError when the body exceeds ``max_size``."""
    prefix, *parts = encode_parts(obj, max_size)
    return prefix, b"".join(parts)


def bin_payload_length(head: bytes | bytearray | memoryview) -> tuple[int, int] | None:
    """For a body starting with a msgpack bin header: (header length, payload length)."""
    kind = head[0]
    if kind == 0xC6 and len(head) >= 5:
        return 5, _BIN32.unpack_from(head)[1]
    if kind == 0xC5 and len(head) >= 3:
        return 3, _BIN16.unpack_from(head)[1]
    return None


def check_length(prefix: bytes | bytearray | memoryview, max_size: int) -> int:
    """The body length a prefix announces; ProtocolError when above ``max_size``."""
    (n,) = LENGTH.unpack(prefix)
    if n > max_size:
        raise ProtocolError(f"peer announced a message of {n} bytes (limit {max_size})")
    return n


class MessageParser:
    """Incremental decoder: feed bytes as they arrive, pop whole messages.

    Buffers at most one message plus one prefix, so memory stays below ``max_size + 4``
    plus the last chunk fed.
    """

    def __init__(self, max_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> None:
        self.max_size = max_size
        self._chunks: deque[memoryview] = deque()
        self._buffered = 0
        self._need: int | None = None  # body length of the message being assembled

    @property
    def buffered(self) -> int:
        return self._buffered

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if len(data):
            self._chunks.append(memoryview(data).cast("B"))
            self._buffered += len(data)

    def _take(self, n: int) -> bytes | memoryview:
        if n == 0:
            return b""
        first = self._chunks[0]
        if len(first) >= n:
            out: bytes | memoryview = first[:n]
            if len(first) == n:
                self._chunks.popleft()
            else:
                self._chunks[0] = first[n:]
        else:
            parts = []
            need = n
            while need:
                c = self._chunks[0]
                if len(c) <= need:
                    parts.append(self._chunks.popleft())
                    need -= len(c)
                else:
                    parts.append(c[:need])
                    self._chunks[0] = c[need:]
                    need = 0
            out = b"".join(parts)
        self._buffered -= n
        return out

    def next_message(self) -> tuple[bool, Any]:
        """(True, message) when a whole message is buffered, else (False, None).

        Raises ProtocolError for an oversized prefix or a malformed body.
        """
        if self._need is None:
            if self._buffered < LENGTH.size:
                return False, None
            self._need = check_length(self._take(LENGTH.size), self.max_size)
        if self._buffered < self._need:
            return False, None
        body = self._take(self._need)
        self._need = None
        return True, unpack(body)

    @property
    def at_boundary(self) -> bool:
        """True when no partial message is buffered (a clean place for the stream to end)."""
        return self._need is None and self._buffered == 0
