"""One trainer process of ``bench.chaos``: a small MLP trained with ``dedloc_jax.collaborative``.

Started (and killed with SIGKILL, and started again) by :mod:`bench.chaos`. It uses only the
public API: :class:`dedloc_jax.Collaboration`, :func:`dedloc_jax.collaborative` and
:func:`dedloc_jax.keep_in_step` after every micro-step. Everything it does is appended,
one flushed JSON line per event, to ``DIR/peerN.jsonl`` (all incarnations of peer N share it):

- ``phase``: ``loading`` (state download), ``accumulating`` or ``averaging`` (matchmaking and
  all-reduce), so the driver can kill it at a chosen moment and classify each kill afterwards;
- ``beat``: a heartbeat while accumulating (the driver's hang detector);
- ``epoch``: after every collaboration step or state load, the SHA-256 of the parameters, how
  the epoch was reached (``group`` > 1: averaged with others; ``load``: the collaboration's
  state was loaded), the loss and whether everything is finite.

Keeping in step is the library's policy (:func:`dedloc_jax.keep_in_step`): a restarted peer
loads the run's state at its first call; after a step alone while others train, a lost fork
check, or when the run is ahead, it loads the others' state.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

# Imported here (not in run) so that bench.chaos's fork server holds them already: a restarted
# peer then pays no import, only its own start.
import jax
import jax.numpy as jnp
import numpy as np
import optax

import dedloc_jax
from dedloc_jax import (
    Collaboration,
    CollaborationConfig,
    KeepConfig,
    ReachabilityConfig,
    collaborative,
)
from p2p.identity import Identity

MICRO = 16
DIM, HIDDEN = 64, 1024  # ~70k parameters: cheap steps, a state download that takes a moment


class EventLog:
    """Appends one JSON object per line to this peer's event file, flushed at once."""

    def __init__(self, path: Path, index: int) -> None:
        self.f = path.open("a", buffering=1)
        self.index = index
        self.pid = os.getpid()
        self.last_beat = 0.0

    def write(self, ev: str, **fields: Any) -> None:
        row = {"t": time.time(), "pid": self.pid, "peer": self.index, "ev": ev, **fields}
        self.f.write(json.dumps(row) + "\n")

    def phase(self, name: str, **fields: Any) -> None:
        self.write("phase", phase=name, **fields)

    def beat(self, epoch: int) -> None:
        now = time.monotonic()
        if now - self.last_beat >= 0.5:
            self.last_beat = now
            self.write("beat", epoch=epoch)


class PhaseHost:
    """The collaboration as seen by ``collaborative``, marking the averaging and loading phases."""

    def __init__(self, collab: Any, log: EventLog) -> None:
        self.collab = collab
        self.log = log

    def report_progress(self, epoch: int, samples: int, batch_size: int) -> bool:
        return self.collab.report_progress(epoch, samples, batch_size)

    def average_gradients(self, epoch: int, gradients: Any, samples: int) -> Any:
        self.log.phase("averaging", epoch=epoch)
        try:
            return self.collab.average_gradients(epoch, gradients, samples)
        finally:
            self.log.phase("accumulating", epoch=epoch + 1)

    def load_state(
        self, *, timeout: float = 60.0, min_epoch: int | None = None
    ) -> tuple[int, list[Any]]:
        self.log.phase("loading")
        return self.collab.load_state(timeout=timeout, min_epoch=min_epoch)

    def share_state(self, arrays: list[Any], epoch: int) -> None:
        self.collab.share_state(arrays, epoch)

    # what keep_in_step reads besides loading and serving: the collaboration's
    @property
    def keeper(self) -> Any:
        return self.collab.keeper

    def step_view(self) -> Any:
        return self.collab.step_view()

    def fork_verdict(self) -> bool | None:
        return self.collab.fork_verdict()

    def newest_state_epoch(self) -> int | None:
        return self.collab.newest_state_epoch()


def params_digest(params: Any) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(params)):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()[:16]


def _finite(tree: Any) -> bool:
    return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(tree))


def run(args: argparse.Namespace) -> int:
    cache = Path(os.environ.get("DEDLOC_JAX_CACHE", "~/.cache/dedloc-jax")).expanduser()
    (cache / "chaos-jax-cache").mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache / "chaos-jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    out = Path(args.dir)
    log = EventLog(out / f"peer{args.index}.jsonl", args.index)
    config = CollaborationConfig.local_demo(args.target)
    config = config.replace(
        rounds=config.rounds.replace(
            matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout
        ),
        reachability=ReachabilityConfig(detect=False),
    )
    initial = json.loads((out / "addrs.json").read_text()) if args.index else []
    identity = Identity.load_or_create(out / f"peer{args.index}.key")
    keep = KeepConfig(load_timeout=args.load_timeout)
    collab = Collaboration(
        "chaos", initial_peers=initial, identity=identity, config=config, keep=keep
    )
    collab.start()
    host = PhaseHost(collab, log)
    if args.index == 0:
        tmp = out / "addrs.json.tmp"
        tmp.write_text(json.dumps([f"{a}/p2p/{collab.peer_id}" for a in collab.addrs]))
        os.replace(tmp, out / "addrs.json")
    log.write("start", peer_id=collab.peer_id)

    def loss_fn(p: Any, x: Any, y: Any) -> Any:
        h = jnp.tanh(x @ p["w"] + p["b"])
        return jnp.mean((h @ p["v"] + p["c"] - y) ** 2)

    init = np.random.default_rng(0)  # the same initialisation everywhere: the run's seed
    params = {
        "w": (init.normal(size=(DIM, HIDDEN)) / np.sqrt(DIM)).astype(np.float32),
        "b": np.zeros((HIDDEN,), np.float32),
        "v": np.zeros((HIDDEN,), np.float32),
        "c": np.zeros((), np.float32),
    }
    tx = collaborative(optax.adam(1e-3), host, target_batch_size=args.target)
    opt_state = tx.init(params)

    # The gradients are jitted (and cached on disk, so a restarted peer does not compile
    # again); the transform runs eagerly: jitted with its host callbacks it could not be
    # cached, and every restart would pay a compilation that takes seconds on a busy CPU.
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    apply_updates = jax.jit(optax.apply_updates)

    def step(params: Any, opt_state: Any, x: Any, y: Any) -> Any:
        loss, grads = grad_fn(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params, batch_size=MICRO)
        return apply_updates(params, updates), opt_state, loss

    teacher = np.random.default_rng(12345).normal(size=(DIM,)).astype(np.float32)
    rng = np.random.default_rng([args.index, os.getpid()])

    def keep_in_step(params: Any, opt_state: Any) -> tuple[Any, Any]:
        """:func:`dedloc_jax.keep_in_step`, with a ``load`` event for each state it loaded."""
        loads = collab.keeper.loads
        params, opt_state = dedloc_jax.keep_in_step(host, params, opt_state)
        if collab.keeper.loads != loads:
            log.write(
                "epoch",
                epoch=int(opt_state.epoch),
                how="load",
                digest=params_digest(params),
                finite=_finite(params),
            )
            log.phase("accumulating", epoch=int(opt_state.epoch))
        return params, opt_state

    params, opt_state = keep_in_step(params, opt_state)  # a restarted peer loads the run's
    log.phase("accumulating", epoch=int(opt_state.epoch))
    stop = out / "stop"
    losses: list[float] = []
    while not stop.exists():
        x = rng.normal(size=(MICRO, DIM)).astype(np.float32)
        y = np.sin(x @ teacher).astype(np.float32)
        before = int(opt_state.epoch)
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
        epoch = int(opt_state.epoch)
        log.beat(epoch)
        if epoch != before:
            log.write(
                "epoch",
                epoch=epoch,
                how="step",
                group=int(opt_state.group_size),
                digest=params_digest(params),
                loss=float(np.mean(losses)),
                finite=_finite(params) and bool(np.isfinite(losses).all()),
            )
            losses = []
        params, opt_state = keep_in_step(params, opt_state)
        time.sleep(args.step_delay)
    log.write("exit", epoch=int(opt_state.epoch))
    collab.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--target", type=int, default=256)
    p.add_argument("--step-delay", type=float, default=0.03)
    p.add_argument("--matchmaking-time", type=float, default=0.5)
    p.add_argument("--averaging-timeout", type=float, default=10.0)
    p.add_argument("--load-timeout", type=float, default=15.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("dedloc_jax").setLevel(logging.INFO)  # matchmaking and state sync
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
