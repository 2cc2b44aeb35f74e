"""The defences' loss cost on an honest run with nothing else different (issue 46: "a clean run
loses at most 1% of its final loss"): ``python -m bench.byzantine_lockstep``.

Four in-process peers train ``bench.byzantine --processes``' tiny sahajBERT run (its prepared
manifest: model, data, optimizer, target 64, micro-batches of 8) in lockstep, each on its own
data stream, through the real ``collaborative`` transform; every averaging hands all four
gradient vectors to one aggregation rule, twice from the same start with the same streams:

- ``plain``: the weighted mean (what a round without the defences computes);
- ``defended``: the reducers' rule of an open run (:func:`dedloc_jax.averaging.verify.
  recompute`, the rule every member recomputes a caught share by: capped weights, parts over
  ``OUTLIER`` derived radii weighing nothing, CenteredClip at the derived radius), chunk by
  chunk as a round splits the vector (four equal shares, ``AllReduceConfig.chunk_elems``).

The runs differ in the rule alone: the same samples, batches, dropout seeds and epochs; no
timing, grouping or data order enters, so the figure has no noise for a seed (a rerun gives
the same bits) and ``--seeds`` shows how it moves with the data drawn. Per seed: held-out
loss (``--held-out`` batches no peer trains on) of both, ``loss_ratio`` (defended / plain),
``clipped_chunks`` (chunks whose result differs from the mean), ``zeroed_parts`` (parts
weighed 0) and ``max_rel_change`` (the largest ``|defended - mean| / |mean|`` of one round's
vector). The last line is one JSON object.

    python -m bench.byzantine_lockstep [--epochs 150] [--seeds 0 1 2] [--held-out 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

PEERS = 4
RULES = ("plain", "defended")


class Rule:
    """One aggregation rule over the peers' flat vectors, chunk by chunk, with its counts."""

    def __init__(self, name: str, chunk: int) -> None:
        from dedloc_jax.averaging.partition import chunk_bounds, share_bounds

        self.name, self.chunk = name, chunk
        self._shares, self._chunks = share_bounds, chunk_bounds
        self.chunks = self.clipped = self.zeroed = 0
        self.max_rel_change = 0.0

    def __call__(self, parts: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
        from dedloc_jax.averaging.robust import cap_weights
        from dedloc_jax.averaging.verify import part_norm, recompute, robust_weights

        size = parts[0].size
        out = np.empty(size, np.float32)
        mean = np.empty(size, np.float32)
        bounds = self._shares(size, [1] * len(parts))
        defended = self.name == "defended"
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            for a, b in self._chunks(hi - lo, self.chunk):
                xs = [p[lo + a : lo + b] for p in parts]
                norms = [part_norm(x) for x in xs]
                plain, _ = recompute(xs, weights, norms, False, None, 1)
                mean[lo + a : lo + b] = plain
                if not defended:
                    out[lo + a : lo + b] = plain
                    continue
                got, _ = recompute(xs, weights, norms, True, None, 50)
                out[lo + a : lo + b] = got
                self.chunks += 1
                self.clipped += not np.array_equal(got, plain)
                kept = robust_weights(weights, norms, None)
                self.zeroed += int(np.sum((kept == 0) & (cap_weights(weights) > 0)))
        if defended:
            change = float(np.linalg.norm(out - mean) / max(np.linalg.norm(mean), 1e-30))
            self.max_rel_change = max(self.max_rel_change, change)
        return out


class Group:
    """``PEERS`` peers in lockstep: a micro-step each, then all report; an averaging hands
    every peer the same aggregate of all four by ``rule``."""

    def __init__(self, target: int, rule: Rule) -> None:
        self.target, self.rule = target, rule
        self.barrier = threading.Barrier(PEERS)
        self.samples = [0] * PEERS
        self.sent: list[Any] = [None] * PEERS
        self.result: list[np.ndarray] = []
        self.rounds = 0

    def report(self, i: int, samples: int) -> bool:
        self.samples[i] = samples
        self.barrier.wait()
        ready = sum(self.samples) >= self.target
        self.barrier.wait()
        return ready

    def average(self, i: int, gradients: Sequence[np.ndarray], samples: int) -> list[np.ndarray]:
        flat = np.concatenate([np.asarray(g, np.float32).reshape(-1) for g in gradients])
        self.sent[i] = (flat, float(samples))
        self.barrier.wait()
        if i == 0:
            vec = self.rule([v for v, _ in self.sent], [w for _, w in self.sent])
            self.result = [vec]
            self.rounds += 1
        self.barrier.wait()
        vec, out, at = self.result[0], [], 0
        for g in gradients:
            n = int(np.size(g))
            out.append(vec[at : at + n].reshape(np.shape(g)).copy())
            at += n
        self.barrier.wait()  # every peer has its copy before the next round overwrites it
        return out


class Peer:
    """One peer's :class:`dedloc_jax.host.CollaborationHost` face of the group."""

    def __init__(self, group: Group, index: int) -> None:
        self.group, self.index = group, index

    def report_progress(self, epoch: int, samples: int, batch_size: int) -> bool:
        return self.group.report(self.index, samples)

    def average_gradients(self, epoch: int, gradients: Sequence[np.ndarray], samples: int, **_):
        from dedloc_jax.history import RoundOutcome

        average = self.group.average(self.index, gradients, samples)
        return RoundOutcome(epoch, PEERS, average=average)


def setup(held_out_batches: int) -> dict[str, Any]:
    """The prepared run's config, corpus, initial model and held-out batches."""
    from bench.byzantine_processes import prepared_run
    from bench.diloco_quality import prepare
    from examples.sahajbert import manifest as run_manifest
    from examples.sahajbert.config import TrainerConfig

    man, tok_dir = run_manifest.load(prepared_run())
    work = Path("/tmp/byzantine-lockstep")
    base = TrainerConfig(per_device_batch_size=8, work_dir=work)
    cfg = run_manifest.apply(man, base, tok_dir)
    corpus, vocab, model, held = prepare(cfg, held_out_batches)
    return {"cfg": cfg, "corpus": corpus, "vocab": vocab, "model": model, "held_out": held}


def train(env: dict[str, Any], rule: Rule, seed: int, epochs: int) -> dict[str, Any]:
    """One run of ``epochs`` averagings under ``rule``; peer ``i`` reads stream
    ``1000 * seed + i``."""
    import jax
    import optax
    from flax import nnx

    import dedloc_jax
    from examples.sahajbert import training
    from models.albert import pretraining_batch_loss

    cfg = env["cfg"]
    graphdef, params0, rest = env["model"]
    group = Group(cfg.target_batch_size, rule)
    grad_step = training.make_grad_step(graphdef, rest)
    inner = training.jitted_inner(cfg.optimizer)
    apply_updates = jax.jit(optax.apply_updates)
    finals: list[Any] = [None] * PEERS
    train_loss: list[list[float]] = [[] for _ in range(PEERS)]
    errors: list[BaseException] = []
    micro = cfg.per_device_batch_size

    def run(i: int) -> None:
        try:
            tx = dedloc_jax.collaborative(
                inner, Peer(group, i), target_batch_size=cfg.target_batch_size
            )
            params = jax.tree.map(lambda x: x.copy(), params0)
            state = tx.init(params)
            data = training.batches(cfg, env["corpus"], env["vocab"], 1000 * seed + i)
            while int(state.epoch) < epochs:
                grads, loss = grad_step(params, next(data))
                updates, state = tx.update(grads, state, params, batch_size=micro)
                params = apply_updates(params, updates)
                train_loss[i].append(float(loss))
            finals[i] = params
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(PEERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]

    @jax.jit
    def evaluate(params: Any, batch: dict) -> Any:
        return pretraining_batch_loss(nnx.merge(graphdef, params, rest), batch, deterministic=True)

    held = float(np.mean([float(evaluate(finals[0], b)) for b in env["held_out"]]))
    same = all(
        np.asarray(a).tobytes() == np.asarray(b).tobytes()
        for p in finals[1:]
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(finals[0]), strict=True)
    )
    tail = [x for s in train_loss for x in s[-2 * (cfg.target_batch_size // micro) :]]
    return {"held_out_loss": held, "train_loss_tail": float(np.mean(tail)), "in_step": same,
            "rounds": group.rounds}  # fmt: skip


def measure(epochs: int, seeds: Sequence[int], held_out: int, chunk: int) -> dict[str, Any]:
    """Both rules at each seed; the per-seed rows and the ratios' median and spread."""
    env = setup(held_out)
    rows = []
    for seed in seeds:
        row: dict[str, Any] = {"seed": seed}
        for name in RULES:
            rule = Rule(name, chunk)
            r = train(env, rule, seed, epochs)
            row[f"{name}_loss"] = round(r["held_out_loss"], 5)
            row[f"{name}_in_step"] = r["in_step"]
            if name == "defended":
                row.update(chunks=rule.chunks, clipped_chunks=rule.clipped,
                           zeroed_parts=rule.zeroed,
                           max_rel_change=round(rule.max_rel_change, 6))  # fmt: skip
        row["loss_ratio"] = round(row["defended_loss"] / row["plain_loss"], 5)
        rows.append(row)
    ratios = [r["loss_ratio"] for r in rows]
    return {
        "epochs": epochs,
        "seeds": list(seeds),
        "rows": rows,
        "loss_ratio": round(statistics.median(ratios), 5),
        "loss_ratio_spread": [min(ratios), max(ratios)],
    }


def main() -> None:
    from dedloc_jax.averaging.config import AllReduceConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--held-out", type=int, default=16, help="held-out batches of 8")
    parser.add_argument("--chunk", type=int, default=AllReduceConfig().chunk_elems)
    args = parser.parse_args()
    wall = time.monotonic()
    out = measure(args.epochs, args.seeds, args.held_out, args.chunk)
    for row in out["rows"]:
        print(" ".join(f"{k}={v}" for k, v in row.items()))
    print(json.dumps({**out, "wall_s": round(time.monotonic() - wall, 1)}))


if __name__ == "__main__":
    main()
