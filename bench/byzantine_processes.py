"""One hostile peer among four, with real processes (issue 46's "done when"):
``python -m bench.byzantine --processes``.

Each scenario is one fresh run on loopback: the coordinator of a prepared tiny sahajBERT run
(``examples.sahajbert coordinator --max-epochs 100000``, checkpointing every 5 epochs), three
honest ``examples.sahajbert trainer`` processes and a fourth trainer, the real one with an
attack patched in (:mod:`bench.byzantine_peer`). The run trains clean until every honest
trainer has stepped ``--warm`` epochs, then for ``--window`` seconds (its clean rate); then
the driver turns the attack on and watches for ``--window`` seconds more. Scenarios ``none``
(four honest trainers) and ``undefended`` (the same, whose every peer, the coordinator
included, turns robust aggregation and verified rounds off from one epoch on: its
``rate_vs_before`` is the undefended rate over the defended one in one run) are the
baselines.

One row per scenario: ``epochs`` (the honest trainers' mean number of steps in the window
after the attack), ``rate_vs_before`` (their epoch rate after it over the same run's before it:
the machine's load, shared with others, moves between runs) and ``rate_vs_clean`` (over the
``none`` run's after its go), ``loss`` (the honest trainers' mean training loss
over the last three epochs every run reached) and ``loss_vs_clean``, ``coordinator_up`` (still
running at the end, and the epoch its status shows), ``banned`` / ``rounds_to_ban`` (honest
trainers' epochs from the attack to the first honest trainer's ban of the hostile peer),
``detected`` (a node refused the attacker's record, an honest trainer logged it as ignored or
bounded, or banned it), ``finite`` and ``in_step`` (the honest trainers' digests at the last
epoch they all reached). The last line is one JSON object.

``--recipe readme`` runs the README's one-machine try instead of the bench's shorter epochs
(:data:`RECIPES`): the clean run's speed cost at the shortest epochs a user runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.byzantine_peer import PROGRESS
from dedloc_jax.averaging.config import AllReduceConfig

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = "chaos-sahajbert"  # bench.chaos's prepared tiny run (and compilation cache)
TARGET = 64
MICRO = 8
# What the trainers run. "bench": the attack table's, short epochs (~0.5 s on 2 cores) so that
# a 40 s window holds dozens. "readme": the README's one-machine try (its `prepare` flags, the
# volunteers' default batch), the smallest run a user starts: the clean cost is a fixed CPU
# time a round, so its share depends on the epoch's length, and this is the shortest real one.
RECIPES = {
    "bench": {"target": TARGET, "prepare": ["--seq-length", "32", "--learning-rate", "0.01",
                                            "--warmup-steps", "1"], "micro": MICRO},
    "readme": {"target": 96, "prepare": ["--seq-length", "64", "--learning-rate", "0.03",
                                         "--warmup-steps", "2", "--total-steps", "1000"],
               "micro": None},
}  # fmt: skip
HONEST = 3
PERIOD = 2  # undefended: epochs with the defences off, then on, and so on (short spans: the
# machine's load moves within seconds, and each on span is set against its neighbours)
COST_WINDOW = 120.0  # s the undefended run watches at least (its pairs: the clean cost)
FIT_FROM = 20  # the first epoch of a loss curve's fit (the first ones fall steeply)
SCENARIOS = (
    "none",
    "undefended",
    "hijack_epoch",
    "lying_reducer",
    "sign_flip",
    "claim_samples",
    "junk_state_offer",
    "keep_leading",
    "lying_config",
)
# What an honest trainer logs when it ignores or bounds the attacker's word.
DETECTED_BY = {
    "hijack_epoch": "ignoring peer",
    "keep_leading": "ignoring peer",
    "claim_samples": "ignoring peer",
    "junk_state_offer": "invalid record",
    "lying_config": "bounded by the group's medians",
}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}


def prepared_run(recipe: str = "bench") -> Path:
    """The tiny run of ``recipe`` (:data:`RECIPES`; "bench" is bench.chaos's), prepared here if
    missing, and its compilation cache."""
    from bench.chaos import prepared_dir
    from models.text.corpus import write_corpus

    spec = RECIPES[recipe]
    prepared = prepared_dir(spec["target"])
    if recipe != "bench":
        prepared = prepared.with_name(f"{prepared.name}-{recipe}")
    if not (prepared / "run" / "manifest.json").is_file():
        prepared.mkdir(parents=True, exist_ok=True)
        write_corpus(prepared / "text.txt", 300, seed=0)
        cmd = [sys.executable, "-m", "examples.sahajbert", "prepare", "--run-id", RUN_ID,
               "--config", "tiny", "--target-batch-size", str(spec["target"]), *spec["prepare"],
               "--data", str(prepared / "text.txt"), "--out", str(prepared / "run"),
               "--work-dir", str(prepared / "organiser")]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, env=_env(), check=True, capture_output=True)
    return prepared / "run"


class Scenario:
    """One run: a coordinator, three honest trainers and one patched with ``attack``."""

    def __init__(self, attack: str, out: Path, manifest: Path, micro: int | None = MICRO) -> None:
        self.attack = attack
        self.micro = micro
        self.out = out
        self.manifest = manifest
        self.go = out / "go"
        self.procs: dict[str, subprocess.Popen] = {}
        out.mkdir(parents=True, exist_ok=True)

    def _spawn(self, name: str, role_args: list[str], patch: str | None) -> None:
        cmd = [sys.executable, "-m"]
        if patch is None:
            cmd += ["examples.sahajbert"]
        else:
            cmd += ["bench.byzantine_peer", patch, str(self.go), str(self.out / name), "--"]
        cmd = ["nice", "-n", "10", *cmd, *role_args]
        with (self.out / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT
            )

    def _work(self, name: str) -> Path:
        from bench.chaos import _shared_cache

        work = self.out / name
        work.mkdir(parents=True, exist_ok=True)
        cache = work / "jax-cache"
        if not cache.exists():
            cache.symlink_to(_shared_cache(), target_is_directory=True)
        return work

    def start(self, deadline: float) -> None:
        undefended = "undefended" if self.attack == "undefended" else None
        addr_file = self.out / "addrs.json"
        coord = ["coordinator", "--run-id", RUN_ID, "--manifest", str(self.manifest),
                 "--out", str(self.out / "coordinator-out"), "--work-dir",
                 str(self._work("coordinator")), "--addr-file", str(addr_file),
                 "--checkpoint-every", "5", "--max-epochs", "100000",
                 "--listen", "/ip4/127.0.0.1/tcp/0"]  # fmt: skip
        self._spawn("coordinator", coord, undefended)
        while not addr_file.exists():
            if time.monotonic() > deadline or self.procs["coordinator"].poll() is not None:
                raise RuntimeError(f"the coordinator did not start: {self.out}/coordinator.log")
            time.sleep(0.5)
        addr = json.loads(addr_file.read_text())[0]
        for i in range(HONEST + 1):
            name = f"trainer{i}"
            args = ["trainer", "--run-id", RUN_ID, "--initial-peers", addr,
                    "--work-dir", str(self._work(name)),
                    "--identity", str(self.out / f"{name}.key"),
                    "--events", str(self.out / f"{name}.jsonl"),
                    "--listen", "/ip4/127.0.0.1/tcp/0"]  # fmt: skip
            if self.micro is not None:
                args += ["--per-device-batch-size", str(self.micro)]
            honest = undefended or "none"
            patch = honest if i < HONEST or self.attack == "none" else self.attack
            self._spawn(name, args, patch)

    def steps(self, i: int) -> list[dict]:
        path = self.out / f"trainer{i}.jsonl"
        rows = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("ev") == "epoch" and row.get("how") == "step":
                    rows.append(row)
        return rows

    def compiled(self) -> bool:
        """Whether every trainer is past compiling its step (its events say it accumulates)."""
        for i in range(HONEST + 1):
            path = self.out / f"trainer{i}.jsonl"
            text = path.read_text() if path.exists() else ""
            if '"phase": "accumulating"' not in text:
                return False
        return True

    def honest_epoch(self) -> int:
        """The epoch every honest trainer has stepped to (0 when one has not stepped)."""
        return min(max((r["epoch"] for r in self.steps(i)), default=0) for i in range(HONEST))

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + 20
        for p in self.procs.values():
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _peer_id(log: Path) -> str | None:
    m = re.search(r"peer (\S+) reachable at", log.read_text(errors="replace"))
    return m.group(1) if m else None


def _noted(prefix: Path, needle: str) -> list[float]:
    """Times of the records holding ``needle`` that a trainer noted (bench.byzantine_peer)."""
    path = Path(f"{prefix}.notes.jsonl")
    out = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if needle in row["message"]:
            out.append(row["t"])
    return out


def run_scenario(
    attack: str, out: Path, manifest: Path, warm: int, window: float, micro: int | None = MICRO
) -> dict:
    sc = Scenario(attack, out, manifest, micro)
    t_start = time.monotonic()
    try:
        sc.start(t_start + 300)
        # Warm-up is timed from when every trainer has compiled its step: four compiling at
        # once took 123 s on an idle machine and over 6 min at a load of 14 (on 2 cores), and
        # a fixed 420 s from the start then failed the undefended scenario with no step made.
        compiled = None
        while sc.honest_epoch() < warm:
            dead = [n for n, p in sc.procs.items() if p.poll() is not None]
            now = time.monotonic()
            if compiled is None and sc.compiled():
                compiled = now
            late = now > t_start + 1200 if compiled is None else now > compiled + 300
            if dead or late:
                raise RuntimeError(f"{attack}: no warm run ({dead or 'timeout'}); see {out}")
            time.sleep(1.0)
        t_pre = time.time()  # the run's own clean rate first, over as long a window
        end = time.monotonic() + window
        while time.monotonic() < end:
            time.sleep(1.0)
        if attack == "undefended":  # every peer switches at the same epochs, the driver's
            switch = sc.honest_epoch() + 2
            sc.go.write_text(f"{switch} {PERIOD}")
            while sc.honest_epoch() < switch and time.monotonic() < end + 120:
                time.sleep(0.2)
        else:
            sc.go.touch()
        t_go = time.time()
        end = time.monotonic() + window
        while time.monotonic() < end:
            time.sleep(1.0)
        t_end = time.time()
        coordinator_up = sc.procs["coordinator"].poll() is None
        status_path = out / "coordinator-out" / "status.json"
        status = json.loads(status_path.read_text()) if status_path.exists() else {}
    finally:
        sc.stop()
    steps = [sc.steps(i) for i in range(HONEST)]
    in_window = [[r for r in s if t_go <= r["t"] < t_end] for s in steps]
    before = [[r for r in s if t_pre <= r["t"] < t_go] for s in steps]
    losses: dict[int, list[float]] = {}
    for s in steps:
        for r in s:
            losses.setdefault(r["epoch"], []).append(float(r.get("loss", float("nan"))))
    common = min(max((r["epoch"] for r in s), default=0) for s in steps)
    digests = {s_i[-1]["digest"] for s_i in ([r for r in s if r["epoch"] == common] for s in steps)
               if s_i}  # fmt: skip
    hostile = _peer_id(out / f"trainer{HONEST}.log")
    ban_times = []
    for i in range(HONEST):
        ban_times += _noted(out / f"trainer{i}", f"banning {hostile}") if hostile else []
    first_ban = min((t for t in ban_times if t >= t_go), default=None)
    rounds_to_ban = None
    if first_ban is not None:
        rounds_to_ban = 1 + sum(t_go <= r["t"] < first_ban for r in steps[0])
    detected_at = [first_ban] if first_ban is not None else []
    report = out / f"trainer{HONEST}.attack.json"
    mounted = json.loads(report.read_text()) if report.exists() else {}
    refused = bool(mounted.get("refused"))
    if refused:  # a node refused the record as it was stored
        detected_at.append(mounted.get("mounted_at", mounted["at"]))
    needle = DETECTED_BY.get(attack)
    if attack == "lying_config" and hostile:  # honest peers' links are bounded too, at times
        needle = f"member {hostile[:8]} claims"
    if needle == "ignoring peer" and mounted.get("peer"):  # the attacker's records, not a
        needle = f"ignoring peer {mounted['peer']}"  # mate's whose record landed first
    for i in range(HONEST) if needle else ():
        detected_at += [t for t in _noted(out / f"trainer{i}", needle) if t >= t_go]
    row: dict[str, Any] = {}
    if attack == "undefended":
        more = [sc.steps(i) for i in range(1, HONEST + 1)]  # every trainer is honest here
        row["defences_cost"] = _alternating(steps[0], switch, more)
    return {
        **row,
        "attack": attack,
        "epoch_at_attack": warm,
        "epochs_before": round(sum(len(w) for w in before) / HONEST, 2),
        "epochs": round(sum(len(w) for w in in_window) / HONEST, 2),
        "rate_vs_before": round(
            (sum(map(len, in_window)) / (t_end - t_go))
            / max(1e-9, sum(map(len, before)) / (t_go - t_pre)),
            3,
        ),
        "window_s": round(t_end - t_go, 1),
        "losses": {e: sum(v) / len(v) for e, v in sorted(losses.items())},
        "last_epoch": common,
        "finite": all(r.get("finite", False) for s in steps for r in s),
        "in_step": len(digests) == 1,
        "coordinator_up": coordinator_up,
        "coordinator_epoch": (status.get("estimate") or {}).get("epoch"),
        "checkpoint_epoch": status.get("checkpoint_epoch"),
        "banned": first_ban is not None,
        "rounds_to_ban": rounds_to_ban,
        "refused_by_nodes": refused,
        "detected": refused or bool(detected_at),
        "rounds_to_detection": None
        if not detected_at
        else 1 + sum(t_go <= r["t"] < min(detected_at) for r in steps[0]),
        "groups": [r.get("group") for r in steps[0] if t_go <= r["t"] < t_end],
        "wall_s": round(time.monotonic() - t_start, 1),
    }


def _alternating(steps: list[dict], first: int, others: list[list[dict]] = ()) -> dict:
    """The defences' cost side by side: spans of PERIOD epochs from ``first`` alternate off
    (first) and on; an epoch's time is from the step before it to its own, and only epochs
    averaged by the whole group count (a round missing a member is another round's cost).
    Each on span against the median of its off neighbours (before and after, which cancels a
    drift of the machine's load) gives one ratio: ``time_ratio`` is their median,
    ``time_ratio_spread`` their min and max, ``time_ratio_iqr`` their quartiles,
    ``time_ratio_pairs`` how many; ``time_ratio_of_means`` is the mean on over the mean off,
    the figure before. ``cpu_ratio`` (and its ``_spread``, ``_iqr``) is the same of the CPU
    an epoch costs ``steps``' trainer and ``others`` together (their events' ``cpu``): the
    load moves wall time by tens of percent from epoch to epoch, CPU time far less."""
    at = {r["epoch"]: (r["t"], r.get("group")) for r in steps}
    cpus = [{r["epoch"]: r["cpu"] for r in s if "cpu" in r} for s in [steps, *others]]
    spans: dict[int, list[float]] = {}
    cpu_spans: dict[int, list[float]] = {}
    incomplete = 0
    for e, (t, group) in at.items():
        if e > first and e - 1 in at:
            if group != HONEST + 1:
                incomplete += 1
                continue
            # the round that stepped to epoch e averaged epoch e - 1's gradients
            span = (e - 1 - first) // PERIOD
            spans.setdefault(span, []).append(t - at[e - 1][0])
            if all(e in c and e - 1 in c for c in cpus):
                cpu_spans.setdefault(span, []).append(sum(c[e] - c[e - 1] for c in cpus))
    on = [x for s, v in spans.items() if s % 2 for x in v]
    off = [x for s, v in spans.items() if not s % 2 for x in v]
    if not on or not off:
        return {}
    out = {
        "epochs_on": len(on),
        "epochs_off": len(off),
        "epochs_incomplete": incomplete,
        "epoch_s_on": round(statistics.median(on), 4),
        "epoch_s_off": round(statistics.median(off), 4),
        **_pair_ratios("time_ratio", spans),
        "time_ratio_of_means": round((sum(on) / len(on)) / (sum(off) / len(off)), 4),
    }
    return {**out, **_pair_ratios("cpu_ratio", cpu_spans)}


def _pair_ratios(name: str, spans: dict[int, list[float]]) -> dict:
    """Each on span's (odd) median over the median of its off neighbours' medians: the
    median of these ratios as ``name``, with its spread, quartiles and count."""
    med = {s: statistics.median(v) for s, v in spans.items()}
    ratios = []
    for s in sorted(med):
        near = [med[n] for n in (s - 1, s + 1) if n in med]
        if s % 2 and near and statistics.median(near) > 0:
            ratios.append(med[s] / statistics.median(near))
    if not ratios:
        return {}
    return {
        name: round(statistics.median(ratios), 4),
        f"{name}_spread": [round(min(ratios), 4), round(max(ratios), 4)],
        f"{name}_iqr": [round(q, 4) for q in _quartiles(ratios)],
        f"{name}_ci95": [round(q, 4) for q in _median_ci(ratios)],
        f"{name}_pairs": len(ratios),
    }


def _median_ci(xs: list[float], draws: int = 2000) -> list[float]:
    """A 95% interval of the median of ``xs`` (bootstrap, fixed seed): how far the figure
    itself may be off, where the quartiles show how far one pair is."""
    import numpy as np

    rng = np.random.default_rng(0)
    meds = np.median(rng.choice(np.asarray(xs), (draws, len(xs))), axis=1)
    return [float(np.quantile(meds, 0.025)), float(np.quantile(meds, 0.975))]


def _fitted_loss(r: dict, upto: int, first: int = FIT_FROM) -> tuple[float, float]:
    """The run's mean honest loss at epoch ``upto`` read off a cubic in log epoch fitted to
    every epoch from ``first`` on (one epoch's loss is a micro-batch's: 1% sd), and that
    reading's standard error."""
    import numpy as np

    es = [e for e in sorted(r["losses"]) if first <= e <= upto]
    if len(es) < 8:
        return float("nan"), float("nan")
    x = np.log(np.asarray(es, np.float64))
    y = np.asarray([r["losses"][e] for e in es], np.float64)
    coef, cov = np.polyfit(x, y, 3, cov=True)
    at = np.log(upto) ** np.arange(3, -1, -1)
    return float(np.polyval(coef, np.log(upto))), float(np.sqrt(at @ cov @ at))


def loss_cost(defended: dict, undefended: dict) -> dict:
    """The defended run's loss over the alternating one's at their last common epoch:
    ``loss_ratio`` (three epochs' mean each, as every row's) and ``loss_ratio_fit`` (each
    curve's fit, :func:`_fitted_loss`) with its ``loss_ratio_fit_sd``. The two runs drew
    other data (each trainer's order follows its fresh identity): what is left is the draw."""
    upto = min(defended["last_epoch"], undefended["last_epoch"])
    (d, d_sd), (u, u_sd) = _fitted_loss(defended, upto), _fitted_loss(undefended, upto)
    return {
        "loss_ratio": round(_mean_loss(defended, upto) / _mean_loss(undefended, upto), 4),
        "loss_ratio_fit": round(d / u, 4),
        "loss_ratio_fit_sd": round(d / u * ((d_sd / d) ** 2 + (u_sd / u) ** 2) ** 0.5, 4),
    }


def _quartiles(xs: list[float]) -> list[float]:
    """The first and third quartiles (both the value itself for one)."""
    if len(xs) < 2:
        return [xs[0], xs[0]]
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


def _mean_loss(r: dict, upto: int) -> float:
    vals = [r["losses"][e] for e in range(upto - 2, upto + 1) if e in r["losses"]]
    return sum(vals) / len(vals) if vals else float("nan")


def rows(results: dict[str, dict]) -> list[dict]:
    clean = results.get("none")
    out = []
    for r in results.values():
        row = {k: v for k, v in r.items() if k not in ("losses", "groups")}
        if clean is not None:
            upto = min(r["last_epoch"], clean["last_epoch"])
            loss, clean_loss = _mean_loss(r, upto), _mean_loss(clean, upto)
            row["loss_at_epoch"] = upto
            row["loss"] = round(loss, 4)
            row["clean_loss"] = round(clean_loss, 4)
            row["loss_vs_clean"] = round(loss / clean_loss, 4)
            row["rate_vs_clean"] = round(
                (r["epochs"] / r["window_s"]) / (clean["epochs"] / clean["window_s"]), 3
            )
        row["group_sizes"] = sorted(set(r["groups"]))
        out.append(row)
    return out


def main(args: Any) -> None:
    recipe = getattr(args, "recipe", "bench")
    manifest = prepared_run(recipe)
    micro = RECIPES[recipe]["micro"]
    base = Path(args.out or f"/tmp/byzantine-processes-{int(time.time())}")
    wall = time.monotonic()
    load = os.getloadavg()  # the machine's, shared: the 1/5/15-minute loads at start and end
    results: dict[str, dict] = {}
    for attack in args.scenarios:
        # the clean cost's pairs are the undefended run's epochs: it watches longer
        window = max(args.window, COST_WINDOW) if attack == "undefended" else args.window
        try:
            results[attack] = run_scenario(
                attack, base / attack, manifest, args.warm, window, micro
            )
        except RuntimeError as e:
            print(f"{attack}: {e}", file=sys.stderr)
            continue
        print(f"{attack}: done in {results[attack]['wall_s']} s", file=sys.stderr, flush=True)
        # each scenario's figures as soon as it ends: a run cut short keeps what it measured
        (base / "results.json").write_text(json.dumps(results))
    table = rows(results)
    for row in table:
        print(" ".join(f"{k}={v}" for k, v in row.items()))
    overhead = None
    if "none" in results and "undefended" in results:
        d, u = results["none"], results["undefended"]
        overhead = {
            # defended / undefended epoch time, alternating within the undefended run
            **u.get("defences_cost", {}),
            # the defended run's loss over the undefended one's at the same epochs
            **loss_cost(d, u),
        }
    if "undefended" in args.scenarios and args.lockstep_epochs > 0:
        # the loss cost with nothing but the defences different (bench.byzantine_lockstep)
        from bench.byzantine_lockstep import measure

        lock = measure(args.lockstep_epochs, [0], 16, AllReduceConfig().chunk_elems)
        overhead = {**(overhead or {}), "loss_ratio_equal_samples": lock["loss_ratio"],
                    "lockstep": lock["rows"][0]}  # fmt: skip
    if overhead is not None:
        print(f"defences' cost on a clean run (defended / undefended): {overhead}")
    print(json.dumps({"processes": True, "recipe": recipe, "warm": args.warm,
                      "window_s": args.window,
                      "rows": table, "overhead": overhead, "out": str(base),
                      "load": [round(x, 2) for x in (*load, *os.getloadavg())],
                      "wall_s": round(time.monotonic() - wall, 1)}))  # fmt: skip


__all__ = ["PROGRESS", "SCENARIOS", "main", "run_scenario"]
