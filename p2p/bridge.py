"""The bridge between synchronous code (the JAX training loop) and the trio world.

Why one thread: trio code must run in a trio loop, and the training loop must not be async.
:class:`TrioThread` runs one trio loop in one background thread for the whole process, with
a nursery that owns every long-lived task started through it (a node, the DHT, averaging).
Synchronous code submits coroutines with :meth:`TrioThread.run` (blocking until they finish,
exceptions re-raised in the caller). :class:`SyncNode` wraps a :class:`~p2p.node.Node` this
way so any thread can call peers.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio

from p2p.identity import Identity, PeerID
from p2p.multiaddr import Multiaddr
from p2p.node import Node, NodeConfig, PeerLike, open_node
from p2p.rpc import CallContext
from p2p.transport import Transport

logger = logging.getLogger(__name__)

T = TypeVar("T")


class BridgeError(RuntimeError):
    """The bridge thread is not running (never started, stopped, or crashed)."""


class TrioThread:
    """A trio event loop in one background thread; a context manager (start/stop)."""

    def __init__(self, name: str = "p2p-trio") -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._token is not None

    def start(self) -> TrioThread:
        if self._thread is not None:
            raise BridgeError("a TrioThread can be started once")
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise BridgeError(f"trio thread failed to start: {self._error!r}") from self._error
        return self

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as e:  # noqa: BLE001 - reported to callers, not swallowed
            self._error = e
            logger.exception("trio bridge thread crashed")
        finally:
            self._token = None
            self._ready.set()

    async def _serve(self) -> None:
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def _check(self) -> trio.lowlevel.TrioToken:
        token = self._token
        if token is None or self._thread is None or not self._thread.is_alive():
            if self._error is not None:
                raise BridgeError(f"trio thread crashed: {self._error!r}") from self._error
            raise BridgeError("trio thread is not running")
        if threading.current_thread() is self._thread:
            raise BridgeError("TrioThread.run called from inside the trio thread (use await)")
        return token

    def run(self, async_fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run ``await async_fn(*args, **kwargs)`` in the loop; block until done, return it."""
        token = self._check()
        fn = functools.partial(async_fn, *args, **kwargs)
        try:
            return trio.from_thread.run(fn, trio_token=token)
        except trio.RunFinishedError as e:
            raise BridgeError("trio thread stopped") from e

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a synchronous ``fn(*args)`` in the loop thread (to touch loop-owned state)."""
        token = self._check()
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=token)
        except trio.RunFinishedError as e:
            raise BridgeError("trio thread stopped") from e

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue a synchronous ``fn(*args)`` to run in the loop thread; returns at once.

        For hot paths (a training step reporting progress) that must not wait for the loop.
        Callbacks run in the order posted, before any later :meth:`run`. Errors are logged.
        """
        token = self._check()

        def call() -> None:
            try:
                fn(*args)
            except Exception:  # a posted callback has no caller to raise to
                logger.exception("callback posted to the trio thread failed")

        try:
            token.run_sync_soon(call)
        except trio.RunFinishedError as e:
            raise BridgeError("trio thread stopped") from e

    def start_service(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Start a long-lived task in the loop's nursery via ``nursery.start``.

        ``async_fn`` must accept ``task_status`` and call ``task_status.started(value)``;
        returns that value. The task runs until it returns or the thread stops; if it raises,
        the whole loop stops and later calls raise :class:`BridgeError`.
        """

        async def _start() -> Any:
            assert self._nursery is not None
            return await self._nursery.start(async_fn, *args)

        return self.run(_start)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel every service and end the loop; waits up to ``timeout`` seconds."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("trio thread did not stop within %s s", timeout)

    def __enter__(self) -> TrioThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SyncNode:
    """A thread-safe, blocking facade over a :class:`Node` running in a :class:`TrioThread`.

    Pass ``thread`` to share one bridge thread with other services; otherwise the node
    starts (and on :meth:`close` stops) its own.
    """

    def __init__(
        self,
        identity: Identity | None = None,
        *,
        listen: Sequence[str | Multiaddr] = ("/ip4/127.0.0.1/tcp/0",),
        transport: Transport | None = None,
        config: NodeConfig = NodeConfig(),
        thread: TrioThread | None = None,
    ) -> None:
        self._own_thread = thread is None
        self.thread = thread if thread is not None else TrioThread().start()
        self._stop: trio.Event | None = None
        self._done: trio.Event | None = None
        self._closed = False
        try:
            self.node: Node = self.thread.start_service(
                functools.partial(self._serve, identity, listen, transport, config)
            )
        except BaseException:
            if self._own_thread:
                self.thread.stop()
            raise

    async def _serve(
        self,
        identity: Identity | None,
        listen: Sequence[str | Multiaddr],
        transport: Transport | None,
        config: NodeConfig,
        *,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        self._stop = trio.Event()
        self._done = trio.Event()
        try:
            async with open_node(
                identity, listen=listen, transport=transport, config=config
            ) as node:
                task_status.started(node)
                await self._stop.wait()
        finally:
            self._done.set()

    @property
    def peer_id(self) -> PeerID:
        return self.node.peer_id

    @property
    def addrs(self) -> list[Multiaddr]:
        return list(self.node.addrs)

    def call(self, peer: PeerLike, name: str, request: Any, *, timeout: float | None = None) -> Any:
        """Blocking :meth:`Node.call`; same errors."""
        return self.thread.run(self.node.call, peer, name, request, timeout=timeout)

    def connect(self, peer: PeerLike) -> PeerID:
        return self.thread.run(self.node.connect, peer)

    def connected_peers(self) -> list[PeerID]:
        return self.thread.run_sync(self.node.connected_peers)

    def add_handler(self, name: str, handler: Callable[[CallContext, Any], Awaitable[Any]]) -> None:
        """Register an async handler (it runs in the trio thread)."""
        self.thread.run_sync(self.node.add_handler, name, handler)

    def run(self, async_fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run any coroutine function in the node's loop (e.g. one using ``self.node``)."""
        return self.thread.run(async_fn, *args, **kwargs)

    def close(self) -> None:
        """Close the node (and the thread if this facade started it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        stop, done = self._stop, self._done
        if stop is not None and done is not None and self.thread.running:

            async def _close() -> None:
                stop.set()
                await done.wait()  # open_node has exited: every connection is closed

            try:
                self.thread.run(_close)
            except BridgeError:
                pass
        if self._own_thread:
            self.thread.stop()

    def __enter__(self) -> SyncNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
