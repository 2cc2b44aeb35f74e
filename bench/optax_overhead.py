"""Micro-step overhead of ``dedloc_jax.collaborative`` against plain optax.

A small MLP trains with jitted steps with ``optax.adam`` alone, with
``collaborative(optax.adam, collab)`` on a one-peer collaboration whose target is never reached
(so every measured step is a step that does not average: what remains is the accumulator and
the one cheap host callback that reports progress), and, for reference, with optax's own
gradient accumulation ``optax.MultiSteps``, and ``collaborative`` with
``dedloc_jax.keep_in_step`` after every step, as the README's loop calls it (``keep_ms``,
``keep_overhead_pct``). Each runs twice: with the step's params and
optimizer state donated to it (``donate_argnums=(0, 1)``, as the README's training step does) and
without. All six run in the same process on the same data, interleaved round by round; medians
are reported.

The headline keys (``collaborative_ms``, ``plain_ms``, ``overhead_pct``, ...) are the donated
pair, the configuration the README recommends: donated params and optimizer state are updated in
place. Without donation the inputs stay alive, so a step that leaves the optimizer state as it
was (``collaborative`` or ``MultiSteps`` between optimizer steps) still copies it into new output
buffers; those figures have the ``undonated_`` prefix, against plain optax without donation.

    python -m bench.optax_overhead [--width 512] [--batch 1024] [--steps 200] [--rounds STEPS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dedloc_jax import Collaboration, CollaborationConfig, collaborative, keep_in_step

NEVER = 10**12  # a target the benchmark never reaches: no step averages


def _init(width: int, key: jax.Array) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": jax.random.normal(k1, (width, width)) / np.sqrt(width),
        "w2": jax.random.normal(k2, (width, width)) / np.sqrt(width),
        "w3": jax.random.normal(k3, (width, 1)) / np.sqrt(width),
    }


def _loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jax.nn.gelu(x @ params["w1"])
    h = jax.nn.gelu(h @ params["w2"])
    return jnp.mean((h @ params["w3"] - y) ** 2)


def _make_step(tx: optax.GradientTransformation, collab_kwargs: bool, donate: bool) -> Callable:
    def step(params, state, x, y):
        grads = jax.grad(_loss)(params, x, y)
        if collab_kwargs:
            updates, state = tx.update(grads, state, params, batch_size=x.shape[0])
        else:
            updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def _time_steps(
    step, params, state, x, y, n: int, after: Callable | None = None
) -> tuple[list[float], list[float], tuple]:
    """Wall and process CPU seconds of ``n`` steps, one by one (each followed by
    ``after(params, state) -> (params, state)`` when given)."""
    times, cpu = [], []
    for _ in range(n):
        c0, t0 = time.process_time(), time.perf_counter()
        params, state = step(params, state, x, y)
        if after is not None:
            params, state = after(params, state)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return times, cpu, (params, state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per variant")
    parser.add_argument(
        "--rounds", type=int, default=0, help="interleaved rounds (default: one step each)"
    )
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(args.batch, args.width)).astype(np.float32))
    y = jnp.asarray(rng.normal(size=(args.batch, 1)).astype(np.float32))
    params = _init(args.width, jax.random.PRNGKey(0))

    config = CollaborationConfig.local_demo(target_batch_size=NEVER)
    with Collaboration("bench-overhead", config=config) as collab:
        txs = {
            "plain": (optax.adam(1e-3), False),
            "collaborative": (
                collaborative(optax.adam(1e-3), collab, target_batch_size=NEVER),
                True,
            ),
            "multisteps": (optax.MultiSteps(optax.adam(1e-3), every_k_schedule=10**9), False),
            "keep_in_step": (
                collaborative(optax.adam(1e-3), collab, target_batch_size=NEVER),
                True,
            ),
        }
        # keep_in_step serves the first state, then asks the fork check (alone, it cannot
        # tell: each second for fork_patience, then every 10 s): its cost on a micro-step
        # with nothing to do is what the README's loop pays.
        afters = {"keep_in_step": lambda p, s: keep_in_step(collab, p, s)}
        variants = [(name, donate) for donate in (False, True) for name in txs]
        steps = {(n, d): _make_step(txs[n][0], txs[n][1], d) for n, d in variants}
        states = {
            (n, d): (jax.tree.map(jnp.copy, params), txs[n][0].init(params)) for n, d in variants
        }
        for _ in range(10):  # compile and warm up
            for v in variants:
                states[v] = steps[v](*states[v], x, y)
        jax.block_until_ready(states)
        times: dict[tuple[str, bool], list[float]] = {v: [] for v in variants}
        cpu: dict[tuple[str, bool], list[float]] = {v: [] for v in variants}
        rounds = min(args.rounds or args.steps, args.steps)
        per_round = max(1, args.steps // rounds)
        for r in range(rounds):  # interleave so all see the same machine load
            for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
                after = afters.get(v[0])
                t, c, states[v] = _time_steps(steps[v], *states[v], x, y, per_round, after)
                times[v] += t
                cpu[v] += c
        for donate in (False, True):
            for name in ("collaborative", "keep_in_step"):
                collab_state = states[(name, donate)][1]
                assert int(collab_state.epoch) == 0, "the benchmark must not average"

    ms = {v: statistics.median(t) * 1e3 for v, t in times.items()}
    # Process CPU time (all threads: XLA's, the callback's, the collaboration's loop): steadier
    # than wall time on a machine that others load, and it counts host work a wall clock hides.
    cpu_ms = {v: statistics.median(c) * 1e3 for v, c in cpu.items()}

    def overhead(donate: bool, name: str = "collaborative") -> float:
        return 100 * (ms[(name, donate)] / ms[("plain", donate)] - 1)

    def paired_overhead(donate: bool, name: str = "collaborative") -> float:
        """Median of step-by-step ratios (the i-th steps ran side by side): load that comes
        and goes cancels out."""
        pairs = zip(times[(name, donate)], times[("plain", donate)], strict=True)
        return 100 * (statistics.median(c / p for c, p in pairs) - 1)

    print(f"MLP width {args.width}, batch {args.batch}, {len(times[variants[0]])} steps each")
    for donate in (True, False):
        label = "donated buffers (headline)" if donate else "no donation"
        print(f"{label}:")
        print(f"  plain optax:   median {ms[('plain', donate)]:.3f} ms/step")
        print(f"  collaborative: median {ms[('collaborative', donate)]:.3f} ms/step")
        print(f"  MultiSteps:    median {ms[('multisteps', donate)]:.3f} ms/step (reference)")
        print(
            f"  + keep_in_step: median {ms[('keep_in_step', donate)]:.3f} ms/step, "
            f"{overhead(donate, 'keep_in_step'):+.1f}% over plain optax "
            f"(step by step: {paired_overhead(donate, 'keep_in_step'):+.1f}%)"
        )
        print(
            f"  overhead:      {overhead(donate):+.1f}% over plain optax "
            f"(step by step: {paired_overhead(donate):+.1f}%)"
        )
        plain_cpu, collab_cpu = cpu_ms[("plain", donate)], cpu_ms[("collaborative", donate)]
        print(f"  CPU time:      plain {plain_cpu:.3f} ms, collaborative {collab_cpu:.3f} ms")
    result = {}
    for donate, prefix in ((True, ""), (False, "undonated_")):
        result[f"{prefix}collaborative_ms"] = round(ms[("collaborative", donate)], 4)
        result[f"{prefix}plain_ms"] = round(ms[("plain", donate)], 4)
        result[f"{prefix}multisteps_ms"] = round(ms[("multisteps", donate)], 4)
        result[f"{prefix}keep_ms"] = round(ms[("keep_in_step", donate)], 4)
        result[f"{prefix}keep_overhead_pct"] = round(overhead(donate, "keep_in_step"), 2)
        result[f"{prefix}keep_paired_overhead_pct"] = round(
            paired_overhead(donate, "keep_in_step"), 2
        )
        result[f"{prefix}overhead_pct"] = round(overhead(donate), 2)
        result[f"{prefix}paired_overhead_pct"] = round(paired_overhead(donate), 2)
        result[f"{prefix}collaborative_cpu_ms"] = round(cpu_ms[("collaborative", donate)], 4)
        result[f"{prefix}plain_cpu_ms"] = round(cpu_ms[("plain", donate)], 4)
    result.update(width=args.width, batch=args.batch, steps=len(times[variants[0]]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
