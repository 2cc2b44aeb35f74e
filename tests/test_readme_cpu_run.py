"""The README's one-machine try of a prepared run, run as written: ``prepare`` with the CPU
recipe, a coordinator, two volunteers with their own work directories, in real processes.

Only the port (a free one), the address (the coordinator's ``join with:`` line, as the user
copies it) and the length (``--max-epochs 12``: off the coordinator's 10-epoch cadence, which
is what a user's own N mostly is) are replaced. The volunteers must stop with their last epoch
saved by the coordinator (it saved nothing there, and they waited two minutes in silence),
and the loss must fall (with sahajBERT's optimizer, which `prepare` kept, it stayed at 7.55).
"""

from __future__ import annotations

import csv
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
EPOCHS = 12

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def commands() -> list[str]:
    """The block's commands, continuation lines joined, comments dropped."""
    text = README.read_text()
    found = re.search(
        r"\*\*Try the organiser's path on one machine first\*\*.*?```bash\n(.*?)```", text, re.S
    )
    assert found, "README.md lost its one-machine try"
    joined = found.group(1).replace("\\\n", " ")
    return [" ".join(line.split()) for line in joined.splitlines() if line and line[0] != "#"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _argv(command: str, **swap: str) -> list[str]:
    for old, new in swap.items():
        command = command.replace(old, new)
    words = command.split()
    assert words[0] == "python", command
    return [sys.executable, *words[1:]]


def test_the_readmes_one_machine_try_learns_and_saves_the_last_epoch(tmp_path: Path) -> None:
    prepare, coordinator, *volunteers = commands()
    assert len(volunteers) == 2 and "--data" not in prepare  # the synthetic corpus
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    port = str(_free_port())
    got = subprocess.run(
        _argv(prepare), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert got.returncode == 0, got.stderr[-3000:]
    assert "optimizer: LAMB, lr 0.03, warmup 2 steps" in got.stdout, got.stdout
    logs = {name: (tmp_path / f"{name}.log").open("w") for name in ("coord", "vol1", "vol2")}
    coord = subprocess.Popen(
        _argv(coordinator, **{"/tcp/31337": f"/tcp/{port}"}), cwd=tmp_path, env=env,
        stdout=logs["coord"], stderr=subprocess.STDOUT,
    )  # fmt: skip
    procs: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 600
        while not (joined := re.search(r"join with: --initial-peers (\S+)", _log(tmp_path))):
            assert coord.poll() is None and time.monotonic() < deadline, _log(tmp_path)[-3000:]
            time.sleep(0.5)
        swap = {"ADDR": joined.group(1), "--max-epochs 30": f"--max-epochs {EPOCHS}"}
        for command, name in zip(volunteers, ("vol1", "vol2"), strict=True):
            procs.append(
                subprocess.Popen(
                    _argv(command, **swap),
                    cwd=tmp_path,
                    env=env,
                    stdout=logs[name],
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
            )
        for proc, name in zip(procs, ("vol1", "vol2"), strict=True):
            assert proc.wait(timeout=900) == 0, _log(tmp_path, name)[-3000:]
    finally:
        for proc in (*procs, coord):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    saved = f"the coordinator saved epoch {EPOCHS} to "
    for name in ("vol1", "vol2"):
        text = _log(tmp_path, name)
        assert saved in text and "WARNING" not in text.split("serving epoch")[-1], text[-3000:]
    assert (tmp_path / "coord" / "checkpoints" / f"epoch_{EPOCHS:06d}" / "meta.json").is_file()
    with (tmp_path / "coord" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    first, last = float(rows[0]["loss"]), float(rows[-1]["loss"])
    print(f"loss {first:.4f} -> {last:.4f} over {len(rows)} epochs")
    assert first > 7.3 and last < first - 0.15, rows


def _log(tmp: Path, name: str = "coord") -> str:
    return (tmp / f"{name}.log").read_text()
