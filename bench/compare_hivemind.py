"""Our butterfly all-reduce against hivemind 1.1.12's, same peers, sizes and data, one run.

    python -m bench.compare_hivemind --peers 4 --size 18000000 [--rounds 3]
        [--hivemind-python PATH]

hivemind and torch come from the ``compare`` extra (``pip install -e '.[compare]'``); they may
live in another environment: ``--hivemind-python`` names its interpreter (default: this one),
which runs the hivemind peers. Each hivemind peer is a process with its own DHT and Go daemon,
listening on 127.0.0.1 only, with UPnP/NAT-PMP port mapping, AutoNAT and relays off. Peer i
averages the same float32 vector as in ``bench.allreduce`` (seeded by i, weight i + 1).

Rounds alternate, ours then hivemind's, so both meet the machine's load alike. A hivemind
round is timed from the moment every peer's group is formed (``require_trigger``:
matchmaking is not counted) until every peer holds the average; ours from the start of
``all_reduce`` (its group is given) until every peer holds the average. Only complete rounds
(every peer averaged with all the others) count in the medians. Prints a table and, as the last
line, a JSON object: ``ours_seconds``, ``hivemind_seconds``, ``ratio`` (ours / hivemind), the
same for CPU time of a round over all peers' processes (``cpu_ratio``; hivemind's counts its
DHT and averager processes and Go daemons),
``ours_complete_rounds``, ``hivemind_complete_rounds`` (of ``rounds``), and both max errors.

This file also runs as a hivemind peer (``--hivemind-peer``); that side imports only the
standard library, numpy, torch and hivemind.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np


def _vector(i: int, size: int) -> np.ndarray:
    """The same vector as bench.allreduce gives peer ``i``."""
    return np.random.default_rng(1000 + i).standard_normal(size, dtype=np.float32)


# ---- one hivemind peer (runs under --hivemind-python) ----------------------------------------


def _say(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _hear() -> Any:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)
    return json.loads(line)


def _tree_cpu_seconds() -> float:
    """CPU time of this process and every live descendant (hivemind's DHT and averager
    processes, its Go daemon), from /proc (Linux; 0 elsewhere)."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        names = os.listdir("/proc")
    except OSError:
        return 0.0
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(name)] = int(fields[1])
        cpu[int(name)] = (int(fields[11]) + int(fields[12])) / tick
    mine, total = {os.getpid()}, 0.0
    changed = True
    while changed:
        changed = False
        for pid, parent in parents.items():
            if parent in mine and pid not in mine:
                mine.add(pid)
                changed = True
    for pid in mine:
        total += cpu.get(pid, 0.0)
    return total


def hivemind_peer(index: int, peers: int, size: int, initial: list[str], timeout: float) -> None:
    import hashlib

    import hivemind
    import torch
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.control import AveragingStage

    dht = hivemind.DHT(
        initial_peers=initial or None,
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        nat_port_map=False,  # UPnP / NAT-PMP off
        auto_nat=False,
        use_relay=False,
        use_auto_relay=False,
    )
    _say({"maddrs": [str(a) for a in dht.get_visible_maddrs()]})
    original = _vector(index, size)
    tensor = torch.from_numpy(original.copy())
    averager = DecentralizedAverager(
        [tensor],
        dht,
        start=True,
        prefix="bench_compare",
        target_group_size=peers,
        min_group_size=peers,
        allreduce_timeout=timeout,
    )
    _say({"ready": True})
    weight = float(index + 1)
    while True:
        cmd = _hear()
        if cmd["cmd"] == "round":
            with averager.get_tensors() as tensors:
                tensors[0][:] = torch.from_numpy(original)
            control = averager.step(
                weight=weight, wait=False, require_trigger=True, timeout=timeout
            )
            deadline = time.monotonic() + timeout
            while (
                control.stage != AveragingStage.AWAITING_TRIGGER
                and not control.done()
                and time.monotonic() < deadline
            ):
                time.sleep(0.01)
            armed = control.stage == AveragingStage.AWAITING_TRIGGER and not control.done()
            _say({"armed": armed})
            _hear()  # go: every peer's group is formed
            t0, c0 = time.perf_counter(), _tree_cpu_seconds()
            ok, group = False, 0
            if armed:
                control.allow_allreduce()
                try:
                    gathered = control.result(timeout=timeout)
                    group = len(gathered) if gathered is not None else 0
                    ok = gathered is not None
                except Exception as e:  # a failed round is counted, not fatal
                    print(f"hivemind peer {index}: round failed: {e!r}", file=sys.stderr)
            else:
                control.cancel()
            seconds = time.perf_counter() - t0
            cpu = _tree_cpu_seconds() - c0
            _say({"seconds": seconds, "cpu": cpu, "ok": ok, "group": group})
        elif cmd["cmd"] == "report":
            with averager.get_tensors() as tensors:
                result = tensors[0].numpy().copy()
            want = np.zeros(size, np.float64)
            for i in range(peers):
                want += _vector(i, size).astype(np.float64) * (i + 1)
            want /= sum(range(1, peers + 1))
            _say(
                {
                    "max_abs_error": float(np.max(np.abs(result - want))),
                    "digest": hashlib.sha256(result.tobytes()).hexdigest(),
                }
            )
        else:
            break
    averager.shutdown()
    dht.shutdown()


# ---- the orchestrator --------------------------------------------------------------------------


class _Peer:
    def __init__(self, python: str, args: list[str]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), "--hivemind-peer", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def say(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def hear(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"hivemind peer exited ({self.proc.poll()})")
        return json.loads(line)


class HivemindPeers:
    """``peers`` hivemind peer processes; :meth:`round` runs one timed round among them."""

    def __init__(self, python: str, peers: int, size: int, timeout: float) -> None:
        self.peers = peers
        common = [str(peers), str(size), str(timeout)]
        self.procs = [_Peer(python, ["0", *common])]
        try:
            maddrs = self.procs[0].hear()["maddrs"]
            self.procs += [_Peer(python, [str(i), *common, *maddrs]) for i in range(1, peers)]
            for p in self.procs[1:]:
                p.hear()  # its addresses
            for p in self.procs:
                p.hear()  # ready
        except BaseException:
            self.close()
            raise
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.complete: list[bool] = []

    def round(self) -> None:
        for p in self.procs:
            p.say({"cmd": "round"})
        armed = [p.hear()["armed"] for p in self.procs]
        for p in self.procs:
            p.say({"cmd": "go"})
        outs = [p.hear() for p in self.procs]
        self.times.append(max(o["seconds"] for o in outs))
        self.cpu.append(sum(o["cpu"] for o in outs))
        ok = all(armed) and all(o["ok"] and o["group"] == self.peers for o in outs)
        self.complete.append(ok)
        state = "complete" if ok else "INCOMPLETE"
        n = len(self.times)
        print(
            f"hivemind round {n}: {self.times[-1]:.3f} s ({self.cpu[-1]:.2f} CPU-s, {state})",
            file=sys.stderr,
        )

    def report(self) -> dict:
        for p in self.procs:
            p.say({"cmd": "report"})
        reports = [p.hear() for p in self.procs]
        done = [t for t, c in zip(self.times, self.complete, strict=True) if c]
        cpu = [t for t, c in zip(self.cpu, self.complete, strict=True) if c]
        return {
            "seconds": statistics.median(done) if done else None,
            "cpu_seconds": statistics.median(cpu) if cpu else None,
            "complete_rounds": len(done),
            "times": self.times,
            "max_abs_error": max(rep["max_abs_error"] for rep in reports),
            "identical": len({rep["digest"] for rep in reports}) == 1,
        }

    def close(self) -> None:
        for p in self.procs:
            try:
                p.say({"cmd": "quit"})
            except OSError:
                pass
        for p in self.procs:
            try:
                p.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.proc.kill()


def _check_python(python: str) -> str | None:
    probe = "import hivemind, torch; print(hivemind.__version__, torch.__version__)"
    try:
        out = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, timeout=120, check=True
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"{python} cannot import hivemind and torch ({e}); install the 'compare' extra"
    return None if out.stdout.split()[:1] == ["1.1.12"] else f"hivemind {out.stdout.strip()}"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--hivemind-peer"]:
        index, peers, size, timeout, *initial = argv[1:]
        hivemind_peer(int(index), int(peers), int(size), initial, float(timeout))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--size", type=int, default=18_000_000, help="float32 values per peer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--hivemind-python", default=sys.executable)
    args = ap.parse_args(argv)
    problem = _check_python(args.hivemind_python)
    if problem is not None:
        print(problem, file=sys.stderr)
        raise SystemExit(2)

    from bench.allreduce import run_loopback

    print(f"{args.peers} peers x {args.size} float32: starting hivemind's peers", file=sys.stderr)
    hivemind = HivemindPeers(args.hivemind_python, args.peers, args.size, args.timeout)
    try:
        # rounds alternate (ours, then hivemind's), so both see the machine's load alike
        ours = run_loopback(
            args.peers, args.size, 0, "none", args.rounds, between=lambda r: hivemind.round()
        )
        hm = hivemind.report()
    finally:
        hivemind.close()
    ratio = (
        ours["seconds"] / hm["seconds"]
        if ours["seconds"] is not None and hm["seconds"] is not None
        else None
    )

    def cell(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    cpu_ratio = (
        ours["cpu_seconds"] / hm["cpu_seconds"]
        if ours["cpu_seconds"] is not None and hm["cpu_seconds"]
        else None
    )
    print(
        f"| {args.peers} peers x {args.size:,} float32 | round (median) | CPU, all peers "
        "| complete | max error |"
    )
    print("|---|---|---|---|---|")
    for label, row in (("dedloc-jax", ours), ("hivemind 1.1.12", hm)):
        print(
            f"| {label} | {cell(row['seconds'], '.2f')} s | {cell(row['cpu_seconds'], '.2f')} s "
            f"| {row['complete_rounds']}/{args.rounds} | {cell(row['max_abs_error'], '.1e')} |"
        )
    print(f"ours / hivemind: {cell(ratio, '.2f')} (round), {cell(cpu_ratio, '.2f')} (CPU)")
    print(
        json.dumps(
            {
                "peers": args.peers,
                "size": args.size,
                "rounds": args.rounds,
                "ours_seconds": ours["seconds"],
                "ours_complete_rounds": ours["complete_rounds"],
                "ours_max_abs_error": ours["max_abs_error"],
                "socket_seconds": ours["socket_seconds"],
                "hivemind_seconds": hm["seconds"],
                "hivemind_complete_rounds": hm["complete_rounds"],
                "hivemind_round_seconds": hm["times"],
                "hivemind_max_abs_error": hm["max_abs_error"],
                "hivemind_identical": hm["identical"],
                "ours_cpu_seconds": ours["cpu_seconds"],
                "hivemind_cpu_seconds": hm["cpu_seconds"],
                "ratio": ratio,
                "cpu_ratio": cpu_ratio,
            }
        )
    )


if __name__ == "__main__":
    main()
