"""The stream multiplexer against a peer that breaks the protocol on purpose: violations
close the connection, late frames for finished streams do not (in-memory, virtual time)."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from p2p.mux import BULK, DATA, EOF, OPEN, RESET, WINDOW, MuxConfig, MuxStream, encode_frame
from tests.p2p.muxhelpers import raw_vs_mux, run_virtual


def test_sending_beyond_the_window_closes_the_connection(caplog: pytest.LogCaptureFixture) -> None:
    config = MuxConfig(initial_window=32 << 10, max_frame_payload=16 << 10)

    async def silent(stream: MuxStream) -> None:
        await trio.sleep_forever()

    async def main() -> None:
        async with raw_vs_mux(silent, config) as (peer, mux):
            await peer.send(OPEN, 1)
            for _ in range(3):  # 48 KiB into a 32 KiB window
                await peer.send(DATA, 1, bytes(16 << 10))
            with trio.fail_after(5):
                await mux.closed.wait()
            assert "granted" in (mux.close_reason or "")

    with caplog.at_level(logging.WARNING, logger="p2p.mux"):
        run_virtual(main)
    assert any("protocol violation" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "frames, reason",
    [
        ([(DATA, 1, b"x")], "unopened"),
        ([(OPEN, 2, b"")], "parity"),
        ([(OPEN, 3, b""), (OPEN, 1, b"")], "reused"),
        ([(OPEN, 1, b""), (EOF, 1, b""), (DATA, 1, b"x")], "after EOF"),
        ([(OPEN, 1, b""), (WINDOW, 1, (2**31).to_bytes(4, "big"))], "overflow"),
        ([(OPEN, 1, b""), (BULK, 1, (0).to_bytes(4, "big"))], "BULK of 0"),
        (
            [(OPEN, 1, b""), (BULK, 1, (MuxConfig().initial_window + 1).to_bytes(4, "big"))],
            "granted",
        ),
        ([(OPEN, 1, b""), (EOF, 1, b""), (BULK, 1, (1).to_bytes(4, "big"))], "BULK after EOF"),
        # the frame after a BULK must be exactly as long as announced (here a 6-byte frame)
        ([(OPEN, 1, b""), (BULK, 1, (10).to_bytes(4, "big")), (DATA, 1, b"x")], "announced 10"),
    ],
)
def test_protocol_violations_close_the_connection(frames: list, reason: str) -> None:
    async def silent(stream: MuxStream) -> None:
        # never answers: with echo, its EOF could finish stream 1 before the offending frame
        # arrives, which then is a harmless late frame (a race trio's scheduler may decide)
        await trio.sleep_forever()

    async def main() -> None:
        async with raw_vs_mux(silent) as (peer, mux):
            for kind, sid, payload in frames:
                await peer.send(kind, sid, payload)
            with trio.fail_after(5):
                await mux.closed.wait()
            assert reason in (mux.close_reason or "")

    run_virtual(main)


def test_frames_for_finished_streams_are_ignored() -> None:
    async def main() -> None:
        async def resetter(stream: MuxStream) -> None:
            stream.reset("no thanks")

        async with raw_vs_mux(resetter) as (peer, mux):
            await peer.send(OPEN, 1)
            await trio.testing.wait_all_tasks_blocked()
            # the peer had these in flight when our reset crossed them
            await peer.send(DATA, 1, b"late")
            await peer.send(EOF, 1)
            await peer.send(RESET, 1, b"late reset")
            # a late BULK: its raw frame is dropped unread (parsed as a frame it would be fatal)
            raw = encode_frame(DATA, 77, b"unopened")
            await peer.send(BULK, 1, len(raw).to_bytes(4, "big"))
            await peer.channel.send_frame(raw)
            await trio.testing.wait_all_tasks_blocked()
            assert not mux.is_closed

    run_virtual(main)
