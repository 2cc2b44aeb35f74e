"""The multiplexer's frames: kinds, header, encoding and checked decoding (pure, no I/O).

Wire format: each channel frame carries exactly one mux frame, a 5-byte header (kind: u8,
stream id: u32 big-endian) and a payload. Stream ids opened by the dialing side are odd,
by the listening side even, and increase monotonically, so both sides can open streams
without coordinating and stale frames for finished streams are recognised and dropped.

Kinds: OPEN (empty payload), DATA (bytes), WINDOW (u32 credit increment), EOF (the sender
will write no more), DATA_EOF (DATA then EOF: a whole request or response in one frame),
OPEN_DATA and OPEN_DATA_EOF (a stream's first frame carrying data: a unary call is one frame
each way; the opener assigns the id when that frame leaves, keeping ids ordered on the wire),
RESET (utf-8 reason; both directions abort, data already received stays readable), GOAWAY
(utf-8 reason; the sender is closing the connection; its stream id field is the last stream
the sender saw opened, so the peer knows which of its streams were never processed and may
safely retry them elsewhere: :attr:`MuxStream.unprocessed`), BULK (u32 n, then optional
stream bytes: those bytes are DATA, and the next channel frame is n more bytes of DATA for this
stream, with no mux header), PING and PONG (stream 0, an opaque payload of at most 8 bytes; a
PING is answered by a PONG carrying the same payload: keepalive and liveness, and neither
counts as stream activity, so an idle connection still closes when idle).

Why BULK: a large buffer (a 1 MiB tensor chunk) then travels as a channel frame of its own, so
the sender encrypts it straight from the caller's memory (no header + payload concatenation)
and the receiver's decrypted frame *is* the chunk: a message made of it is handed over without
another copy. The two frames leave in one channel write, so nothing can come between them.
Small data just before the piece (a message's length prefix and msgpack header) rides inside
the BULK frame, so a 1 MiB message is two channel frames, not three.
"""

from __future__ import annotations

import struct

from p2p.errors import ProtocolError

OPEN, DATA, WINDOW, EOF, RESET, GOAWAY, DATA_EOF, OPEN_DATA, OPEN_DATA_EOF, BULK = range(10)
PING, PONG = 10, 11
KIND_NAMES = (
    "OPEN",
    "DATA",
    "WINDOW",
    "EOF",
    "RESET",
    "GOAWAY",
    "DATA_EOF",
    "OPEN_DATA",
    "OPEN_DATA_EOF",
    "BULK",
    "PING",
    "PONG",
)
OPENING = {DATA: OPEN_DATA, DATA_EOF: OPEN_DATA_EOF, EOF: OPEN_DATA_EOF}
HEADER = struct.Struct("!BI")
WINDOW_PAYLOAD = struct.Struct("!I")
BULK_PAYLOAD = WINDOW_PAYLOAD  # u32 byte count of the raw frame that follows (then data)
BULK_MIN = 64 << 10
"""Buffers at least this long are sent as BULK frames (below it a copy is cheaper than a frame)."""
MAX_REASON_BYTES = 256
MAX_PING_BYTES = 8
MAX_STREAM_ID = 2**32 - 1
MAX_WINDOW = 2**31 - 1


def encode_frame(kind: int, stream_id: int, payload: bytes | bytearray | memoryview = b"") -> bytes:
    """One mux frame as bytes (pure; used for every frame we send)."""
    return b"".join((HEADER.pack(kind, stream_id), payload))


def decode_frame(frame: bytes | bytearray | memoryview) -> tuple[int, int, memoryview]:
    """Split a frame into (kind, stream id, payload); ProtocolError for malformed frames."""
    view = memoryview(frame)
    if view.format != "B":
        view = view.cast("B")
    if len(view) < HEADER.size:
        raise ProtocolError(f"mux frame of {len(view)} bytes is shorter than its header")
    kind, stream_id = HEADER.unpack_from(view)
    if kind > PONG:
        raise ProtocolError(f"unknown mux frame kind {kind}")
    payload = view[HEADER.size :]
    if kind == OPEN and len(payload):
        raise ProtocolError("OPEN frame with a payload")
    if kind == EOF and len(payload):
        raise ProtocolError("EOF frame with a payload")
    if kind == WINDOW and len(payload) != WINDOW_PAYLOAD.size:
        raise ProtocolError("WINDOW frame payload is not 4 bytes")
    if kind == BULK and len(payload) < BULK_PAYLOAD.size:
        raise ProtocolError("BULK frame payload is shorter than 4 bytes")
    if kind in (RESET, GOAWAY) and len(payload) > MAX_REASON_BYTES:
        raise ProtocolError(f"{KIND_NAMES[kind]} reason longer than {MAX_REASON_BYTES} bytes")
    if kind in (PING, PONG):
        if stream_id != 0 or len(payload) > MAX_PING_BYTES:
            raise ProtocolError(f"{KIND_NAMES[kind]} frame for a stream or longer than 8 bytes")
        return kind, stream_id, payload
    if stream_id == 0 and kind != GOAWAY:
        raise ProtocolError(f"{KIND_NAMES[kind]} frame for stream 0")
    return kind, stream_id, payload


# The reasons a peer gives for closing a connection in the ordinary course of a run (its
# node stops, the connection idled or duplicated another, a NAT dial-back proved an address).
# Their GOAWAY is logged at DEBUG on receipt: every temporary node of a coordinator's manifest
# fetch printed an INFO line. Any other reason (a protocol violation, a failure) stays INFO.
SHUTTING_DOWN = "node shutting down"
IDLE = "idle"
DUPLICATE = "duplicate connection"
DIAL_BACK_PROBE = "dial-back probe"
DISCONNECT = "disconnect"
ROUTINE_CLOSES = frozenset({SHUTTING_DOWN, IDLE, DUPLICATE, DIAL_BACK_PROBE, DISCONNECT})


def reason_bytes(reason: str) -> bytes:
    return reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]
