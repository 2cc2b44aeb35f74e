"""The trio bridge thread and the synchronous node facade, driven from plain threads."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import trio

from p2p import CallContext, RPCError, SyncNode, TrioThread
from p2p.bridge import BridgeError


async def echo(ctx: CallContext, request: Any) -> Any:
    return request


def test_trio_thread_runs_coroutines_and_services() -> None:
    with TrioThread() as thread:
        assert thread.run(trio.sleep, 0) is None

        async def add(a: int, b: int, *, c: int = 0) -> int:
            await trio.sleep(0)
            return a + b + c

        assert thread.run(add, 1, 2, c=3) == 6

        async def boom() -> None:
            raise ValueError("from the loop")

        with pytest.raises(ValueError, match="from the loop"):
            thread.run(boom)

        stopped = threading.Event()

        async def service(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            task_status.started("ready")
            try:
                await trio.sleep_forever()
            finally:
                stopped.set()

        assert thread.start_service(service) == "ready"
        assert thread.run_sync(lambda: 41 + 1) == 42
    # leaving the block cancelled the service and ended the loop
    assert stopped.is_set()
    assert not thread.running
    with pytest.raises(BridgeError):
        thread.run(trio.sleep, 0)


def test_sync_nodes_call_each_other_from_many_threads() -> None:
    with TrioThread() as thread:
        a = SyncNode(thread=thread)
        b = SyncNode(thread=thread)
        try:
            a.add_handler("echo", echo)
            results: list[int] = []
            errors: list[BaseException] = []

            def worker(i: int) -> None:
                try:
                    results.append(b.call(a.addrs[0], "echo", i, timeout=10))
                except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                    errors.append(e)

            threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []
            assert sorted(results) == list(range(16))
            assert b.connected_peers() == [a.peer_id]
            with pytest.raises(RPCError, match="unknown protocol"):
                b.call(a.peer_id, "missing", None)
        finally:
            a.close()
            b.close()


def test_sync_node_with_its_own_thread_closes_cleanly() -> None:
    with SyncNode() as a, SyncNode() as b:
        a.add_handler("echo", echo)
        assert b.connect(a.addrs[0]) == a.peer_id
        assert b.call(a.peer_id, "echo", {"k": b"v"}) == {"k": b"v"}
        own = a.thread
    assert not own.running
    a.close()  # idempotent


def test_post_runs_callbacks_in_order_without_waiting() -> None:
    from p2p.bridge import TrioThread

    seen: list[int] = []
    with TrioThread() as thread:
        for i in range(100):
            thread.post(seen.append, i)
        # A later blocking call runs after every callback posted before it.
        assert thread.run_sync(lambda: list(seen)) == list(range(100))


def test_post_runs_callbacks_in_the_loop_thread_in_order(caplog: pytest.LogCaptureFixture) -> None:
    with TrioThread() as thread:
        seen: list[tuple[int, bool]] = []
        loop_thread: list[threading.Thread] = []

        def record(i: int) -> None:
            seen.append((i, threading.current_thread() is loop_thread[0]))

        def fail() -> None:
            raise RuntimeError("posted callback failed")

        loop_thread.append(thread.run_sync(threading.current_thread))
        for i in range(5):
            thread.post(record, i)
        thread.post(fail)
        thread.post(record, 5)
        thread.run(trio.sleep, 0)  # everything posted before this has run
        assert seen == [(i, True) for i in range(6)]
    assert "posted callback failed" in caplog.text
    with pytest.raises(BridgeError):
        thread.post(record, 6)
