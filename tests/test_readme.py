"""The README's "own JAX code" example runs as written, in separate peer processes.

Users copy that block first. Each peer is a process of its own (``tests.readme_peer``: the block
with only the placeholder address and the target replaced) on loopback, bootstrapped through an
aux-mode collaboration that trains nothing. The peers must take one step per ``target`` samples
fed, end bit-identical, and equal a single process that trains on the union of the samples the
peers fed before each step; a peer that joins late, or is killed and restarted, catches up by
itself and then contributes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dedloc_jax
from tests.readme_peer import loss_fn

ROOT = Path(__file__).resolve().parent.parent
TARGET = 64


def _start(
    out: Path, addrs: list[str], epochs: int, seed: int, env: dict | None = None
) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tests.readme_peer", str(out), json.dumps(addrs)]
    cmd += [str(TARGET), str(epochs), str(seed)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
    log = (out / "log.txt").open("ab")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, out: Path, timeout: float = 240) -> None:
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    if rc != 0:
        tail = (out / "log.txt").read_text()[-4000:]
        raise AssertionError(f"peer in {out} ended with {rc}:\n{tail}")


def _fed(out: Path) -> list[dict]:
    """The micro-batches a peer fed, each with ``epoch`` (of the state it was fed to) and
    ``toward`` (the epoch whose step it went into: the next one for a micro-batch that a
    round begun during its micro-step carried over, ``collaborative``'s hand-over)."""
    fed: list[dict] = []
    for line in (out / "fed.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("carried"):
            fed[-1]["toward"] = fed[-1]["epoch"] + 1
        else:
            fed.append({**record, "toward": record["epoch"]})
    return fed


def _final(out: Path) -> tuple[np.ndarray, int]:
    with np.load(out / "final.npz") as f:
        return f["w"], int(f["epoch"])


def _history(out: Path) -> list[dict]:
    return json.loads((out / "history.json").read_text())


def _single_process(fed: list[dict], epochs: int) -> np.ndarray:
    """The README's optimizer in one process, stepping on the union of the micro-batches the
    peers fed toward each epoch (each clipped as its micro-step clipped it, weighted by size;
    one carried over to the next epoch has the gradient of the parameters it was fed to)."""
    clip = optax.clip_by_global_norm(1.0)
    inner = optax.lamb(1e-3)
    params = {"w": jnp.zeros(5, jnp.float32)}
    state = inner.init(params)
    grad = jax.jit(jax.grad(loss_fn))
    at = []  # the parameters of each epoch
    for epoch in range(epochs):
        at.append(params)
        parts = []
        for b in (b for b in fed if b["toward"] == epoch):
            batch = {"x": jnp.asarray(b["x"], jnp.float32), "y": jnp.asarray(b["y"], jnp.float32)}
            g, _ = clip.update(grad(at[b["epoch"]], batch), clip.init(params))
            parts.append((g["w"], len(b["x"])))
        count = sum(n for _, n in parts)
        mean = {"w": sum(g * n for g, n in parts) / count}
        updates, state = inner.update(mean, state, params)
        params = optax.apply_updates(params, updates)
    return np.asarray(params["w"])


@pytest.fixture
def bootstrap():
    """The run's first address: a collaboration that follows it and trains nothing."""
    collab = dedloc_jax.Collaboration("my-run", config=dedloc_jax.CollaborationConfig(mode="aux"))
    collab.start()
    try:
        yield [str(a) for a in collab.addrs]
    finally:
        collab.close()


def test_readme_example_two_processes_step_together(tmp_path: Path, bootstrap: list) -> None:
    epochs = 4
    outs = [tmp_path / f"peer{i}" for i in range(2)]
    procs = [_start(out, bootstrap, epochs, seed=i) for i, out in enumerate(outs)]
    for proc, out in zip(procs, outs, strict=True):
        _wait(proc, out)
    (w0, e0), (w1, e1) = _final(outs[0]), _final(outs[1])
    assert e0 == e1 == epochs
    np.testing.assert_array_equal(w0, w1)  # bit-identical
    fed = _fed(outs[0]) + _fed(outs[1])
    samples = sum(len(b["x"]) for b in fed)
    # What the protocol promises: a peer steps once its own exact count plus its estimate of
    # the others' reaches the target, so it never feeds more than the target into one epoch
    # by itself; the others' samples it knows from reads 0.25 s or more apart, extrapolated
    # at their rates, and these epochs (16 micro-steps of 5 ms) are shorter than that: the
    # total per epoch lies between about the target and every peer's whole target (on a
    # loaded machine: 272-324 samples for 4 epochs; 308-452 before the rates were measured
    # over short epochs too). Epoch 0 is the start-up: a peer that has not yet read who else
    # trains keeps accumulating rather than step alone (192 samples seen there under load).
    for epoch in range(1, epochs):
        for out in outs:
            mine = sum(len(b["x"]) for b in _fed(out) if b["toward"] == epoch)
            assert mine <= TARGET, (epoch, out.name, mine)
    later = sum(len(b["x"]) for b in fed if b["toward"] > 0)
    assert (epochs - 1) * TARGET <= samples and later <= len(outs) * (epochs - 1) * TARGET
    for out in outs:  # every step averaged with the other peer
        assert [(h["group_size"], h["complete"]) for h in _history(out)] == [(2, True)] * epochs
    np.testing.assert_allclose(w0, _single_process(fed, epochs), rtol=0, atol=1e-6)


def _wait_for(out: Path, until: Callable[[list[dict]], bool], what: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        fed = _fed(out) if (out / "fed.jsonl").exists() else []
        if fed and until(fed):
            return
        time.sleep(0.1)
    pytest.fail(what)


@pytest.mark.slow
def test_a_late_joiner_and_a_restarted_peer_catch_up(tmp_path: Path, bootstrap: list) -> None:
    """A third peer starts after epoch 3; then another is SIGKILLed and restarted: each
    loads the run's state at its first keep_in_step, averages with the others afterwards, and
    all end bit-identical."""
    epochs = 40
    a, b, c = (tmp_path / n for n in ("a", "b", "c"))
    pace = {"README_PEER_PACE": "0.02"}  # so that the run outlasts the newcomers' start-up
    pa, pb = (_start(out, bootstrap, epochs, seed=i, env=pace) for i, out in enumerate((a, b)))
    _wait_for(a, lambda fed: fed[-1]["epoch"] >= 3, "the first two peers did not reach epoch 3")
    pc = _start(c, bootstrap, epochs, seed=2, env=pace)
    _wait_for(c, lambda fed: fed[-1]["epoch"] > 3, "the newcomer did not load the run's state")
    pb.send_signal(signal.SIGKILL)
    pb.wait()
    killed_at = _fed(b)[-1]["epoch"]
    pb = _start(b, bootstrap, epochs, seed=3, env=pace)
    for proc, out in ((pa, a), (pb, b), (pc, c)):
        _wait(proc, out)
    finals = [_final(out) for out in (a, b, c)]
    assert {e for _, e in finals} == {epochs}
    for w, _ in finals[1:]:
        np.testing.assert_array_equal(w, finals[0][0])
    # Each newcomer went on from the run's epoch (not from 0) and then averaged with others.
    restarted = _fed(b)[len([f for f in _fed(b) if f["epoch"] <= killed_at]) :]
    assert restarted and min(f["epoch"] for f in restarted) >= killed_at
    for out in (b, c):
        assert any(h["group_size"] >= 2 and h["complete"] for h in _history(out)), out


def test_the_readmes_placeholder_address_is_one_clear_error() -> None:
    """A user who runs the block before replacing its placeholder got an 81-line trio
    ExceptionGroup from start(); the constructor now raises one ValueError naming the address
    and what is wrong with it, before any task starts."""
    from tests.readme_peer import PLACEHOLDER

    (address,) = json.loads(PLACEHOLDER)
    with pytest.raises(ValueError, match=r"initial peer '/ip4/1\.2\.3\.4/.*/p2p/\.\.\.'.*peer ID"):
        dedloc_jax.Collaboration("my-run", initial_peers=[address])
    with pytest.raises(ValueError, match="initial peer 'localhost:31337'"):
        dedloc_jax.Collaboration("my-run", initial_peers=["localhost:31337"])


def test_the_readmes_first_peer_prints_the_address_others_join_with(capsys) -> None:
    """The block told a new user to pass "one a peer of the run printed", but nothing printed
    one: the run's first peer (initial_peers=[]) ran silently. The block prints
    ``collab.addrs``; each printed address is a multiaddr with this peer's ID."""
    from p2p.multiaddr import Multiaddr
    from tests.readme_peer import PLACEHOLDER, example

    namespace = {"params": {"w": jnp.zeros(5)}, "loss_fn": loss_fn, "batches": []}
    exec(compile(example("own").replace(PLACEHOLDER, "[]"), "README.md", "exec"), namespace)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("others join with:")]
    assert len(lines) == 1, lines
    printed = lines[0].split()[3:]
    me = str(namespace["collab"].core.node.peer_id)
    assert printed and all(str(Multiaddr.parse(a)).endswith(f"/p2p/{me}") for a in printed)


def test_an_initial_peer_that_is_gone_is_one_clear_error() -> None:
    """The block's second process started after the first had finished (a toy loop ends in
    seconds): start() raised a 60-line trio ExceptionGroup around the one error that says
    what happened. It raises that error, a BootstrapError naming the address."""
    from p2p.dht import BootstrapError
    from p2p.identity import Identity

    gone = f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.generate().peer_id}"
    with pytest.raises(BootstrapError, match=r"none of the 1 initial peers answered: /ip4/127"):
        dedloc_jax.Collaboration("my-run", initial_peers=[gone]).start()
