"""Issue 46 with real processes: a public run of three honest trainers and one whose reducer
returns -1000 x every share it reduces, on loopback (the README's block, ``tests.readme_peer``;
the liar is ``tests.hostile_peer``). The honest peers must keep stepping, stay finite and
bit-identical, ban the liar within two rounds and average without it afterwards, and move
toward the truth: LAMB's first step from zero moves each weight by the learning rate along the
sign of its averaged gradient, so a poisoned share that landed in the first round leaves its
weights at -1e-3 (and later steps, scaled by the trust ratio, are 1000x smaller); a share
caught is recomputed without the liar's part. Measured: the liar banned in round 1 by the peer
it cheated, the others following from the evidence; ~45 s on 2 loaded cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dedloc_jax
from tests.readme_peer import TRUE_W

ROOT = Path(__file__).resolve().parent.parent.parent
TARGET = 64
EPOCHS = 6


def _start(module: str, out: Path, addrs: list[str], seed: int) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", module, str(out), json.dumps(addrs), str(TARGET)]
    cmd += [str(EPOCHS), str(seed)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "README_PEER_PACE": "0.02"}
    log = (out / "log.txt").open("ab")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_three_honest_trainers_ban_a_lying_reducer_and_keep_training(tmp_path: Path) -> None:
    boot = dedloc_jax.Collaboration("my-run", config=dedloc_jax.CollaborationConfig(mode="aux"))
    boot.start()
    procs: list[subprocess.Popen] = []
    try:
        addrs = [str(a) for a in boot.addrs]
        outs = [tmp_path / f"peer{i}" for i in range(4)]
        for i, out in enumerate(outs):
            procs.append(
                _start("tests.hostile_peer" if i == 3 else "tests.readme_peer", out, addrs, i)
            )
        for proc, out in zip(procs[:3], outs[:3], strict=True):
            try:
                rc = proc.wait(150)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            assert rc == 0, f"{out.name} ended with {rc}:\n{(out / 'log.txt').read_text()[-4000:]}"
        boot_bans = boot.banned_peers()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        boot.close()
    finals = []
    for out in outs[:3]:
        with np.load(out / "final.npz") as f:
            finals.append((f["w"], int(f["epoch"])))
    peers = [json.loads((out / "peer.json").read_text()) for out in outs[:3]]
    honest_ids = {p["peer_id"] for p in peers}
    w0 = finals[0][0]
    for w, epoch in finals:
        assert epoch == EPOCHS  # every honest peer kept stepping to the end
        np.testing.assert_array_equal(w, w0)  # bit-identical
    assert np.all(np.isfinite(w0))
    assert np.all(w0 > 0), w0  # TRUE_W is positive: no poisoned step landed
    for out in outs[:3]:
        history = json.loads((out / "history.json").read_text())
        sizes = [h["group_size"] for h in history]
        assert all(h["complete"] for h in history), history
        # the liar averages in two rounds at most, then never again
        assert sizes[2:] == [3] * (EPOCHS - 2) and set(sizes[:2]) <= {3, 4}, sizes
    x = np.random.default_rng(0).normal(size=(256, TRUE_W.size)).astype(np.float32)
    assert np.mean((x @ w0 - x @ TRUE_W) ** 2) < np.mean((x @ TRUE_W) ** 2)
    banned = [{b["peer"] for b in p["bans"] if b["verified"]} for p in peers]
    print(f"honest w {w0}; bans {banned}; the run's first peer's list {boot_bans}")
    liar = set.union(*banned)
    assert len(liar) == 1 and not liar & honest_ids  # the liar, and only it
    assert all(banned), banned  # every honest peer banned it (itself or from the evidence)
