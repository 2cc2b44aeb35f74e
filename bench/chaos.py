"""Chaos: trainer processes on loopback, killed with SIGKILL and restarted at random moments.

Run ``python -m bench.chaos [--peers 4] [--kills 30] [--seed 0] [--max-seconds 900]``. Peer 0
(the stable peer a run's coordinator would be) is never killed; the driver kills the others
with SIGKILL, each kill aimed at one phase in turn: while the victim accumulates gradients,
while it averages (matchmaking or all-reduce) and while it downloads the run's state after a
restart. Every victim is started again after a short random pause, with the same identity, and
loads the state again. At least two peers are alive at any time.

Each trainer (:mod:`bench.chaos_peer`) appends its events to ``peerN.jsonl``; each kill is
classified afterwards by the victim's own last phase before the kill. Figures:

- ``epochs``: collaboration epochs completed (by the stable peer);
- ``kills``: kills done (the driver stops at ``--kills``), ``kills_by_phase``;
- ``divergences``: epochs at which peers in step held different parameters: those that ended
  the epoch in an averaging group (group size > 1) and those that loaded the state of that
  epoch must all hold the same parameter digest;
- ``hangs``: incarnations that showed no sign of life for longer than the configured bounds
  allow (matchmaking's longest wait + averaging timeout, or the state download timeout, plus
  slack), or did not start within ``--startup-timeout``;
- ``nans``: epoch records with a non-finite loss or parameter.

The last line is one JSON object with these and more figures.

``--peer sahajbert`` kills the real volunteer program instead of the MLP peer: a tiny-config
run is prepared (``prepare``) and its coordinator started (the bootstrap, never killed); the
trainers are ``python -m examples.sahajbert trainer`` processes, each with its own work
directory and identity, writing their events with ``--events``. On top of the per-epoch
check, ``final_match`` compares the parameters every trainer held at the last epoch they all
reached in step (bit-identical digests).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("bench.chaos")

KINDS = ("accumulating", "averaging", "loading")
ROOT = Path(__file__).resolve().parents[1]


class _Process:
    """A ``subprocess.Popen`` with the bits of ``multiprocessing.Process`` the driver uses."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Incarnation:
    """One process of one peer."""

    index: int
    process: Any  # multiprocessing.Process (forked from the fork server)
    spawned: float
    killed_at: float | None = None
    last_event: float | None = None
    phase: str | None = None
    started: bool = False
    hung: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.is_alive()


@dataclass
class Tail:
    """Reads what a peer appended to its event file since the last call."""

    path: Path
    index: int
    offset: int = 0
    rows: list[dict] = field(default_factory=list)

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line being written stays for the next call
        self.offset += end
        new = []
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by SIGKILL mid-write
                continue
            row.setdefault("peer", self.index)  # the real trainer does not know its index
            new.append(row)
        self.rows.extend(new)
        return new


def hang_bound(matchmaking_time: float, averaging_timeout: float, load_timeout: float) -> float:
    """The longest a live peer may stay silent: matchmaking's bounds (see
    ``dedloc_jax.rounds.matchmaking``: registration up to ``max_wait``, then a join call of
    ``max_wait + 6 window + 10``) plus the averaging timeout, or one state download; + slack."""
    window = matchmaking_time
    max_wait = 10 * window + 5.0
    averaging = max_wait + (max_wait + 6 * window + 10.0) + averaging_timeout
    return max(averaging, load_timeout) + 10.0


class Chaos:
    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args = args
        self.out = out
        self.rng = np.random.default_rng(args.seed)
        self.procs: dict[int, Incarnation] = {}
        self.history: list[Incarnation] = []
        self.tails = {i: Tail(out / f"peer{i}.jsonl", i) for i in range(args.peers)}
        self.restart_at: dict[int, float] = {}
        self.kills: list[dict] = []
        self.hangs: list[dict] = []
        self.crashes: list[dict] = []
        self.restarts = 0
        self.stopping = False
        self.misses = 0
        self.sahajbert = args.peer == "sahajbert"
        # a restarted real trainer loads the state about a minute after its start (imports,
        # manifest, model, joining): aims wait that long for a peer in the phase
        self.aim_wait = 120.0 if self.sahajbert else 30.0
        self.coordinator: subprocess.Popen | None = None
        self.ctx = mp.get_context("forkserver")
        if not self.sahajbert:
            self.ctx.set_forkserver_preload(["bench.chaos_peer"])
        self.bound = hang_bound(args.matchmaking_time, args.averaging_timeout, args.load_timeout)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.max_seconds
        self.kills_done_at = self.t0
        self.epoch_at_last_kill = 0

    # --- processes -----------------------------------------------------------------------
    def spawn(self, index: int) -> None:
        if self.sahajbert:
            self._spawn_trainer(index)
            return
        argv = [
            "--index",
            str(index),
            "--dir",
            str(self.out),
            "--target",
            str(self.args.target),
            "--step-delay",
            str(self.args.step_delay),
            "--matchmaking-time",
            str(self.args.matchmaking_time),
            "--averaging-timeout",
            str(self.args.averaging_timeout),
            "--load-timeout",
            str(self.args.load_timeout),
        ]
        process = self.ctx.Process(
            target=_peer_main, args=(argv, str(self.out / f"peer{index}.log")), daemon=True
        )
        process.start()
        inc = Incarnation(index, process, time.time())
        self.procs[index] = inc
        self.history.append(inc)

    def _spawn_trainer(self, index: int) -> None:
        """``python -m examples.sahajbert trainer`` in its own work directory (the run's
        settings come from the manifest; a restart keeps the directory and identity)."""
        work = self.out / f"trainer{index}"
        work.mkdir(parents=True, exist_ok=True)
        cache = work / "jax-cache"
        if not cache.exists():  # compiled programs shared, as by one machine's processes
            cache.symlink_to(_shared_cache(), target_is_directory=True)
        cmd = [sys.executable, "-m", "examples.sahajbert", "trainer",
               "--run-id", "chaos-sahajbert", "--initial-peers", self.addr,
               "--work-dir", str(work), "--identity", str(self.out / f"trainer{index}.key"),
               "--per-device-batch-size", str(self.args.micro_batch),
               "--step-delay", str(self.args.step_delay),
               "--events", str(self.out / f"peer{index}.jsonl")]  # fmt: skip
        with (self.out / f"peer{index}.log").open("a") as log_file:
            popen = subprocess.Popen(
                cmd, cwd=ROOT, env=_env(), stdout=log_file, stderr=subprocess.STDOUT
            )
        inc = Incarnation(index, _Process(popen), time.time())
        self.procs[index] = inc
        self.history.append(inc)

    def _start_coordinator(self) -> None:
        """Prepare a tiny run on a generated text file (once: kept next to the compilation
        cache, so that later runs train the same shapes and find their programs compiled) and
        start its coordinator."""
        from models.text.corpus import write_corpus

        prepared = prepared_dir(self.args.target)
        text = prepared / "text.txt"
        run = ["--run-id", "chaos-sahajbert"]
        if not (prepared / "run" / "manifest.json").is_file():
            prepared.mkdir(parents=True, exist_ok=True)
            write_corpus(text, 300, seed=0)
            prepare = [sys.executable, "-m", "examples.sahajbert", "prepare", *run,
                       "--config", "tiny", "--seq-length", "32", "--target-batch-size",
                       str(self.args.target), "--learning-rate", "0.01", "--warmup-steps", "1",
                       "--data", str(text), "--out", str(prepared / "run"),
                       "--work-dir", str(self.out / "organiser")]  # fmt: skip
            done = subprocess.run(prepare, cwd=ROOT, env=_env(), capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"prepare failed: {done.stderr[-2000:]}")
        addr_file = self.out / "addrs.json"
        coordinator = [sys.executable, "-m", "examples.sahajbert", "coordinator", *run,
                       "--manifest", str(prepared / "run"), "--out", str(self.out / "run-out"),
                       "--work-dir", str(self.out / "organiser"), "--addr-file", str(addr_file),
                       "--checkpoint-every", "1000000"]  # fmt: skip
        with (self.out / "coordinator.log").open("a") as log_file:
            self.coordinator = subprocess.Popen(
                coordinator, cwd=ROOT, env=_env(), stdout=log_file, stderr=subprocess.STDOUT
            )
        while not addr_file.exists():
            if time.monotonic() > self.deadline or self.coordinator.poll() is not None:
                raise RuntimeError("the coordinator did not start; see coordinator.log")
            time.sleep(0.2)
        self.addr = json.loads(addr_file.read_text())[0]

    def poll(self) -> None:
        """Read events, notice crashes and hangs, restart peers that are due."""
        now = time.time()
        for i, tail in self.tails.items():
            for row in tail.read():
                inc = self.procs.get(i)
                if inc is None or row.get("pid") != inc.pid:
                    continue
                inc.last_event = row["t"]
                inc.started = True
                if row["ev"] == "phase":
                    inc.phase = row["phase"]
        if self.stopping:
            return
        for i, inc in list(self.procs.items()):
            if inc.killed_at is not None:
                continue
            if not inc.alive:
                self.crashes.append({"peer": i, "pid": inc.pid, "rc": inc.process.exitcode})
                log.warning("peer %d (pid %d) exited with %s", i, inc.pid, inc.process.exitcode)
                inc.killed_at = now
                self.restart_at[i] = time.monotonic() + 0.5
                continue
            silent = now - (inc.last_event or inc.spawned)
            # a trainer compiling its step at the start is bounded like its start
            starting = not inc.started or inc.phase == "compiling"
            limit = self.args.startup_timeout if starting else self.bound
            if silent > limit and not inc.hung:
                inc.hung = True
                self.hangs.append(
                    {
                        "peer": i,
                        "pid": inc.pid,
                        "phase": inc.phase,
                        "silent_s": round(silent, 1),
                        "started": inc.started,
                    }
                )
                log.warning("peer %d hangs in %s (silent %.0f s): killing it", i, inc.phase, silent)
                self._kill(inc)
                self.restart_at[i] = time.monotonic() + 0.5
        for i, due in list(self.restart_at.items()):
            if time.monotonic() >= due:
                del self.restart_at[i]
                self.spawn(i)
                self.restarts += 1

    def _kill(self, inc: Incarnation) -> None:
        inc.killed_at = time.time()
        os.kill(inc.pid, signal.SIGKILL)
        inc.process.join()

    def alive_count(self) -> int:
        """Peers that are up: started (not merely forked) and not killed."""
        return sum(
            1 for inc in self.procs.values() if inc.killed_at is None and inc.started and inc.alive
        )

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.poll()
            time.sleep(0.005)

    # --- the run -------------------------------------------------------------------------
    def epoch_of(self, index: int) -> int:
        epochs = [r["epoch"] for r in self.tails[index].rows if r["ev"] == "epoch"]
        return max(epochs, default=0)

    def start(self) -> None:
        if self.sahajbert:
            self._start_coordinator()
            # The others once peer 0 trains: they find its compiled programs in the cache.
            self.spawn(0)
            while self.procs[0].phase not in ("accumulating", "averaging"):
                if time.monotonic() > self.deadline or not self.procs[0].alive:
                    raise RuntimeError("trainer 0 did not start; see peer0.log")
                self.sleep(0.5)
            for i in range(1, self.args.peers):
                self.spawn(i)
        else:
            self.spawn(0)
            while not (self.out / "addrs.json").exists():
                if time.monotonic() > self.deadline or not self.procs[0].alive:
                    raise RuntimeError("peer 0 did not start; see peer0.log")
                time.sleep(0.1)
            for i in range(1, self.args.peers):
                self.spawn(i)
        while self.epoch_of(0) < self.args.warmup_epochs:
            if time.monotonic() > self.deadline:
                raise RuntimeError("the collaboration did not reach its first epochs")
            self.sleep(0.2)

    def candidates(self, phase: str) -> list[Incarnation]:
        if self.alive_count() <= 2:
            return []
        return [
            inc
            for i, inc in self.procs.items()
            if i != 0 and inc.killed_at is None and inc.alive and inc.phase == phase
        ]

    def kill_in(self, phase: str, wait: float) -> bool:
        """Kill a random peer while it is in ``phase`` (waiting up to ``wait`` s for one)."""
        give_up = time.monotonic() + wait
        while time.monotonic() < min(give_up, self.deadline):
            found = self.candidates(phase)
            if found:
                victim = found[int(self.rng.integers(len(found)))]
                if phase == "accumulating":  # somewhere inside the accumulation
                    self.sleep(float(self.rng.uniform(0.0, 0.8)))
                elif phase == "averaging":  # matchmaking or the all-reduce itself
                    self.sleep(float(self.rng.uniform(0.0, 0.6)))
                if victim.killed_at is not None or not victim.alive or victim.phase != phase:
                    continue
                self._kill(victim)
                self.kills.append(
                    {"peer": victim.index, "pid": victim.pid, "aimed": phase, "t": victim.killed_at}
                )
                self.restart_at[victim.index] = time.monotonic() + float(
                    self.rng.uniform(0.2, self.args.max_down)
                )
                return True
            self.poll()
            time.sleep(0.003)
        return False

    def run(self) -> None:
        self.start()
        order: list[str] = []
        misses = 0
        while len(self.kills) < self.args.kills and time.monotonic() < self.deadline:
            if not order:  # a state download follows a restart: aim at it after a kill
                order = [str(k) for k in self.rng.permutation(KINDS[:2])] + ["loading"]
            kind = order.pop(0)
            for _ in range(3):  # the same aim again if no peer was in that phase in time
                if self.kill_in(kind, wait=self.aim_wait):
                    log.info("kill %d (%s)", len(self.kills), kind)
                    # No pause before a loading aim: it is this victim's load after its
                    # restart (within --max-down), over by the end of a longer pause; and
                    # peers that stay in step seldom load otherwise (30 kills then took
                    # longer than --max-seconds, most loading aims waiting out 3 x 30 s).
                    if order[:1] != ["loading"]:
                        self.sleep(float(self.rng.uniform(0.0, self.args.pause)))
                    break
                misses += 1
                log.info("no peer was %s within %.0f s", kind, self.aim_wait)
        self.misses = misses
        # Let every peer come back and take part in a few more epochs, then stop.
        self.kills_done_at = time.monotonic()
        self.epoch_at_last_kill = self.epoch_of(0)
        settle_epoch = self.epoch_of(0) + self.args.settle_epochs
        settle_end = min(self.deadline + 60.0, time.monotonic() + 120.0)
        while time.monotonic() < settle_end:
            self.sleep(0.2)
            epochs = [self.epoch_of(i) for i in self.procs]
            # Everyone back, past the settle epoch and at the same epoch (a peer that lost a
            # round to a killed reducer catches up in a later one); a round in flight when the
            # stop lands may still move some of them one epoch on.
            if (
                not self.restart_at
                and all(inc.killed_at is None for inc in self.procs.values())
                and min(epochs) >= settle_epoch
                and max(epochs) == min(epochs)
            ):
                break
        self.stopping = True
        if self.sahajbert:  # the real trainer runs until killed: nothing to wait for
            for tail in self.tails.values():
                tail.read()
            self.stop_all()
            return
        (self.out / "stop").touch()
        end = time.monotonic() + 30.0
        while time.monotonic() < end and any(inc.alive for inc in self.procs.values()):
            self.poll()
            time.sleep(0.1)
        for inc in self.procs.values():
            if inc.alive:
                log.warning("peer %d did not stop: killing it", inc.index)
                self.hangs.append({"peer": inc.index, "pid": inc.pid, "phase": "stopping"})
                os.kill(inc.pid, signal.SIGKILL)
                inc.process.join()
        for tail in self.tails.values():
            tail.read()

    def stop_all(self) -> None:
        for inc in self.procs.values():
            if inc.alive:
                os.kill(inc.pid, signal.SIGKILL)
                inc.process.join()
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.terminate()
            try:
                self.coordinator.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.coordinator.kill()
                self.coordinator.wait()

    # --- figures -------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        rows = [r for tail in self.tails.values() for r in tail.rows]
        by_pid: dict[int, list[dict]] = defaultdict(list)
        for r in rows:
            by_pid[r["pid"]].append(r)
        by_phase: dict[str, int] = defaultdict(int)
        for k in self.kills:
            phases = [r for r in by_pid[k["pid"]] if r["ev"] == "phase" and r["t"] <= k["t"]]
            k["phase"] = phases[-1]["phase"] if phases else "starting"
            by_phase[k["phase"]] += 1
        records = [r for r in rows if r["ev"] == "epoch"]
        in_step: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        for r in records:
            if r["how"] == "load" or r.get("group", 0) > 1:
                in_step[r["epoch"]][r["digest"]].append(r["peer"])
        divergences = [
            {"epoch": e, "digests": {d: sorted(p) for d, p in found.items()}}
            for e, found in sorted(in_step.items())
            if len(found) > 1
        ]
        nans = [
            {"peer": r["peer"], "epoch": r["epoch"]} for r in records if not r.get("finite", True)
        ]
        steps = [r for r in records if r["how"] == "step"]
        per_peer = {
            str(i): {
                "max_epoch": self.epoch_of(i),
                "grouped_steps": sum(1 for r in steps if r["peer"] == i and r["group"] > 1),
                "solo_steps": sum(1 for r in steps if r["peer"] == i and r["group"] <= 1),
                "loads": sum(1 for r in records if r["peer"] == i and r["how"] == "load"),
            }
            for i in range(self.args.peers)
        }
        final_epoch, final_digests = _final_in_step(in_step, self.args.peers)
        stable = [r for r in steps if r["peer"] == 0]
        losses = [r["loss"] for r in stable if "loss" in r]
        return {
            "epochs": self.epoch_of(0),
            "epochs_after_kills": self.epoch_of(0) - self.epoch_at_last_kill,
            "kills": len(self.kills),
            "divergences": divergences,
            "hangs": self.hangs,
            "nans": nans,
            "kills_by_phase": dict(sorted(by_phase.items())),
            "kills_aimed": {k: sum(1 for x in self.kills if x["aimed"] == k) for k in KINDS},
            "missed_aims": self.misses,
            "restarts": self.restarts,
            "crashes": self.crashes,
            "peers": self.args.peers,
            "in_step_epochs_checked": sum(
                1 for found in in_step.values() if sum(map(len, found.values())) > 1
            ),
            "stable_peer_grouped_epochs": sum(1 for r in stable if r["group"] > 1),
            "stable_peer_solo_epochs": sum(1 for r in stable if r["group"] <= 1),
            "per_peer": per_peer,
            "final_epoch": final_epoch,
            "final_digests": final_digests,
            "final_match": final_epoch is not None and len(set(final_digests.values())) == 1,
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "hang_bound_s": self.bound,
            "kill_seconds": round(self.kills_done_at - self.t0, 1),
            "wall_seconds": round(time.monotonic() - self.t0, 1),
            "peer_kind": self.args.peer,
            "out": str(self.out),
        }


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def prepared_dir(target: int) -> Path:
    """Where the tiny run prepared for ``target`` is kept between runs. Named by the manifest's
    version: a run prepared by an older version is refused by today's coordinator."""
    from examples.sahajbert.manifest import VERSION

    return _shared_cache().parent / f"chaos-sahajbert-run-{target}-v{VERSION}"


def _shared_cache() -> Path:
    """The trainers' JAX compilation cache, kept between runs (the first compiles of the tiny
    model took over 4 minutes on a loaded 2-core machine)."""
    cache = Path(os.environ.get("DEDLOC_JAX_CACHE", "~/.cache/dedloc-jax")).expanduser()
    path = cache / "chaos-sahajbert-jax-cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _final_in_step(
    in_step: dict[int, dict[str, list[int]]], peers: int
) -> tuple[int | None, dict[str, str]]:
    """The last epoch at which every peer held parameters in step (after a group step or a
    load), and each peer's digest there."""
    for epoch in sorted(in_step, reverse=True):
        held = {str(p): d for d, ps in in_step[epoch].items() for p in ps}
        if len(held) == peers:
            return epoch, dict(sorted(held.items()))
    return None, {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=4, help="trainer processes (peer 0 stays)")
    p.add_argument("--kills", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=900.0, help="for the kills")
    p.add_argument("--target", type=int, default=512, help="samples per collaboration step")
    p.add_argument("--step-delay", type=float, default=0.05, help="seconds between micro-steps")
    p.add_argument("--matchmaking-time", type=float, default=0.5)
    p.add_argument("--averaging-timeout", type=float, default=10.0)
    p.add_argument("--load-timeout", type=float, default=15.0)
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.add_argument("--max-down", type=float, default=2.0, help="longest pause before a restart")
    p.add_argument("--pause", type=float, default=5.0, help="longest pause between kills")
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--settle-epochs", type=int, default=3)
    p.add_argument("--out", default=None, help="directory for logs (default: a temporary one)")
    p.add_argument(
        "--peer",
        choices=("mlp", "sahajbert"),
        default="mlp",
        help="mlp: bench.chaos_peer; sahajbert: the real trainer (tiny config) of a prepared "
        "run, with a coordinator as bootstrap",
    )
    p.add_argument("--micro-batch", type=int, default=8, help="sahajbert: --per-device-batch-size")
    args = p.parse_args(argv)
    if args.peer == "sahajbert" and "--target" not in (argv or sys.argv[1:]):
        args.target = 64
    if args.peer == "sahajbert":
        # the real trainer's collaboration (CollaborationConfig.local_demo) adapts its windows;
        # these bound them from above on a loaded CPU, and a trainer's start takes a while
        args.matchmaking_time = max(args.matchmaking_time, 2.0)
        args.averaging_timeout = max(args.averaging_timeout, 30.0)
        args.load_timeout = max(args.load_timeout, 60.0)
        args.startup_timeout = max(args.startup_timeout, 600.0)
    if args.peers < 3:
        p.error("need at least 3 peers (peer 0 stays, two must be alive at any time)")
    return args


def _peer_main(argv: list[str], logfile: str) -> None:
    """A peer process (forked from the fork server, which imported JAX once for all)."""
    fd = os.open(logfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    from bench import chaos_peer

    raise SystemExit(chaos_peer.main(argv))


def run_chaos(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    # The fork server (and so every peer) inherits these: single-threaded XLA on a small CPU.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    os.environ["OMP_NUM_THREADS"] = "1"
    chaos = Chaos(args, out)
    try:
        chaos.run()
    finally:
        chaos.stop_all()
    result = chaos.report()
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    result = run_chaos(args)
    by = result["kills_by_phase"]
    print(
        f"{result['epochs']} epochs, {result['kills']} kills "
        f"({', '.join(f'{k} {v}' for k, v in by.items())}), "
        f"{len(result['divergences'])} divergences, {len(result['hangs'])} hangs, "
        f"{len(result['nans'])} NaN, {result['wall_seconds']} s"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
