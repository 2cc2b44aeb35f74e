"""Message framing on a stream: a 4-byte big-endian length, then a msgpack body.

Why a length prefix: the reader learns a message's size before reading it, so a message
above ``max_size`` is rejected without buffering it (a 4 GB prefix costs nothing). msgpack
carries bytes values natively, so tensor chunks travel without base64 or pickling (pickle
would let a peer run code). Everything here is pure: no I/O, easy to fuzz;
:class:`p2p.mux_stream.MessageStream` reads the bytes and decodes them with :func:`decode_body`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
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


def _whole_bytes(view: memoryview) -> bytes | None:
    """The bytes object ``view`` spans entirely, if it does (then it needs no copy)."""
    obj = view.obj
    if type(obj) is bytes and view.nbytes == len(obj):
        return obj
    return None


def decode_body(pieces: Sequence[bytes | bytearray | memoryview]) -> Any:
    """The message a body holds, the body given as the pieces it arrived in (what
    :class:`p2p.mux_stream.MessageStream` reads off a stream); ProtocolError for anything malformed.

    Why pieces: a body of ``BIG_BYTES`` or more that is one msgpack byte string (a tensor
    chunk) is returned as its payload joined once, or as the very bytes object a BULK frame
    delivered when the payload arrived as one, instead of joining then copying it again.
    """
    n = sum(len(p) for p in pieces)
    if n >= BIG_BYTES and pieces:
        sizes = bin_payload_length(_first_bytes(pieces, 5))
        if sizes is not None and sum(sizes) == n:
            payload = _skip(pieces, sizes[0])
            if len(payload) == 1 and (whole := _whole_bytes(memoryview(payload[0]))) is not None:
                return whole  # the payload came as one BULK frame: no copy at all
            return b"".join(payload)
    body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    return unpack(body)


def _first_bytes(pieces: Sequence[bytes | bytearray | memoryview], n: int) -> bytes:
    """The first ``n`` bytes of ``pieces`` (fewer if they hold fewer), copying only those."""
    out = b""
    for piece in pieces:
        out += bytes(piece[: n - len(out)])
        if len(out) == n:
            break
    return out


def _skip(pieces: Sequence[bytes | bytearray | memoryview], n: int) -> list[Any]:
    """``pieces`` without their first ``n`` bytes."""
    out: list[Any] = []
    for piece in pieces:
        if n >= len(piece):
            n -= len(piece)
        else:
            out.append(piece[n:] if n else piece)
            n = 0
    return out


def check_length(prefix: bytes | bytearray | memoryview, max_size: int) -> int:
    """The body length a prefix announces; ProtocolError when above ``max_size``."""
    (n,) = LENGTH.unpack(prefix)
    if n > max_size:
        raise ProtocolError(f"peer announced a message of {n} bytes (limit {max_size})")
    return n
