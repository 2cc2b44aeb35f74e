"""Micro-step overhead of ``dedloc_jax.collaborative`` against plain optax.

A small MLP trains with jitted steps with ``optax.adam`` alone, with
``collaborative(optax.adam, collab)`` on a one-peer collaboration whose target is never reached
(so every measured step is a step that does not average: what remains is the accumulator and
the one cheap host callback that reports progress), and, for reference, with optax's own
gradient accumulation ``optax.MultiSteps``. All run in the same process, interleaved.

    python -m bench.optax_overhead [--width 512] [--batch 1024] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dedloc_jax import Collaboration, CollaborationConfig, collaborative


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


def _make_step(tx: optax.GradientTransformation, collab_kwargs: bool):
    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(_loss)(params, x, y)
        if collab_kwargs:
            updates, state = tx.update(grads, state, params, batch_size=x.shape[0])
        else:
            updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def _time_steps(step, params, state, x, y, n: int) -> tuple[list[float], tuple]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        params, state = step(params, state, x, y)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t0)
    return times, (params, state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per variant")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(args.batch, args.width)).astype(np.float32))
    y = jnp.asarray(rng.normal(size=(args.batch, 1)).astype(np.float32))
    params = _init(args.width, jax.random.PRNGKey(0))

    config = CollaborationConfig.local_demo(target_batch_size=10**12)
    with Collaboration("bench-overhead", config=config) as collab:
        plain_tx = optax.adam(1e-3)
        collab_tx = collaborative(optax.adam(1e-3), collab, target_batch_size=10**12)
        multi_tx = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=10**9)
        plain = _make_step(plain_tx, False)
        collab_step = _make_step(collab_tx, True)
        multi = _make_step(multi_tx, False)
        p_state = (params, plain_tx.init(params))
        c_state = (params, collab_tx.init(params))
        m_state = (params, multi_tx.init(params))
        for _ in range(10):  # compile and warm up all three
            p_state = plain(*p_state, x, y)
            c_state = collab_step(*c_state, x, y)
            m_state = multi(*m_state, x, y)
        jax.block_until_ready((p_state, c_state, m_state))
        plain_times: list[float] = []
        collab_times: list[float] = []
        multi_times: list[float] = []
        rounds = 10
        for _ in range(rounds):  # interleave so all see the same machine load
            t, p_state = _time_steps(plain, *p_state, x, y, args.steps // rounds)
            plain_times += t
            t, c_state = _time_steps(collab_step, *c_state, x, y, args.steps // rounds)
            collab_times += t
            t, m_state = _time_steps(multi, *m_state, x, y, args.steps // rounds)
            multi_times += t
        assert int(c_state[1].epoch) == 0, "the benchmark must not average"

    plain_ms = statistics.median(plain_times) * 1e3
    collab_ms = statistics.median(collab_times) * 1e3
    multi_ms = statistics.median(multi_times) * 1e3
    print(f"MLP width {args.width}, batch {args.batch}, {len(plain_times)} steps each")
    print(f"plain optax:   median {plain_ms:.3f} ms/step")
    print(f"collaborative: median {collab_ms:.3f} ms/step")
    print(f"MultiSteps:    median {multi_ms:.3f} ms/step (optax's accumulation, reference)")
    print(f"overhead:      {100 * (collab_ms / plain_ms - 1):+.1f}% over plain optax")
    print(
        json.dumps(
            {
                "collaborative_ms": round(collab_ms, 4),
                "plain_ms": round(plain_ms, 4),
                "multisteps_ms": round(multi_ms, 4),
                "overhead_pct": round(100 * (collab_ms / plain_ms - 1), 2),
                "width": args.width,
                "batch": args.batch,
                "steps": len(plain_times),
            }
        )
    )


if __name__ == "__main__":
    main()
