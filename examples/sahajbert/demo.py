"""The embedded demo: a whole sahajBERT collaboration on this machine, in separate processes.

1. Prepare the synthetic Bengali corpus and tokenizer (cached under the work directory) and
   warm JAX's compilation cache, so the peers start fast and do not all compile at once.
2. Start a coordinator process, then the trainers, each ``python -m examples.sahajbert ...``
   on loopback TCP: one in client mode (it only dials out), one deliberately slower.
3. Show the run live from the coordinator's ``status.json``: per-peer samples and throughput,
   the epoch, samples toward the target, ETA and loss.
4. At the end: a summary table, the final checkpoint, whether the peers ended bit-identical,
   and a loss plot (PNG).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from examples.sahajbert import training
from examples.sahajbert.config import DemoConfig, TrainerConfig

log = logging.getLogger(__name__)


@dataclass
class DemoResult:
    rows: list[dict[str, Any]]
    checkpoint: str | None
    final_params: list[Path]
    identical: bool
    plot: Path | None
    seconds: float
    returncodes: dict[str, int | None]


LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]  # the demo's peers all run here: nobody else reaches them


def cli_args(cfg: TrainerConfig) -> list[str]:
    """The command-line options that reproduce ``cfg`` in a child process."""
    o = cfg.optimizer
    args = [
        "--run-id", cfg.run_id or "sahajbert",
        "--config", cfg.model,
        "--target-batch-size", str(cfg.target_batch_size),
        "--per-device-batch-size", str(cfg.per_device_batch_size),
        "--grad-accumulation", str(cfg.grad_accumulation),
        "--seq-length", str(cfg.seq_length),
        "--work-dir", str(cfg.work_dir),
        "--learning-rate", repr(o.learning_rate),
        "--warmup-steps", str(o.warmup_steps),
        "--total-steps", str(o.total_steps),
    ]  # fmt: skip
    if cfg.max_epochs is not None:
        args += ["--max-epochs", str(cfg.max_epochs)]
    if cfg.data:
        args += ["--data", cfg.data]
    if cfg.tokenizer:
        args += ["--tokenizer", cfg.tokenizer]
    if cfg.bf16:
        args += ["--bf16"]
    if cfg.mode != "dedloc":
        args += ["--mode", cfg.mode, "--inner-steps", str(cfg.inner_steps)]
    if cfg.codec is not None:
        args += ["--compression", cfg.codec]
    if cfg.compression == "powersgd":
        args += ["--compression", "powersgd", "--powersgd-rank", str(cfg.powersgd_rank)]
    if cfg.compression == "topk":
        args += [
            "--compression", "topk",
            "--topk-density", repr(cfg.topk_density),
            "--topk-bits", str(cfg.topk_bits),
            "--topk-error-feedback", repr(cfg.topk_error_feedback),
        ]  # fmt: skip
    return args


WARM_UP_VERSION = 4  # bump when what warm_up compiles changes
# The code that shapes the compiled programs: an edit there warms up again.
WARM_UP_SOURCES = (
    "dedloc_jax/collaborative.py",
    "examples/sahajbert/training.py",
    "models/albert.py",
)


def warm_up(cfg: TrainerConfig) -> None:
    """Build the data cache and compile every program of a trainer's steps once, into the
    persistent cache, so that the peers load them instead of each compiling them at once.

    It runs the warm-up every trainer runs before it reports (:func:`training.warm_up_step`),
    which then loads what this one compiled.
    Skipped (without importing JAX) when a marker says this configuration was warmed before.
    """
    import hashlib
    from importlib.metadata import version

    shape = [a for a in cli_args(cfg.replace(run_id="", max_epochs=None)) if a]
    root = Path(__file__).resolve().parents[2]
    sources = [root / f for f in WARM_UP_SOURCES if (root / f).is_file()]
    code = hashlib.sha256(b"".join(f.read_bytes() for f in sources)).hexdigest()
    key = [shape, version("jax"), WARM_UP_VERSION, code]
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    marker = cfg.work_dir / "jax-cache" / f"warm-{digest}"
    if marker.is_file():
        return
    import jax

    training.enable_compilation_cache(cfg.work_dir / "jax-cache")
    tokenizer, corpus = training.prepare_data(cfg)
    model_cfg = training.model_config(cfg.model, len(tokenizer), cfg.seq_length, cfg.bf16)
    graphdef, params, rest = training.build_model(model_cfg, seed=cfg.seed)
    micro = cfg.per_device_batch_size * jax.local_device_count() * cfg.grad_accumulation
    grad_step = training.make_grad_step(graphdef, rest)
    batch = next(training.batches(cfg, corpus, len(tokenizer), 0))
    inner = training.trainer_inner(cfg, micro)
    training.warm_up_step(grad_step, inner, micro, params, batch)
    marker.write_text(json.dumps(key))


class Processes:
    """The demo's child processes, each logging to its own file; all stopped on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.args: dict[str, list[str]] = {}

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        out = (self.log_dir / f"{name}.log").open("a")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            [sys.executable, "-m", "examples.sahajbert", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        out.close()
        self.procs[name] = proc
        self.args[name] = args
        return proc

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash or a preempted machine would end it."""
        self.procs[name].kill()
        self.procs[name].wait()

    def stop(self, name: str, timeout: float = 10.0) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop_all(self) -> None:
        for name in self.procs:
            self.stop(name)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def read_status(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        if proc.poll() is not None:
            raise RuntimeError(f"the coordinator exited with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {timeout} s")
        time.sleep(0.2)


def start_run(
    demo: DemoConfig, cfg: TrainerConfig, out: Path, procs: Processes
) -> tuple[str, list[Path]]:
    """Start the coordinator and the trainers; return the coordinator's address and where
    each trainer will save its final parameters."""
    out.mkdir(parents=True, exist_ok=True)
    addr_file = out / "addrs.json"
    addr_file.unlink(missing_ok=True)
    (out / "status.json").unlink(missing_ok=True)
    base = [*cli_args(cfg), "--listen", *LOOPBACK]
    coord = procs.start(
        "coordinator",
        ["coordinator", *base, "--out", str(out), "--addr-file", str(addr_file),
         "--checkpoint-every", str(demo.checkpoint_every)],
    )  # fmt: skip
    wait_for_file(addr_file, coord, timeout=300)
    addr = json.loads(addr_file.read_text())[0]
    finals = []
    for i in range(demo.trainers):
        final = out / "final" / f"trainer{i}.npz"
        final.unlink(missing_ok=True)
        finals.append(final)
        args = ["trainer", *base, "--initial-peers", addr, "--save-final", str(final)]
        args += ["--wait-for-trainers", str(demo.trainers - 1)]
        if i >= demo.trainers - demo.client_trainers:
            args.append("--client-mode")
        if i == 1 or demo.trainers == 1:
            args += ["--step-delay", str(demo.slow_step_delay)]
        procs.start(f"trainer{i}", args)
    return addr, finals


def render(status: dict[str, Any] | None, started: float, demo: DemoConfig) -> Any:
    """The live view (a rich renderable)."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    elapsed = time.monotonic() - started
    if not status:
        return Panel(f"starting the coordinator and peers... {elapsed:.0f} s")
    est = status.get("estimate", {})
    rows = status.get("rows", [])
    loss = rows[-1]["loss"] if rows else None
    eta = est.get("eta")
    head = (
        f"epoch [b]{est.get('epoch', 0)}[/b] of {demo.epochs}   "
        f"samples {est.get('samples') or 0:.0f} / {status.get('target_batch_size')}   "
        f"{est.get('samples_per_second') or 0:.1f} samples/s   "
        f"ETA {'-' if eta is None else f'{eta:.1f} s'}   "
        f"loss {'-' if loss is None else f'{loss:.3f}'}   elapsed {elapsed:.0f} s"
    )
    table = Table(expand=False)
    for col in ("peer", "mode", "epoch", "samples", "samples/s", "last loss"):
        table.add_column(col, justify="left" if col in ("peer", "mode") else "right")
    for p in status.get("peers", []):
        table.add_row(
            p["peer"][:14],
            p["mode"],
            str(p["epoch"]),
            str(p["samples"]),
            f"{p['samples_per_second'] or 0:.1f}",
            "-" if p.get("loss") is None else f"{p['loss']:.3f}",
        )
    losses = [r["loss"] for r in rows if r.get("loss") is not None][-30:]
    curve = _sparkline(losses)
    return Panel(
        Group(head, table, f"loss per epoch: {curve}", f"dashboard: {status.get('dashboard')}"),
        title=f"dedloc-jax: {status.get('run_id')}",
    )


def _sparkline(values: list[float]) -> str:
    if not values:
        return "-"
    bars = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    span = hi - lo or 1.0
    return "".join(bars[min(7, int((v - lo) / span * 7.999))] for v in values)


def plot_loss(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Loss per epoch as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no loss plot")
        return None
    pts = [(r["epoch"], r["loss"]) for r in rows if r.get("loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
    ax.set_xlabel("collaboration epoch (optimizer step)")
    ax.set_ylabel("MLM + SOP loss")
    ax.set_title("sahajBERT (tiny) pretraining, local collaboration")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def params_identical(paths: list[Path]) -> bool:
    loaded = [dict(np.load(p)) for p in paths if p.is_file()]
    if len(loaded) != len(paths) or not loaded:
        return False
    first = loaded[0]
    return all(
        d.keys() == first.keys() and all(d[k].tobytes() == first[k].tobytes() for k in first)
        for d in loaded[1:]
    )


def run_collaboration(
    demo: DemoConfig,
    cfg: TrainerConfig,
    out: Path,
    *,
    live: bool = True,
    on_tick: Any = None,
) -> DemoResult:
    """Everything but the printing: start, watch, wait, collect.

    ``on_tick(procs, status)`` is called while waiting (tests use it to kill a peer).
    """
    cfg = cfg.replace(max_epochs=demo.epochs)
    if cfg.mode == "diloco":  # the outer rate decays to 0 at the demo's last outer step
        cfg = cfg.replace(
            optimizer=cfg.optimizer.replace(total_steps=demo.epochs * cfg.inner_steps)
        )
    started = time.monotonic()
    warm_up(cfg)
    if (out / "logs").is_dir():
        shutil.rmtree(out / "logs")
    with Processes(out / "logs") as procs:
        _, finals = start_run(demo, cfg, out, procs)
        deadline = started + demo.timeout

        def tick() -> Any:
            status = _status(out)
            if on_tick is not None:
                on_tick(procs, status)
            return status

        if live:
            from rich.live import Live

            with Live(render(None, started, demo), refresh_per_second=4) as view:
                _wait(procs, deadline, lambda: view.update(render(tick(), started, demo)))
        else:
            _wait(procs, deadline, tick)
        codes = {name: p.poll() for name, p in procs.procs.items()}
    jsonl = out / "metrics.jsonl"
    lines = jsonl.read_text().splitlines() if jsonl.is_file() else []
    rows = [json.loads(line) for line in lines if line]
    status = read_status(out / "status.json") or {}
    return DemoResult(
        rows=rows,
        checkpoint=status.get("checkpoint"),
        final_params=finals,
        identical=params_identical(finals),
        plot=plot_loss(rows, out / "loss.png") if rows else None,
        seconds=time.monotonic() - started,
        returncodes=codes,
    )


def _status(out: Path) -> dict[str, Any] | None:
    return read_status(out / "status.json")


def _wait(procs: Processes, deadline: float, tick: Any) -> None:
    while any(p.poll() is None for p in procs.procs.values()):
        if time.monotonic() > deadline:
            log.error("the demo ran out of time; stopping the peers")
            return
        tick()
        time.sleep(0.25)
    tick()


def run_demo(demo: DemoConfig, cfg: TrainerConfig, out: Path) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"[b]dedloc-jax sahajBERT demo[/b]: a coordinator and {demo.trainers} trainers "
        f"({demo.client_trainers} in client mode, one slower) train a tiny ALBERT for "
        f"{demo.epochs} collaborative steps, each toward a target of "
        f"{cfg.collaboration_target} samples from all trainers, on loopback"
        f"{' (DiLoCo: local steps, averaged outer steps)' if cfg.mode == 'diloco' else ''}.\n"
        f"Preparing data and compiling (cached in {cfg.work_dir}); logs in {out / 'logs'}"
    )
    result = run_collaboration(demo, cfg, out)
    table = Table(title="per-epoch summary (coordinator's metrics.jsonl)")
    for col in ("epoch", "loss", "samples", "peers", "seconds", "samples/s"):
        table.add_column(col, justify="right")
    shown = result.rows if len(result.rows) <= 12 else result.rows[:5] + result.rows[-6:]
    for r in shown:
        loss = "-" if r.get("loss") is None else f"{r['loss']:.4f}"
        table.add_row(
            str(r["epoch"]),
            loss,
            str(r["samples"]),
            str(r["peers"]),
            f"{r['seconds']:.2f}",
            f"{r['samples_per_second']:.1f}",
        )
    console.print(table)
    losses = [r["loss"] for r in result.rows if r.get("loss") is not None]
    if losses:
        first = float(np.mean(losses[:3]))
        last = float(np.mean(losses[-3:]))
        console.print(f"loss: {first:.4f} (first epochs) -> {last:.4f} (last epochs)")
    console.print(f"final checkpoint: {result.checkpoint}")
    console.print(f"peers' final parameters bit-identical: {result.identical}")
    console.print(f"loss plot: {result.plot}")
    console.print(f"metrics: {out / 'metrics.jsonl'}, {out / 'metrics.csv'}")
    console.print(f"wall time: {result.seconds:.1f} s")
    failed = {k: v for k, v in result.returncodes.items() if v != 0}
    if failed:
        console.print(f"[red]processes that failed: {failed} (see {out / 'logs'})[/red]")
    ok = not failed and result.identical and bool(losses) and math.isfinite(losses[-1])
    return 0 if ok else 1
