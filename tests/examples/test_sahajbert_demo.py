"""The embedded demo, shortened: real processes on loopback train together.

Reuses the data/tokenizer/compilation cache under ``$DEDLOC_JAX_CACHE`` (default
``~/.cache/dedloc-jax``), so only the first run on a machine pays for building it.
"""

from __future__ import annotations

import csv
import json
import signal
from pathlib import Path

import numpy as np
import pytest

from examples.sahajbert.config import DEFAULT_WORK_DIR, DemoConfig, TrainerConfig
from examples.sahajbert.demo import DemoResult, run_collaboration
from examples.sahajbert.finetune import load_pretrained
from examples.sahajbert.training import flat_params

pytestmark = pytest.mark.timeout(600)  # several processes start and compile on a busy CPU

CFG = TrainerConfig.demo(DEFAULT_WORK_DIR).replace(run_id="sahajbert-test")


@pytest.fixture(scope="module")
def short_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[DemoResult, Path, DemoConfig]:
    out = tmp_path_factory.mktemp("demo")
    demo = DemoConfig(trainers=2, client_trainers=1, epochs=4, checkpoint_every=2, timeout=280)
    return run_collaboration(demo, CFG, out, live=False), out, demo


def test_processes_train_together_and_loss_falls(short_demo) -> None:
    result, out, demo = short_demo
    assert result.returncodes == {"coordinator": 0, "trainer0": 0, "trainer1": 0}
    # one row per collaboration epoch, in the JSONL and the CSV
    assert [r["epoch"] for r in result.rows] == list(range(demo.epochs))
    with (out / "metrics.csv").open() as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == list(range(demo.epochs))
    # Peers step when their estimate of the collaboration's samples reaches the target. It
    # extrapolates the others' rates, so on a busy machine an epoch may end a little short
    # (seen: 80 of 96), but never at one micro-batch (16).
    assert all(r["samples"] >= CFG.target_batch_size // 2 for r in result.rows), result.rows
    # The run waits for nobody: a trainer that finished starting first may take epoch 0 alone
    # (the other then loads its state). The fast trainer fills an epoch alone in half a
    # second, so one more epoch without the slow one (busy loading a state) is allowed; most
    # are stepped together.
    together = sum(r["peers"] == 2 for r in result.rows[1:])
    assert together >= len(result.rows[1:]) - 1, ([r["peers"] for r in result.rows], _logs(out))
    # the first step runs at learning rate 0 (warmup), so compare with the last epoch
    assert result.rows[-1]["loss"] < result.rows[0]["loss"] - 0.02
    assert result.plot is not None and result.plot.stat().st_size > 1000


def test_peers_end_bit_identical_and_the_checkpoint_loads(short_demo) -> None:
    result, out, demo = short_demo
    assert result.identical
    final = dict(np.load(result.final_params[0]))
    assert int(final.pop("__epoch__")) == demo.epochs
    model, meta = load_pretrained(Path(result.checkpoint))
    assert meta["epoch"] == demo.epochs
    from flax import nnx

    saved = flat_params(nnx.state(model, nnx.Param))
    assert saved.keys() == final.keys()
    assert all(saved[k].tobytes() == final[k].tobytes() for k in final)


def test_status_lists_both_trainers_one_in_client_mode(short_demo) -> None:
    _, out, _ = short_demo
    status = json.loads((out / "status.json").read_text())
    assert sorted(p["mode"] for p in status["peers"]) == ["client", "node"]
    assert status["checkpoint_epoch"] == 4


def _logs(out: Path, lines: int = 40) -> str:
    """The end of every process's log (what a failure on a CI machine can be traced from)."""
    tails = []
    for path in sorted((out / "logs").glob("*.log")):
        kept = [ln for ln in path.read_text().splitlines() if ln.strip() and " absl " not in ln]
        tails.append(f"--- {path.name}\n" + "\n".join(kept[-lines:]))
    return "\n".join(tails)


@pytest.mark.slow
def test_a_killed_trainer_restarts_and_catches_up(tmp_path: Path) -> None:
    demo = DemoConfig(trainers=2, client_trainers=0, epochs=8, checkpoint_every=4, timeout=500)
    events: list[str] = []

    def chaos(procs, status) -> None:
        epoch = (status or {}).get("estimate", {}).get("epoch", 0)
        if not events and epoch >= 2:
            procs.kill("trainer0")
            events.append(f"killed at {epoch}")
        elif len(events) == 1:
            procs.start("trainer0", procs.args["trainer0"])
            events.append("restarted")

    result = run_collaboration(demo, CFG.replace(run_id="sahajbert-restart"), tmp_path,
                               live=False, on_tick=chaos)  # fmt: skip
    assert len(events) == 2, events
    assert result.returncodes["trainer0"] == 0 and result.returncodes["trainer1"] == 0
    log = (tmp_path / "logs" / "trainer0.log").read_text()
    assert "loaded the collaboration's state of epoch" in log
    assert result.identical  # the restarted trainer ends with the others' parameters
    assert int(np.load(result.final_params[0])["__epoch__"]) == demo.epochs
    assert signal.SIGKILL  # (the kill was a SIGKILL: no clean shutdown)


@pytest.mark.slow
def test_aux_peer_joins_every_averaging_round(tmp_path: Path) -> None:
    """Coordinator, trainer and aux started from the command line, as on separate machines."""
    import re
    import time

    from examples.sahajbert.demo import Processes, cli_args, wait_for_file

    cfg = CFG.replace(run_id="sahajbert-aux", target_batch_size=32, max_epochs=3)
    base = cli_args(cfg)
    addr_file = tmp_path / "addrs.json"
    with Processes(tmp_path / "logs") as procs:
        coord = procs.start(
            "coordinator",
            ["coordinator", *base, "--out", str(tmp_path), "--addr-file", str(addr_file)],
        )
        wait_for_file(addr_file, coord, timeout=300)
        addr = json.loads(addr_file.read_text())[0]
        aux = procs.start("aux", ["aux", *base, "--initial-peers", addr])
        time.sleep(10)  # the helper is in the run before the first step
        trainer = procs.start("trainer", ["trainer", *base, "--initial-peers", addr])
        codes = [p.wait(timeout=400) for p in (trainer, aux, coord)]
    assert codes == [0, 0, 0]
    log = (tmp_path / "logs" / "aux.log").read_text()
    joined = [int(n) for n in re.findall(r"aux peer: (\d+) averaging rounds joined", log)]
    # A helper that is late for a round (still matchmaking the previous one) misses it; it
    # must join rounds and then leave with the run.
    assert joined and joined[-1] >= 1
