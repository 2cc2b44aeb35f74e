"""The walk of one averaging round, counted: ``python -m bench.round_walk [--epoch 1] [--list]``.

Two peers train the README's linear model toward a small target: this process (traced) and a
partner process (``tests.readme_peer``). At the round of ``--epoch`` the script follows this
peer from ``collaborative``'s update at the target down to the socket and back, and counts what
issue #47 counts:

- a **stop** is a function of the project's packages (``dedloc_jax``, ``p2p``) entered on the
  walk, each counted once, in the order first entered;
- the walk is what runs for the update: on the training thread, the update's call stack when it
  reaches ``HostCalls.average`` and every function it enters until the update returns; on the
  trio thread, every function run by the task that serves ``CollaborationPeer.average`` and the
  tasks it starts (its nurseries: matchmaking, the all-reduce's streams). Other tasks (progress
  reports, the DHT's maintenance, connection readers, streams other peers opened to us) are not
  the walk: they run whether or not we average;
- **files** are the distinct files of the stops; a **return** is a stop in another file than the
  stop before it, in a file an earlier stop visited.

The last line is a JSON object with the counts; ``--list`` prints the stops first.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = tuple(str(ROOT / p) + os.sep for p in ("dedloc_jax", "p2p"))
# Where the walk meets the socket (trio's socket streams) or hands over to the trio thread.
SOCKET_FILES = (
    os.path.join("trio", "_highlevel_socket.py"),
    os.path.join("trio", "_socket.py"),
    os.path.join("trio", "_threads.py"),
)
SOCKET_CALLS = {os.write, os.read, os.readv, socket.socket.send, socket.socket.recv_into}
RUNNER = os.path.join("trio", "_core", "_run.py")
MICRO = 4
TARGET = 64


def _project(frame: FrameType) -> str | None:
    """The frame's file relative to the root when it belongs to the project's packages."""
    path = frame.f_code.co_filename
    return os.path.relpath(path, ROOT) if path.startswith(PACKAGES) else None


def _suspended(coro: Any) -> list[FrameType]:
    """The frames of a suspended coroutine, down the chain of what it awaits."""
    frames = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames


class Walk:
    """Profiles the training thread and the trio thread; records the round's stops."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.stops: dict[tuple[str, str, int], int] = {}  # stop -> order first entered
        self.training: threading.Thread = threading.current_thread()
        self.update: FrameType | None = None  # the update's frame while the walk is on
        self.root_task: Any = None  # the trio task serving CollaborationPeer.average
        self.tasks: dict[Any, bool] = {}  # task -> on the walk (held: ids are reused)
        self.done = False
        self.entered: dict[tuple[str, str, int], int] = {}  # every function: order entered
        self.every = False  # count every function entered, not only those on a way down
        self.caller: dict[tuple[str, str, int], tuple[str, str, int]] = {}  # stop -> its caller

    def _enter(self, frame: FrameType) -> None:
        """A function of the walk entered: a stop if it leads down to the socket."""
        where = _project(frame)
        if where is not None:
            key = (where, frame.f_code.co_qualname, frame.f_code.co_firstlineno)
            self.entered.setdefault(key, len(self.entered))
            if self.every:
                self.stops.setdefault(key, self.entered[key])
        elif frame.f_code.co_filename.endswith(SOCKET_FILES):
            self._down(frame)

    def _down(self, frame: FrameType) -> None:
        """At the socket (or the hop to the trio thread): every project function on the way
        down is a stop: the running task's frames and, up to the walk's root task, those of
        the tasks that started it (waiting in their nurseries)."""
        frames: list[FrameType] = []
        f: FrameType | None = frame
        while f is not None and not f.f_code.co_filename.endswith(RUNNER):  # the task's root
            frames.append(f)
            f = f.f_back
        if threading.current_thread() is not self.training:
            import trio

            task = trio.lowlevel.current_task()
            while task is not self.root_task and task.parent_nursery is not None:
                task = task.parent_nursery.parent_task
                frames.extend(reversed(_suspended(task.coro)))  # innermost first
        child = None
        for f in frames:  # innermost first
            where = _project(f)
            if where is not None:
                key = (where, f.f_code.co_qualname, f.f_code.co_firstlineno)
                self.stops.setdefault(key, self.entered.setdefault(key, len(self.entered)))
                if child is not None:
                    self.caller.setdefault(child, key)
                child = key

    def _on_walk(self, task: Any) -> bool:
        """Whether ``task`` is the root task or was started (transitively) in its nurseries."""
        known = self.tasks.get(task)
        if known is not None:
            return known
        chain, t, found = [], task, False
        while t is not None:
            if t is self.root_task:
                found = True
                break
            chain.append(t)
            nursery = t.parent_nursery
            t = nursery.parent_task if nursery is not None else None
        for c in chain:
            self.tasks[c] = found
        return found

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.done:
            return
        if event == "return":
            if frame is self.update:
                self.update, self.done = None, True
            return
        if event == "c_call":
            if self.update is not None and arg in SOCKET_CALLS and self._walking():
                self._down(frame)
            return
        if event != "call":
            return
        if threading.current_thread() is self.training:
            self._training(frame)
        else:
            self._trio(frame)

    def _walking(self) -> bool:
        """Whether the code running now is the walk's (its thread, or one of its tasks)."""
        if threading.current_thread() is self.training:
            return True
        import trio

        try:
            return self.root_task is not None and self._on_walk(trio.lowlevel.current_task())
        except RuntimeError:
            return False

    def _training(self, frame: FrameType) -> None:
        code = frame.f_code
        if self.update is None:
            if code.co_qualname != "HostCalls.average" or _project(frame) is None:
                return
            if int(frame.f_locals["epoch"]) != self.epoch:
                return
            stack, f = [], frame
            while f is not None:
                if _project(f) is not None:
                    stack.append(f)
                f = f.f_back
            for f in reversed(stack):
                self._enter(f)
            # the outermost project frame: collaborative's update (the walk ends on its return)
            self.update = stack[-1]
            return
        self._enter(frame)

    def _trio(self, frame: FrameType) -> None:
        if self.update is None:
            return
        import trio

        try:
            task = trio.lowlevel.current_task()
        except RuntimeError:
            return
        if self.root_task is None:
            if frame.f_code.co_qualname != "CollaborationPeer.average":
                return
            self.root_task = task
            self.tasks[task] = True
        if self._on_walk(task):
            self._enter(frame)

    def order(self) -> list[tuple[str, str, int]]:
        """The stops as a reader follows them: depth first from the update, each function's
        callees in the order first entered (concurrent tasks one after the other)."""
        first = self.stops.__getitem__
        callees: dict[Any, list[tuple[str, str, int]]] = {}
        for stop in sorted(self.stops, key=first):
            caller = self.caller.get(stop)
            callees.setdefault(caller if caller in self.stops else None, []).append(stop)
        order: list[tuple[str, str, int]] = []
        todo = list(reversed(callees.get(None, [])))
        while todo:
            stop = todo.pop()
            order.append(stop)
            todo.extend(reversed(callees.get(stop, [])))
        return order

    def counts(self, deep: bool = False) -> dict[str, Any]:
        order = self.order() if not self.every else sorted(self.stops, key=self.stops.__getitem__)
        if not deep:  # p2p is the socket: the p2p functions the collaboration calls, not below
            order = [
                stop
                for stop in order
                if not stop[0].startswith("p2p")
                or not self.caller.get(stop, ("p2p",))[0].startswith("p2p")
            ]
        files: list[str] = []
        returns: dict[str, int] = {}
        last = None
        for where, _, _ in order:
            if where != last and where in files:
                returns[where] = returns.get(where, 0) + 1
            if where not in files:
                files.append(where)
            last = where
        return {
            "stops": len(order),
            "files": len(files),
            "returns": sum(returns.values()),
            "returns_by_file": dict(sorted(returns.items(), key=lambda kv: -kv[1])),
            "file_order": files,
            "walk": [f"{w}:{q}" for w, q, _ in order],
        }


def _partner(out: Path, addrs: list[str], epochs: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "bench.round_walk", "--partner", json.dumps(addrs)]
    cmd += ["--out", str(out), "--epochs", str(epochs)]
    log = (out / "log.txt").open("w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def train(
    collab: Any, epochs: int, seed: int, traced: Walk | None = None, ready: Path | None = None
) -> None:
    """Train the linear model eagerly (both peers the same way: the same bits after every
    step) until the collaboration reaches ``epochs``; ``traced``: profile each update;
    ``ready``: a file created once the first micro-step is done."""
    import jax
    import jax.numpy as jnp
    import optax

    import dedloc_jax

    true_w = np.arange(1, 6, dtype=np.float32)
    rng = np.random.default_rng(seed)

    def loss_fn(params: dict, batch: dict) -> Any:
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        dedloc_jax.collaborative(optax.lamb(1e-3), collab, target_batch_size=TARGET),
    )
    params = {"w": jnp.zeros(true_w.size, jnp.float32)}
    opt_state = tx.init(params)
    grad = jax.grad(loss_fn)
    deadline = time.monotonic() + 300
    while dedloc_jax.collaboration_epoch(opt_state) < epochs:
        if time.monotonic() > deadline:
            raise TimeoutError("the two peers did not reach the epochs in time")
        x = rng.normal(size=(MICRO, true_w.size)).astype(np.float32)
        batch = {"x": x, "y": x @ true_w}
        time.sleep(0.02)
        g = grad(params, batch)
        # eager: the host calls run on this thread (under jit they may run on XLA's)
        sys.setprofile(traced.profile if traced is not None else None)
        try:
            updates, opt_state = tx.update(g, opt_state, params, batch_size=MICRO)
        finally:
            sys.setprofile(None)
        params = optax.apply_updates(params, updates)
        params, opt_state = dedloc_jax.keep_in_step(collab, params, opt_state)
        if ready is not None:
            ready.touch()


def partner(addrs: list[str], out: Path, epochs: int) -> None:
    import dedloc_jax

    with dedloc_jax.Collaboration("my-run", initial_peers=addrs) as collab:
        train(collab, epochs, seed=1, ready=out / "ready")


def run(epoch: int, out: Path, every: bool = False, deep: bool = False) -> dict[str, Any]:
    import dedloc_jax

    epochs = epoch + 2
    walk = Walk(epoch)
    walk.every = every

    async def profile_trio(on: bool) -> None:
        sys.setprofile(walk.profile if on else None)

    with dedloc_jax.Collaboration("my-run") as collab:
        thread, _ = collab._core()
        thread.run(profile_trio, True)  # the trio thread is already running: set it there
        (out / "partner").mkdir()
        other = _partner(out / "partner", [str(a) for a in collab.addrs], epochs)
        try:
            deadline = time.monotonic() + 300
            while not (out / "partner" / "ready").exists():  # imported, started, stepped once
                if time.monotonic() > deadline or other.poll() is not None:
                    raise RuntimeError("the partner did not start training")
                time.sleep(0.1)
            train(collab, epochs, seed=0, traced=walk)
            group = collab.history[epoch].group_size
            thread.run(profile_trio, False)
        finally:
            other.wait(timeout=120)
        if group == 1:
            log = (out / "partner" / "log.txt").read_text().splitlines()
            print("\n".join(log[-30:]), file=sys.stderr)
    if not walk.done:
        raise RuntimeError(f"no round at epoch {epoch} was walked")
    return dict(walk.counts(deep), epoch=epoch, group_size=group)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epoch", type=int, default=2, help="the round to walk (0: the first)")
    p.add_argument(
        "--every",
        action="store_true",
        help="every function entered is a stop, not only those on a way down to the socket",
    )
    p.add_argument(
        "--deep",
        action="store_true",
        help="follow the walk inside p2p too (by default the p2p functions the collaboration "
        "calls are stops, the network stack below them is the socket)",
    )
    p.add_argument("--list", action="store_true", help="print the stops, in order, first")
    p.add_argument("--partner", help=argparse.SUPPRESS)  # the other peer: its first addresses
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--epochs", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.partner:
        partner(json.loads(args.partner), Path(args.out), args.epochs)
        return
    with tempfile.TemporaryDirectory(prefix="round-walk-") as tmp:
        figures = run(args.epoch, Path(tmp), args.every, args.deep)
    if args.list:
        for i, stop in enumerate(figures["walk"], 1):
            print(f"{i:3d} {stop}")
    print(
        f"round at epoch {figures['epoch']} (group of {figures['group_size']}): "
        f"{figures['stops']} stops, {figures['files']} files, {figures['returns']} returns "
        f"to a visited file {figures['returns_by_file']}"
    )
    print(json.dumps({k: v for k, v in figures.items() if k != "walk"}))


if __name__ == "__main__":
    main()
