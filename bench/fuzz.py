"""Fuzz every decoder of bytes that arrive from the network.

``python -m bench.fuzz [--inputs 100000] [--seed 0] [--only NAME]`` feeds each decoder a mix of
random bytes, mutated valid messages and structure-aware random msgpack (valid messages with
fields replaced by random values), and counts per decoder: inputs, rejected with the documented
exception, accepted, crashes (any other exception type) and hangs (an input that takes longer
than ``--hang-after`` seconds). The last line is one JSON object
``{"decoders": {...}, "crashes": N, "hangs": N, "inputs": N}``.

The decoder table :data:`DECODERS` is shared with ``tests/reliability/test_fuzz_decoders.py``:
each entry takes raw bytes (as a peer would send them) and either returns or raises one of the
exception types its module documents.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import random
import signal
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import trio

from bench.fuzz_inputs import InputGenerator
from dedloc_jax.averaging import wire as ar_wire
from dedloc_jax.averaging.chunk_codecs import CODECS
from dedloc_jax.averaging.errors import BadContributionError, CodecError, GroupError
from dedloc_jax.averaging.group import GroupSpec, Member
from dedloc_jax.progress import PeerProgress
from dedloc_jax.state import StateAssembler, StateError, StateManifest, pack_state
from examples.sahajbert import manifest as sahajbert_manifest
from examples.sahajbert import metrics as sahajbert_metrics
from p2p import messages, mux
from p2p.aead import OFFER_AES, OFFER_CHACHA, make_aead, nonce_for
from p2p.dht import wire as dht_wire
from p2p.dht.errors import InvalidRecordError
from p2p.dht.records import Record, owner_marker, pack_value
from p2p.dht.validation import ValidatorChain, sign_record
from p2p.errors import ConnectionClosed, HandshakeError, ProtocolError, RPCError
from p2p.handshake import InitiatorHandshake, ResponderHandshake, SessionKeys
from p2p.identity import Identity
from p2p.rpc import MessageStream
from p2p.secure import SecureChannel, _Reader
from p2p.testing import received_stream

ALICE = Identity.from_seed(b"bench-fuzz-alice")
BOB = Identity.from_seed(b"bench-fuzz-bob")
LIMITS = dht_wire.Limits()
_CHAIN = ValidatorChain()


@dataclass(frozen=True)
class Decoder:
    """One decoder: ``run(data)`` returns or raises one of ``documented``; ``seeds`` are valid
    inputs to mutate; ``message`` says the bytes are a msgpack body (structure-aware inputs)."""

    name: str
    run: Callable[[bytes], Any]
    documented: tuple[type[BaseException], ...]
    seeds: tuple[bytes, ...]
    message: bool = True
    arun: Callable[[bytes], Awaitable[Any]] | None = None  # the same check, inside a trio run


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _msg(parse: Callable[[Any], Any]) -> Callable[[bytes], Any]:
    def run(data: bytes) -> Any:
        return parse(messages.unpack(data))

    return run


# ---- p2p framing ------------------------------------------------------------------------------
MESSAGE_LIMIT = 1 << 17


def _arrival(data: bytes) -> list[bytes | memoryview]:
    """``data`` cut, where its hash says, into the pieces a mux stream queues: DATA frame
    payloads (views into a larger buffer) and BULK frame data (whole bytes objects), half the
    time as a BULK frame brings a big message: the prefix and 5 bytes, then the rest whole."""
    rng = random.Random(hashlib.sha256(data).digest())
    cuts = {0, len(data)}
    whole = rng.random() < 0.5
    pos = 0
    while pos < len(data):
        if whole and pos + 4 <= len(data):
            cuts.add(pos + 9)
            pos += 4 + int.from_bytes(data[pos : pos + 4], "big")
        else:
            pos += rng.choice((1, 4, 5, rng.randint(1, 64), rng.randint(1, 2 * MESSAGE_LIMIT)))
        cuts.add(pos)
    frame = data + b"\x00"  # a view into it never spans a whole bytes object
    bounds = sorted(c for c in cuts if c <= len(data))
    return [
        data[a:b] if whole or rng.random() < 0.5 else memoryview(frame)[a:b]
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]


async def _message_stream_async(data: bytes) -> None:
    """Framed messages as production reads them (:class:`p2p.mux_stream.MessageStream` on a mux
    stream), arriving in pieces; each must equal what msgpack reads from its body."""
    stream = MessageStream(received_stream(_arrival(data)), MESSAGE_LIMIT)
    pos = 0
    async for msg in stream:
        n = int.from_bytes(data[pos : pos + 4], "big")
        body = data[pos + 4 : pos + 4 + n]
        pos += 4 + n
        expected = msgpack.unpackb(body, raw=False, strict_map_key=False)
        if _pack(msg) != _pack(expected):
            raise AssertionError(f"decoded {msg!r:.80} where msgpack reads {expected!r:.80}")


def _message_stream(data: bytes) -> None:
    trio.run(_message_stream_async, data)


def _framed(obj: Any) -> bytes:
    prefix, body = messages.encode_message(obj)
    return prefix + body


def _mux_frame(data: bytes) -> None:
    mux.decode_frame(data)


def _hello(data: bytes) -> None:
    ResponderHandshake(BOB, OFFER_CHACHA | OFFER_AES).process_hello(data)


def _reply(data: bytes) -> None:
    hs = InitiatorHandshake(ALICE, OFFER_CHACHA | OFFER_AES)
    hs.hello()
    hs.process_reply(data)


def _finish(data: bytes) -> None:
    # A fresh responder per input (a handshake is single-use); the hello is a real one.
    init = InitiatorHandshake(ALICE, OFFER_CHACHA)
    resp = ResponderHandshake(BOB, OFFER_CHACHA)
    resp.process_hello(init.hello())
    resp.process_finish(data)


_KEYS = SessionKeys(
    "chacha20-poly1305", b"\x01" * 32, b"\x02" * 32, ALICE.public_key, ALICE.peer_id
)


class _BytesStream(trio.abc.Stream):
    """A stream that yields fixed bytes in small pieces, then EOF (what a hostile peer sends)."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._pos = 0

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        n = min(max_bytes or 4096, 977)
        out = bytes(self._data[self._pos : self._pos + n])
        self._pos += len(out)
        return out

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def _secure_frames_async(data: bytes) -> None:
    stream = _BytesStream(data)
    channel = SecureChannel(stream, _Reader(stream, 1 << 21), _KEYS, BOB.peer_id, max_frame=1 << 16)
    for _ in range(64):  # bounded: every frame is at least 20 bytes
        await channel.receive_frame()


def _secure_frames(data: bytes) -> None:
    trio.run(_secure_frames_async, data)


def _sealed_frames(plaintexts: list[bytes]) -> bytes:
    aead = make_aead("chacha20-poly1305", _KEYS.recv_key)
    out = b""
    for i, p in enumerate(plaintexts):
        ct = aead.encrypt(nonce_for(i), p, None)
        out += struct.pack(">I", len(ct)) + ct
    return out


# ---- DHT --------------------------------------------------------------------------------------
def _store_request(msg: Any) -> None:
    dht_wire.parse_sender(msg, ALICE.peer_id, LIMITS)
    for record, _cache in dht_wire.parse_store_request(msg, LIMITS):
        _CHAIN.validate(record)
        record.decoded()


def _find_request(msg: Any) -> None:
    dht_wire.parse_sender(msg, ALICE.peer_id, LIMITS)
    dht_wire.parse_find_request(msg, LIMITS)


def _find_response(msg: Any) -> None:
    dht_wire.parse_time(msg)
    for _contacts, records in dht_wire.parse_find_response(msg, ["k", 7], LIMITS):
        for record in records or ():
            _CHAIN.validate(record)


def _store_response(msg: Any) -> None:
    dht_wire.parse_time(msg)
    dht_wire.parse_store_response(msg, 2)


def _changes_request(msg: Any) -> None:
    dht_wire.parse_sender(msg, ALICE.peer_id, LIMITS)
    dht_wire.parse_changes_request(msg)


def _changes_response(msg: Any) -> None:
    dht_wire.parse_time(msg)
    records, _cursor, _same = dht_wire.parse_changes_response(msg, "key", LIMITS, 3)
    for record in records:
        _CHAIN.validate(record)


def _dht_seeds() -> dict[str, tuple[bytes, ...]]:
    signed = sign_record(
        Record(f"run/{ALICE.peer_id}", None, pack_value({"a": 1}), 1e9, None), ALICE
    )
    plain = Record("key", "sub", pack_value([1, 2.5, "x"]), 123.0, None)
    addrs = (f"/ip4/127.0.0.1/tcp/4001/p2p/{ALICE.peer_id}",)
    contact = dht_wire.Contact(BOB.peer_id, (f"/ip4/127.0.0.1/tcp/4002/p2p/{BOB.peer_id}",))
    return {
        "store_request": (
            _pack(dht_wire.request(False, addrs, records=[dht_wire.record_to_wire(signed)])),
            _pack(dht_wire.request(True, (), records=[dht_wire.record_to_wire(plain, True)])),
        ),
        "find_request": (
            _pack(dht_wire.request(False, addrs, queries=["key", b"\x07" * 32])),
            _pack(dht_wire.request(True, (), queries=["key"], count=6)),
        ),
        "find_response": (
            _pack(
                dht_wire.response(
                    5.0,
                    results=[
                        dht_wire.find_result_to_wire([contact], [plain]),
                        dht_wire.find_result_to_wire([contact], None),
                    ],
                )
            ),
        ),
        "store_response": (_pack(dht_wire.response(5.0, results=[True, "newer held"])),),
        "changes_request": (
            _pack(dht_wire.request(False, addrs, key="key", since=None)),
            _pack(dht_wire.request(True, (), key="key", since=[b"\x01" * 8, 42])),
            _pack(
                dht_wire.request(
                    False, addrs, key="key", since=None, held=dht_wire.held_to_wire([plain])
                )
            ),
        ),
        "changes_response": (
            _pack(
                dht_wire.response(
                    5.0, **dht_wire.changes_to_wire([plain], dht_wire.Cursor(b"\x02" * 8, 7))
                )
            ),
            _pack(
                dht_wire.response(
                    5.0,
                    **dht_wire.changes_to_wire(
                        [plain], dht_wire.Cursor(b"\x02" * 8, 7), [True, False, True]
                    ),
                )
            ),
        ),
    }


# ---- all-reduce -------------------------------------------------------------------------------
def _ar_message(msg: Any) -> None:
    kind = ar_wire.kind_of(msg)
    if kind == "hello":
        ar_wire.parse_hello(msg)
    elif kind == "need":
        ar_wire.parse_need(msg, 8)
    else:
        data = ar_wire.parse_chunk(msg, 0, 64)
        CODECS["none"].decode(data, 16)
        if kind == "res":
            ar_wire.parse_contributors(msg, frozenset(range(4)))


def _ar_seeds() -> tuple[bytes, ...]:
    h = ar_wire.Hello(b"r" * 16, b"g" * 32, 1, 32.0, 1000, "none", False)
    data = np.arange(16, dtype=np.float32).tobytes()
    return (
        _pack(ar_wire.hello(h)),
        _pack(ar_wire.part(0, data)),
        _pack(ar_wire.result(0, data, [0, 2])),
        _pack(ar_wire.need((0, 3), (2, 8))),
    )


def _codec(name: str) -> Decoder:
    codec = CODECS[name]

    def run(data: bytes) -> None:
        if not data:
            raise CodecError("empty")
        codec.decode(data[1:], data[0])

    x = np.random.default_rng(0).normal(size=200).astype(np.float32)
    seeds = tuple(bytes([n]) + bytes(codec.encode(x[:n])) for n in (0, 1, 33, 200))
    return Decoder(f"codec.{name}", run, (CodecError,), seeds, message=False)


# ---- state sync, groups, progress -------------------------------------------------------------
_STATE_ARRAYS = [np.arange(100, dtype=np.float32), np.ones((3, 5), np.int32)]


def _state_seed() -> tuple[StateManifest, bytes]:
    return pack_state(_STATE_ARRAYS, 3, chunk_bytes=128)


def _manifest(msg: Any) -> None:
    StateAssembler(StateManifest.from_wire(msg))


_ASSEMBLER_MANIFEST = _state_seed()[0]


def _state_chunk(msg: Any) -> None:
    """A chunk answer as the downloader sees it: ``{"i": index, "d": bytes}``."""
    if not isinstance(msg, dict):
        raise StateError("a chunk answer is a map")
    assembler = StateAssembler(_ASSEMBLER_MANIFEST)
    assembler.add(msg.get("i"), msg.get("d"))
    if assembler.complete:
        assembler.arrays()


def _state_seeds() -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    manifest, buffer = _state_seed()
    chunks = tuple(
        _pack({"i": i, "d": buffer[i * 128 : (i + 1) * 128]}) for i in range(manifest.num_chunks)
    )
    return (_pack(manifest.to_wire()),), chunks


def _group(data: bytes) -> None:
    GroupSpec.from_bytes(data)


def _group_seeds() -> tuple[bytes, ...]:
    members = (
        Member(str(ALICE.peer_id), "node", 1e6, 1e7, 1.0),
        Member(str(BOB.peer_id), "client", 1e5, 1e6, 2.0),
    )
    spec = GroupSpec(members, b"g" * 16)
    return (spec.to_bytes(), spec.with_parts().to_bytes())


def _progress(msg: Any) -> None:
    PeerProgress.from_record(str(ALICE.peer_id), msg)


def _progress_seeds() -> tuple[bytes, ...]:
    p = PeerProgress(str(ALICE.peer_id), 3, 120, 12.5, 1000.0, "node", 2.0)
    serving = PeerProgress(
        str(ALICE.peer_id), 3, 120, 12.5, 1000.0, state=(3, b"d" * 32, (b"c" * 32,))
    )
    return (_pack(p.to_record()), _pack(serving.to_record()))


# ---- the sahajBERT example's records ----------------------------------------------------------
def _metrics_record(msg: Any) -> None:
    sahajbert_metrics.PeerMetrics.from_record(str(ALICE.peer_id), msg)


def _metrics_map(msg: Any) -> None:
    """The whole value of the metrics key as the coordinator reads it: bad slots are dropped,
    so nothing may escape ``parse_records``."""
    if isinstance(msg, dict):
        msg = {owner_marker(ALICE.peer_id) if k == "alice" else k: v for k, v in msg.items()}
    sahajbert_metrics.parse_records(msg)


def _checkpoint_announcement(msg: Any) -> None:
    sahajbert_metrics.parse_checkpoint(msg)


def _run_manifest(msg: Any) -> None:
    """A signed manifest envelope as a trainer fetches it (mutations rarely keep the
    signature: this covers the envelope's checks)."""
    sahajbert_manifest.verify(msg, run_id="fuzz-run")


def _manifest_body(msg: Any) -> None:
    """A manifest's fields as ``from_dict`` validates them once the signature verified."""
    sahajbert_manifest.RunManifest.from_dict(msg)


def _run_manifest_seeds() -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    from examples.sahajbert.config import TrainerConfig

    cfg = TrainerConfig().replace(model="tiny", run_id="fuzz-run")
    made = sahajbert_manifest.build(cfg, Path(__file__), 900, "none")
    envelope = sahajbert_manifest.sign(made, ALICE)
    return (_pack(envelope),), (_pack(made.to_dict()),)


def _metrics_seeds() -> tuple[bytes, ...]:
    history = (
        sahajbert_metrics.EpochFigures(2, 7.25, 48, 3.5),
        sahajbert_metrics.EpochFigures(3, 7.0, 40, 3.0),
    )
    rec = sahajbert_metrics.PeerMetrics(
        str(ALICE.peer_id), 4, 7.0, 12.5, 30, 240, "node", upload_bps=1e6, download_bps=2e6,
        sent_bps=3e5, received_bps=4e5, time=100.0, devices=1, history=history,
    )  # fmt: skip
    fresh = sahajbert_metrics.PeerMetrics(str(ALICE.peer_id), 0, math.nan, 0.0, 0, 0, "client")
    return (_pack(rec.to_record()), _pack(fresh.to_record()))


def _build() -> dict[str, Decoder]:
    dht_seeds = _dht_seeds()
    manifest_seeds, chunk_seeds = _state_seeds()
    envelope_seeds, body_seeds = _run_manifest_seeds()
    msg_doc = (ProtocolError,)
    decoders = [
        Decoder(
            "p2p.messages",
            _message_stream,
            (ProtocolError, ConnectionClosed, RPCError),
            (
                _framed({"a": [1, b"x" * 40]}) + _framed("hi"),
                _framed(None),
                _framed(b"\x07" * 40_000) + _framed(b"\x08" * 70_000),  # bin16, bin32 chunks
                _framed({"chunk": b"\x09" * 40_000, "i": 3}),
            ),
            message=False,
            arun=_message_stream_async,
        ),
        Decoder(
            "p2p.mux_frame",
            _mux_frame,
            (ProtocolError,),
            (
                mux.encode_frame(mux.DATA, 3, b"payload"),
                mux.encode_frame(mux.OPEN, 5),
                mux.encode_frame(mux.WINDOW, 3, struct.pack(">I", 65536)),
            ),
            message=False,
        ),
        Decoder(
            "p2p.handshake_hello",
            _hello,
            (HandshakeError,),
            (InitiatorHandshake(ALICE, OFFER_CHACHA).hello(),),
            message=False,
        ),
        Decoder(
            "p2p.handshake_reply",
            _reply,
            (HandshakeError,),
            (
                ResponderHandshake(BOB, OFFER_CHACHA).process_hello(
                    InitiatorHandshake(ALICE, OFFER_CHACHA).hello()
                ),
            ),
            message=False,
        ),
        Decoder("p2p.handshake_finish", _finish, (HandshakeError,), (b"\x00" * 80,), False),
        Decoder(
            "p2p.secure_frames",
            _secure_frames,
            (ConnectionClosed,),
            (_sealed_frames([b"hello", b"x" * 300]), _sealed_frames([b""])),
            message=False,
            arun=_secure_frames_async,
        ),
        Decoder(
            "dht.store_request",
            _msg(_store_request),
            msg_doc + (InvalidRecordError,),
            dht_seeds["store_request"],
        ),
        Decoder("dht.find_request", _msg(_find_request), msg_doc, dht_seeds["find_request"]),
        Decoder(
            "dht.find_response",
            _msg(_find_response),
            msg_doc + (InvalidRecordError,),
            dht_seeds["find_response"],
        ),
        Decoder("dht.store_response", _msg(_store_response), msg_doc, dht_seeds["store_response"]),
        Decoder(
            "dht.changes_request", _msg(_changes_request), msg_doc, dht_seeds["changes_request"]
        ),
        Decoder(
            "dht.changes_response",
            _msg(_changes_response),
            msg_doc + (InvalidRecordError,),
            dht_seeds["changes_response"],
        ),
        Decoder(
            "allreduce.message",
            _msg(_ar_message),
            msg_doc + (BadContributionError, CodecError),
            _ar_seeds(),
        ),
        *(_codec(name) for name in sorted(CODECS)),
        Decoder("state.manifest", _msg(_manifest), msg_doc + (StateError,), manifest_seeds),
        Decoder("state.chunk", _msg(_state_chunk), msg_doc + (StateError,), chunk_seeds),
        Decoder("group_spec", _group, (GroupError,), _group_seeds()),
        Decoder("progress_record", _msg(_progress), msg_doc + (ValueError,), _progress_seeds()),
        Decoder(
            "sahajbert.metrics_record",
            _msg(_metrics_record),
            msg_doc + (ValueError,),
            _metrics_seeds(),
        ),
        Decoder(
            "sahajbert.metrics_map",
            _msg(_metrics_map),
            msg_doc,
            tuple(_pack({"alice": messages.unpack(seed), "x": 1}) for seed in _metrics_seeds()),
        ),
        Decoder(
            "sahajbert.checkpoint",
            _msg(_checkpoint_announcement),
            msg_doc,
            (_pack({"epoch": 10, "path": "/run/checkpoints/epoch_10"}),),
        ),
        Decoder(
            "sahajbert.run_manifest",
            _msg(_run_manifest),
            msg_doc + (sahajbert_manifest.ManifestError,),
            envelope_seeds,
        ),
        Decoder(
            "sahajbert.manifest_body",
            _msg(_manifest_body),
            msg_doc + (ValueError, TypeError),
            body_seeds,
        ),
    ]
    return {d.name: d for d in decoders}


DECODERS: dict[str, Decoder] = _build()


# ---- the run ----------------------------------------------------------------------------------
class _Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang


def classify(decoder: Decoder, data: bytes) -> str:
    """'accepted', 'rejected' or 'crash:<Type>' for one input (hangs are the caller's job)."""
    try:
        decoder.run(data)
    except decoder.documented:
        return "rejected"
    except _Hang:
        raise
    except Exception as e:  # noqa: BLE001 - the point is to catch what should not happen
        return f"crash:{type(e).__name__}"
    return "accepted"


async def _classify_async(decoder: Decoder, data: bytes, hang_after: float) -> str:
    assert decoder.arun is not None
    with trio.move_on_after(hang_after):
        try:
            await decoder.arun(data)
        except decoder.documented:
            return "rejected"
        except Exception as e:  # noqa: BLE001 - the point is to catch what should not happen
            return f"crash:{type(e).__name__}"
        return "accepted"
    return "hang"


def _record(
    decoder: Decoder, outcome: str, data: bytes, counts: dict[str, int], examples: dict[str, str]
) -> None:
    if outcome == "hang":
        counts["hangs"] += 1
        examples.setdefault(f"{decoder.name} hang", data[:200].hex())
    elif outcome.startswith("crash"):
        counts["crashes"] += 1
        examples.setdefault(f"{decoder.name} {outcome}", data[:200].hex())
    else:
        counts[outcome] += 1


def fuzz_decoder(
    decoder: Decoder, inputs: int, seed: int, hang_after: float, examples: dict[str, str]
) -> dict[str, int]:
    gen = InputGenerator(decoder, seed)
    counts = {"inputs": 0, "rejected": 0, "accepted": 0, "crashes": 0, "hangs": 0}
    if decoder.arun is not None:

        async def loop() -> None:
            for _ in range(inputs):
                data = gen()
                counts["inputs"] += 1
                _record(decoder, await _classify_async(decoder, data, hang_after), data, counts,
                        examples)  # fmt: skip

        trio.run(loop)
        return counts
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for _ in range(inputs):
            data = gen()
            counts["inputs"] += 1
            signal.setitimer(signal.ITIMER_REAL, hang_after)
            try:
                outcome = classify(decoder, data)
            except _Hang:
                outcome = "hang"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            _record(decoder, outcome, data, counts, examples)
    finally:
        signal.signal(signal.SIGALRM, old)
    return counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=100_000, help="inputs per decoder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", action="append", help="fuzz only these decoders (repeatable)")
    ap.add_argument("--hang-after", type=float, default=2.0, help="seconds per input")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # every rejected frame logs a warning; counts say it all
    names = args.only or list(DECODERS)
    results: dict[str, dict[str, int]] = {}
    examples: dict[str, str] = {}
    for name in names:
        t0 = time.perf_counter()
        c = fuzz_decoder(DECODERS[name], args.inputs, args.seed, args.hang_after, examples)
        dt = time.perf_counter() - t0
        results[name] = c
        print(
            f"{name:24s} inputs {c['inputs']:7d}  rejected {c['rejected']:7d}  "
            f"accepted {c['accepted']:7d}  crashes {c['crashes']:4d}  hangs {c['hangs']:3d}  "
            f"({c['inputs'] / dt:,.0f}/s)",
            flush=True,
        )
    for what, hex_data in examples.items():
        digest = hashlib.sha256(bytes.fromhex(hex_data)).hexdigest()[:12]
        print(f"first {what} (first 200 bytes, sha256 {digest}): {hex_data}")
    summary = {
        "decoders": results,
        "crashes": sum(c["crashes"] for c in results.values()),
        "hangs": sum(c["hangs"] for c in results.values()),
        "inputs": sum(c["inputs"] for c in results.values()),
    }
    print(json.dumps(summary, sort_keys=True))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
