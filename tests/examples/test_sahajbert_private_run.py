"""A private run from the CLI on loopback: running peers refuse an uninvited trainer.

The organiser prepares the run, signs invitations with ``invite`` and starts the coordinator
with ``--owner-key``; every peer has its own work directory (standing in for its machine).

- default suite: a trainer started without the run's owner key and invitation passes its own
  start checks (it believes the run open) and is refused by the running coordinator: the
  manifest it asks for is not served, and it exits with the reason and what to do;
- slow: while an invited trainer trains, an intruder that skips every start check (it runs
  the trainer's code with the run's files copied, the owner key and no invitation) is refused
  by the running peers: its join, state and record requests are refused, it never averages
  with the invited trainer, whose training goes on to the end unaffected.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.sahajbert.__main__ import main
from models.text.corpus import write_corpus
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(1800)

ROOT = Path(__file__).resolve().parents[2]
RUN = ["--run-id", "private-cli"]
DEVICE = ["--per-device-batch-size", "8"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}

INTRUDER = """
import logging, sys
from pathlib import Path
from examples.sahajbert import manifest, trainer
from examples.sahajbert.config import NetConfig, TrainerConfig

logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s: %(message)s")
run_dir, work, addr, key, owner = sys.argv[1:]
made, tok_dir = manifest.load(Path(run_dir))
base = TrainerConfig().replace(
    run_id=made.run_id, work_dir=Path(work), per_device_batch_size=8, max_epochs=50
)
cfg = manifest.apply(made, base, tok_dir)
net = NetConfig(initial_peers=(addr,), identity=Path(key), owner_public_key=bytes.fromhex(owner))
trainer.run_trainer(cfg, net, linger=0.0, events=Path(work) / "events.jsonl")
"""


def _cli(args: list[str], work: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "examples.sahajbert", *args, "--work-dir", str(work)]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log.open("w"), stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    """A prepared private run and its coordinator (the owner's peer), stopped at the end."""
    tmp = tmp_path_factory.mktemp("private")
    data = tmp / "text.txt"
    write_corpus(data, 200, seed=4)
    run_dir = tmp / "prepared"
    prep = subprocess.run(
        [sys.executable, "-m", "examples.sahajbert", "prepare", *RUN, "--config", "tiny",
         "--seq-length", "32", "--target-batch-size", "32", "--learning-rate", "0.01",
         "--warmup-steps", "1", "--data", str(data), "--out", str(run_dir),
         "--work-dir", str(tmp / "organiser")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert prep.returncode == 0, prep.stderr
    owner_key = tmp / "owner.key"
    Identity.load_or_create(owner_key)
    addr_file, log = tmp / "addrs.json", tmp / "coordinator.log"
    coord = _cli(
        ["coordinator", *RUN, "--manifest", str(run_dir), "--owner-key", str(owner_key),
         "--out", str(tmp / "out"), "--addr-file", str(addr_file), "--checkpoint-every", "1"],
        tmp / "organiser", log,
    )  # fmt: skip
    deadline = time.monotonic() + 600  # a loaded machine
    while not addr_file.is_file():
        assert coord.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    yield {
        "tmp": tmp,
        "addr": json.loads(addr_file.read_text())[0],
        "run_dir": run_dir,
        "owner_key": owner_key,
        "owner": Identity.load(owner_key).public_key.hex(),
        "coord": coord,
        "log": log,
    }
    coord.terminate()
    coord.wait(timeout=30)


@pytest.mark.slow
def test_the_running_coordinator_refuses_a_trainer_without_an_invitation(run) -> None:
    work, log = run["tmp"] / "stranger", run["tmp"] / "stranger.log"
    key = run["tmp"] / "stranger.key"
    stranger = Identity.load_or_create(key)
    # no --owner: its start checks pass (it believes the run open); the coordinator refuses it
    proc = _cli(["trainer", *RUN, "--initial-peers", run["addr"], "--identity", str(key),
                 *DEVICE], work, log)  # fmt: skip
    assert proc.wait(timeout=300) == 2, log.read_text()[-3000:]
    text = log.read_text()
    assert f"refused this peer ({stranger.peer_id})" in text, text[-3000:]
    assert "not admitted to this run" in text and "no invitation" in text
    assert "--owner PUBKEY --invitation FILE" in text  # what to do
    assert not (work / "tokenizers").exists()  # nothing of the run was served to it
    assert run["coord"].poll() is None  # the coordinator keeps serving
    assert f"refusing {stranger.peer_id}" in run["log"].read_text()


@pytest.mark.slow
def test_running_peers_refuse_an_intruder_and_the_invited_trainer_trains_on(run, capsys) -> None:
    tmp = run["tmp"]
    me_key, inv = tmp / "volunteer.key", tmp / "volunteer.invitation"
    me = Identity.load_or_create(me_key)
    assert main(["invite", *RUN, "--owner-key", str(run["owner_key"]), "--peer",
                 str(me.peer_id), "--expires", "1h", "--out", str(inv)]) == 0  # fmt: skip
    capsys.readouterr()
    intruder_key = tmp / "intruder.key"
    intruder = Identity.load_or_create(intruder_key)
    intruder_log = tmp / "intruder.log"
    args = [str(run["run_dir"]), str(tmp / "intruder"), run["addr"], str(intruder_key),
            run["owner"]]  # fmt: skip
    bad = subprocess.Popen(
        [sys.executable, "-c", INTRUDER, *args], cwd=ROOT, env=ENV,
        stdout=intruder_log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    volunteer_log = tmp / "volunteer.log"
    volunteer = _cli(
        ["trainer", *RUN, "--initial-peers", run["addr"], "--owner", run["owner"],
         "--invitation", str(inv), "--identity", str(me_key), "--max-epochs", "4", *DEVICE],
        tmp / "volunteer", volunteer_log,
    )  # fmt: skip
    try:
        assert volunteer.wait(timeout=900) == 0, volunteer_log.read_text()[-3000:]
    finally:
        bad.kill()
        bad.wait(timeout=30)
    coord_text = run["log"].read_text()
    text = volunteer_log.read_text()
    bad_text = intruder_log.read_text()
    assert "stopped at epoch 4" in text, text[-2000:]
    # the running peers refused it (the invited trainer names it only to refuse it) ...
    mentions = [line for line in text.splitlines() if str(intruder.peer_id) in line]
    assert all("refusing" in line for line in mentions), mentions
    assert f"refusing {intruder.peer_id}" in coord_text + text, coord_text[-3000:]
    # ... and it was told, never averaged in a group and never got the run's state
    assert "without an invitation: peers will refuse us" in bad_text, bad_text[-3000:]
    after = bad_text.split("refuse us", 1)[1]
    assert re.search(r"no invitation to run 'private-cli'|no invitation in the record", after)
    events = [json.loads(line) for line in (tmp / "intruder" / "events.jsonl").open()]
    steps = [e for e in events if e["ev"] == "epoch"]
    assert steps, bad_text[-3000:]  # it did train, alone
    assert all(e["how"] == "step" and e["group"] <= 1 for e in steps), steps
    # the coordinator's rows count the invited trainer only
    rows = [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").open()]
    assert rows and all(r["peers"] <= 1 for r in rows), rows
    status = json.loads((tmp / "out" / "status.json").read_text())
    assert str(intruder.peer_id) not in {p["peer"] for p in status["peers"]}
