"""Two volunteers and a coordinator on loopback; one volunteer killed -9 and restarted in turn.

Run ``python -m bench.restart_pair [--restarts 4] [--identity] [--out DIR]``. A tiny run is
prepared, its coordinator started (checkpoints every 10 epochs, as by default) and two
``python -m examples.sahajbert trainer`` processes join it with the README's one-line start
(each in its own work directory; ``--identity`` gives each a key file, so a restart keeps its
peer ID; without it a restart is a new peer, as the one-line start makes). The second trainer
is slower (``--step-delay``). Once they average, the driver kills trainer 0, then 1, then 0...
with SIGKILL, restarts it 3 s later and watches ``--watch`` seconds from its first micro-step
after compiling (its ``--events``).

Per restart it prints one JSON line: the seconds from the restart to the first micro-step,
the steps taken by both in the window, the lone steps (group of one) and the epochs they
fell in. A pair that splits into two lineages (issue 45) steps alone through the window.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


class Pair:
    def __init__(self, out: Path, identity: bool) -> None:
        self.out = out
        self.identity = identity
        self.cache = out / "jax-cache"  # one machine's compiled programs, shared
        self.cache.mkdir(parents=True, exist_ok=True)
        self.addr = ""

    def _work(self, name: str) -> Path:
        work = self.out / name
        work.mkdir(exist_ok=True)
        if not (work / "jax-cache").exists():
            (work / "jax-cache").symlink_to(self.cache, target_is_directory=True)
        return work

    def _start(self, args: list[str], log: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "examples.sahajbert", *args]
        print("$", " ".join(cmd), flush=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with (self.out / log).open("a") as f:
            return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)

    def coordinator(self) -> subprocess.Popen:
        from models.text.corpus import write_corpus

        run = self.out / "run"
        if not (run / "manifest.json").is_file():
            text = self.out / "text.txt"
            write_corpus(text, 300, seed=0)
            prepare = self._start(
                ["prepare", "--config", "tiny", "--seq-length", "32", "--target-batch-size",
                 "64", "--learning-rate", "0.01", "--warmup-steps", "1", "--data", str(text),
                 "--out", str(run), "--work-dir", str(self._work("organiser"))],
                "prepare.log",
            )  # fmt: skip
            if prepare.wait() != 0:
                raise RuntimeError("prepare failed: see prepare.log")
        addr_file = self.out / "addrs.json"
        proc = self._start(
            ["coordinator", "--manifest", str(run), "--out", str(self.out / "coordinator"),
             "--work-dir", str(self._work("organiser")), "--addr-file", str(addr_file),
             "--checkpoint-every", "10"],
            "coordinator.log",
        )  # fmt: skip
        while not addr_file.exists():
            if proc.poll() is not None:
                raise RuntimeError("the coordinator exited: see coordinator.log")
            time.sleep(0.5)
        self.addr = json.loads(addr_file.read_text())[0]
        return proc

    def trainer(self, i: int, step_delay: float) -> subprocess.Popen:
        args = ["trainer", "--initial-peers", self.addr, "--work-dir",
                str(self._work(f"trainer{i}")), "--per-device-batch-size", "4",
                "--events", str(self.out / f"peer{i}.jsonl")]  # fmt: skip
        if self.identity:
            args += ["--identity", str(self.out / f"trainer{i}.key")]
        if step_delay:
            args += ["--step-delay", str(step_delay)]
        return self._start(args, f"trainer{i}.log")

    def events(self, i: int) -> list[dict[str, Any]]:
        path = self.out / f"peer{i}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def training_since(self, i: int, after: float) -> float | None:
        """When trainer ``i`` (started after ``after``) took its first micro-step after
        compiling."""
        compiled = False
        for e in self.events(i):
            if e["t"] <= after or e["ev"] != "phase":
                continue
            compiled = compiled or e["phase"] == "compiling"
            if compiled and e["phase"] == "accumulating":
                return e["t"]
        return None

    def steps(self, start: float, end: float) -> list[tuple[float, int, int, int]]:
        """(time, trainer, epoch stepped to, group size) of both trainers' steps."""
        return sorted(
            (e["t"], i, e["epoch"], e.get("group", 0))
            for i in (0, 1)
            for e in self.events(i)
            if e["ev"] == "epoch" and e.get("how") == "step" and start <= e["t"] <= end
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=4)
    parser.add_argument("--identity", action="store_true", help="a key file per trainer")
    parser.add_argument("--watch", type=float, default=55.0, help="seconds after each restart")
    parser.add_argument("--step-delay", type=float, default=0.1, help="the slower trainer's")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="restart-pair-"))
    pair = Pair(out, args.identity)
    coordinator = pair.coordinator()
    procs = {0: pair.trainer(0, 0.0), 1: pair.trainer(1, args.step_delay)}
    figures = []
    try:
        started = time.time()
        while sum(s[3] >= 2 for s in pair.steps(started, time.time())) < 10:
            if time.time() - started > 1800:
                raise RuntimeError("the trainers never averaged: see trainer*.log")
            time.sleep(2)
        for r in range(args.restarts):
            victim = r % 2
            time.sleep(5)
            procs[victim].send_signal(signal.SIGKILL)
            procs[victim].wait()
            time.sleep(3)
            restarted = time.time()
            procs[victim] = pair.trainer(victim, args.step_delay if victim else 0.0)
            while (since := pair.training_since(victim, restarted)) is None:
                if procs[victim].poll() is not None:
                    raise RuntimeError(f"trainer {victim} exited: see trainer{victim}.log")
                time.sleep(1)
            time.sleep(args.watch)
            steps = pair.steps(since, since + args.watch)
            lone = [s for s in steps if s[3] < 2]
            figures.append({
                "restart": r, "victim": victim, "to_first_step_s": round(since - restarted, 1),
                "steps": len(steps), "lone_steps": len(lone),
                "lone_epochs": sorted({s[2] for s in lone}),
            })  # fmt: skip
            print(json.dumps(figures[-1]), flush=True)
    finally:
        for p in (*procs.values(), coordinator):
            p.send_signal(signal.SIGINT)
        time.sleep(5)
        for p in (*procs.values(), coordinator):
            if p.poll() is None:
                p.kill()
    print(json.dumps({"out": str(out), "restarts": figures}))


if __name__ == "__main__":
    main()
