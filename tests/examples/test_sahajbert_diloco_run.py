"""A DiLoCo run on the organiser's path, in real processes: ``prepare --mode diloco``, a
coordinator with ``--manifest``, two volunteers with the one-line start, each in its own
work directory. Their ``--events`` digests (the outer parameters in DiLoCo mode) are equal
after every outer step both took together (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from models.text.corpus import write_corpus

ROOT = Path(__file__).resolve().parents[2]
RUN = ["--run-id", "diloco-run-test"]


def _cli(args: list[str], work: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "examples.sahajbert", *args, "--work-dir", str(work)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _steps(events: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    return {r["epoch"]: r for r in rows if r["ev"] == "epoch" and r["how"] == "step"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_diloco_volunteers_hold_the_same_outer_parameters_after_every_step(tmp_path):
    data = tmp_path / "bn.txt"
    write_corpus(data, 300, seed=5)
    run_dir = tmp_path / "run"
    prep = subprocess.run(
        [sys.executable, "-m", "examples.sahajbert", "prepare", *RUN, "--config", "tiny",
         "--seq-length", "32", "--target-batch-size", "32", "--learning-rate", "0.03",
         "--warmup-steps", "2", "--total-steps", "1000", "--mode", "diloco",
         "--inner-steps", "2", "--data", str(data), "--out", str(run_dir),
         "--work-dir", str(tmp_path / "organiser")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert prep.returncode == 0, prep.stderr
    addr_file = tmp_path / "addrs.json"
    coord_log = tmp_path / "coordinator.log"
    coord = _cli(
        ["coordinator", *RUN, "--manifest", str(run_dir), "--out", str(tmp_path / "out"),
         "--addr-file", str(addr_file)],
        tmp_path / "organiser", coord_log,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not addr_file.is_file():
            assert coord.poll() is None, coord_log.read_text()
            assert time.monotonic() < deadline, coord_log.read_text()
            time.sleep(0.2)
        addr = json.loads(addr_file.read_text())[0]
        epochs = 5
        peers = []
        for i in range(2):
            events, log = tmp_path / f"events{i}.jsonl", tmp_path / f"trainer{i}.log"
            args = ["trainer", *RUN, "--initial-peers", addr, "--per-device-batch-size", "4",
                    "--max-epochs", str(epochs), "--wait-for-trainers", "1",
                    "--events", str(events)]  # fmt: skip
            peers.append((_cli(args, tmp_path / f"volunteer{i}", log), events, log))
        for proc, _, log in peers:
            try:
                proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
                pytest.fail(log.read_text()[-3000:])
            assert proc.returncode == 0, log.read_text()[-3000:]
    finally:
        coord.terminate()
        coord.wait(timeout=30)
    a, b = (_steps(events) for _, events, _ in peers)
    together = sorted(e for e in a.keys() & b.keys() if a[e]["group"] == b[e]["group"] == 2)
    assert len(together) >= epochs - 2, (a, b)  # the first step may be one peer's alone
    for e in together:
        assert a[e]["finite"] and b[e]["finite"], (a[e], b[e])
        assert a[e]["digest"] == b[e]["digest"], (e, a[e], b[e])
