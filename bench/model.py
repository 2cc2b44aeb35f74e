"""Training-step throughput: the Flax ALBERT against transformers' PyTorch one.

    python -m bench.model [--batch 8] [--seq 128] [--steps 8] [--threads 1]
    python -m bench.model --gpu-only          # on a GPU machine: the sahajBERT figures only

CPU comparison: one step is forward, backward and an Adam update (same hyper-parameters on both
sides) on a fixed pretraining batch, float32, the same small config and the same weights. Both
models are in training mode with the same dropout (0 in the encoder, 0.1 on the SOP head).
Flax runs one jitted program (params and optimizer state donated, as the trainer does); its
loss runs the MLM head (and the vocabulary-wide decoder) on the labelled positions only, as the
original BERT/ALBERT code does, while transformers' model runs it on every position (it returns
all the logits): same loss and gradients, less work. Each
side is warmed up first (Flax compiles then, which is not counted), then the two alternate
step by step and the median of each is kept, so that load from other processes hits both alike.

Threads: ``--threads N`` pins the process to N cores before JAX starts (XLA:CPU sizes its
thread pool from the cores it may use) and gives torch N threads. The default is 1: on a
small shared machine single-threaded figures are the reproducible ones. ``--threads 0`` uses
every core the process may run on. JAX runs CPU programs in the calling thread, as torch
does (``jax_cpu_enable_async_dispatch`` off; ``--async-dispatch`` keeps JAX's default, which
hands each step to another thread: on a loaded machine every hand-off waits for a core).

GPU: where JAX sees a GPU (and unless ``--no-gpu``), the sahajBERT config is timed at sequence
512 in bfloat16 compute with float32 master weights, with its model FLOPs utilisation against
the chip's dense bf16 peak (``--gpu-peak-tflops`` for chips not in the table). Without a GPU
the JSON says the GPU part did not run, and why.

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable

import jax
import numpy as np
import optax
from flax import nnx

from models.albert import IGNORE_INDEX, AlbertConfig, AlbertForPreTraining, pretraining_batch_loss

# Small enough for a 2-core CPU, wide enough that matrix products dominate as they do at scale.
CPU_CONFIG = AlbertConfig.tiny(
    vocab_size=8000,
    embedding_size=128,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=1024,
    max_position_embeddings=512,
)
LEARNING_RATE = 1e-4
# Dense bfloat16 peaks (no sparsity) by device_kind substring, FLOP/s.
BF16_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12}


def make_batch(cfg: AlbertConfig, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A full-length pretraining batch: two segments, 15% of positions labelled."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, cfg.vocab_size, (batch, seq)).astype(np.int32)
    types = (np.arange(seq)[None, :] >= seq // 2).astype(np.int32).repeat(batch, 0)
    mlm = np.where(rng.random((batch, seq)) < 0.15, ids, IGNORE_INDEX).astype(np.int32)
    return dict(
        input_ids=ids,
        attention_mask=np.ones((batch, seq), np.int32),
        token_type_ids=types,
        mlm_labels=mlm,
        sop_labels=rng.integers(0, 2, batch).astype(np.int32),
    )


def flax_step(model: AlbertForPreTraining, batch: dict, device=None) -> Callable[[], float]:
    """A closure running one jitted training step (returns the loss, so it waits for it)."""
    optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(pretraining_batch_loss)(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    compiled = jax.jit(step, donate_argnums=0)
    held = [jax.device_put(state, device), jax.device_put(batch, device)]

    def run() -> float:
        held[0], loss = compiled(held[0], held[1])
        return float(loss)

    return run


def torch_step(model: AlbertForPreTraining, batch: dict) -> Callable[[], float]:
    """The same step in PyTorch, from the same weights (training mode, torch's Adam)."""
    import torch

    from models.hf import albert_to_torch

    torch_model = albert_to_torch(model).train()
    optimizer = torch.optim.Adam(torch_model.parameters(), lr=LEARNING_RATE)
    tensors = {k: torch.from_numpy(v).long() for k, v in batch.items()}

    def run() -> float:
        optimizer.zero_grad(set_to_none=True)
        out = torch_model(
            input_ids=tensors["input_ids"],
            attention_mask=tensors["attention_mask"],
            token_type_ids=tensors["token_type_ids"],
            labels=tensors["mlm_labels"],
            sentence_order_label=tensors["sop_labels"],
        )
        out.loss.backward()
        optimizer.step()
        return out.loss.item()

    return run


@dataclasses.dataclass
class Timing:
    wall_s: float  # median wall-clock seconds per step
    cpu_s: float  # median CPU seconds of this process per step (all its threads)


def interleaved(steps: dict[str, Callable[[], float]], warmup: int, reps: int) -> dict:
    """Warm each step up, then time them in turn ``reps`` times; medians per step."""
    for run in steps.values():
        for _ in range(warmup):
            run()
    walls: dict[str, list[float]] = {name: [] for name in steps}
    cpus: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, run in steps.items():
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            walls[name].append(time.perf_counter() - wall)
            cpus[name].append(time.process_time() - cpu)
    return {n: Timing(statistics.median(walls[n]), statistics.median(cpus[n])) for n in steps}


def cpu_figures(batch: int, seq: int, warmup: int, reps: int, threads: int) -> dict:
    cfg = CPU_CONFIG
    data = make_batch(cfg, batch, seq)
    model = AlbertForPreTraining(cfg, rngs=nnx.Rngs(0))
    steps = {
        "torch": torch_step(model, data),  # first: it copies the weights before Flax donates
        "flax": flax_step(model, data, jax.devices("cpu")[0]),
    }
    t = interleaved(steps, warmup, reps)
    tokens = batch * seq
    print(
        f"CPU, {threads} thread(s), batch {batch} x seq {seq}, hidden {cfg.hidden_size}, "
        f"{cfg.num_hidden_layers} layers, {reps} interleaved steps (medians):"
    )
    for name in "flax", "torch":
        print(
            f"  {name:5s} {t[name].wall_s * 1e3:8.1f} ms/step (cpu {t[name].cpu_s * 1e3:7.1f} ms)"
            f"  {tokens / t[name].wall_s:10,.0f} tokens/s"
        )
    print(f"  flax / torch throughput: {t['torch'].wall_s / t['flax'].wall_s:.2f}x")
    return dict(
        flax_tokens_per_s=tokens / t["flax"].wall_s,
        torch_tokens_per_s=tokens / t["torch"].wall_s,
        flax_over_torch=t["torch"].wall_s / t["flax"].wall_s,
        flax_seqs_per_s=batch / t["flax"].wall_s,
        torch_seqs_per_s=batch / t["torch"].wall_s,
        flax_step_ms=t["flax"].wall_s * 1e3,
        torch_step_ms=t["torch"].wall_s * 1e3,
        flax_cpu_ms=t["flax"].cpu_s * 1e3,
        torch_cpu_ms=t["torch"].cpu_s * 1e3,
        batch=batch,
        seq=seq,
        threads=threads,
        reps=reps,
        config={k: v for k, v in dataclasses.asdict(cfg).items() if k != "remat"},
    )


def training_flops_per_token(cfg: AlbertConfig, seq: int) -> float:
    """Model FLOPs of one training token: 3x the forward (backward is twice the forward).

    Shared weights save memory, not compute: each of the L x inner layer applications counts.
    Per application: q, k, v, output (4 H^2) and the FFN (2 H I) multiply-adds, plus attention
    scores and their weighted sum (2 T H). The MLM head counts on the labelled 15% of tokens,
    where the loss runs it. Recomputation under remat is not counted.
    """
    e, h, i, v = cfg.embedding_size, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    applications = cfg.num_hidden_layers * cfg.inner_group_num
    per_layer = 4 * h * h + 2 * h * i + 2 * seq * h
    heads = 0.15 * (h * e + e * v) + (h * h + 2 * h) / seq  # MLM dense + tied decoder; SOP
    return 3 * 2 * (e * h + applications * per_layer + heads)


def peak_flops(device_kind: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    for name, peak in BF16_PEAK_FLOPS.items():
        if name.lower() in device_kind.lower():
            return peak
    return None


def gpu_figures(
    batch: int,
    seq: int,
    warmup: int,
    reps: int,
    peak_tflops: float | None,
    attention: str | None = None,
    remat: bool = False,
) -> dict:
    """sahajBERT in bf16 on the first GPU: tokens/s, model FLOPs utilisation, peak memory."""
    device = jax.devices("gpu")[0]
    cfg = AlbertConfig.sahajbert(dtype="bfloat16", attention=attention, remat=remat)
    model = AlbertForPreTraining(cfg, rngs=nnx.Rngs(0))
    t = interleaved({"gpu": flax_step(model, make_batch(cfg, batch, seq), device)}, warmup, reps)
    seconds = t["gpu"].wall_s
    tokens_per_s = batch * seq / seconds
    peak = peak_flops(device.device_kind, peak_tflops)
    mfu = None if peak is None else tokens_per_s * training_flops_per_token(cfg, seq) / peak
    shown = "unknown peak" if mfu is None else f"MFU {mfu:.1%} of {peak / 1e12:.0f} TFLOP/s"
    print(
        f"GPU {device.device_kind}, sahajBERT bf16, batch {batch} x seq {seq}, "
        f"attention {attention or 'auto'}, remat {remat}: "
        f"{seconds * 1e3:.1f} ms/step, {tokens_per_s:,.0f} tokens/s, {shown}"
    )
    return dict(
        gpu_ran=True,
        gpu_device=device.device_kind,
        gpu_batch=batch,
        gpu_seq=seq,
        gpu_dtype=cfg.dtype,
        gpu_step_ms=seconds * 1e3,
        gpu_tokens_per_s=tokens_per_s,
        gpu_model_tflops_per_s=tokens_per_s * training_flops_per_token(cfg, seq) / 1e12,
        gpu_peak_tflops=None if peak is None else peak / 1e12,
        gpu_mfu=mfu,
        gpu_attention=attention or "auto",
        gpu_remat=remat,
        gpu_peak_memory_gb=_peak_memory_gb(device),
    )


def _peak_memory_gb(device) -> float | None:
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 1e9


def pin_threads(threads: int, async_dispatch: bool = False) -> int:
    """Restrict this process to ``threads`` cores (0: all it may use) before JAX starts its
    CPU client, and give torch as many threads. Returns the thread count used."""
    import torch

    jax.config.update("jax_cpu_enable_async_dispatch", async_dispatch)

    allowed = sorted(os.sched_getaffinity(0))
    if threads <= 0 or threads >= len(allowed):
        threads = len(allowed)
    else:
        os.sched_setaffinity(0, allowed[:threads])
    torch.set_num_threads(threads)
    return threads


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed steps of each side")
    parser.add_argument("--threads", type=int, default=1, help="CPU cores for both (0: all)")
    parser.add_argument("--async-dispatch", action="store_true", help="JAX's default on CPU")
    parser.add_argument("--gpu-batch", type=int, default=32)
    parser.add_argument("--gpu-seq", type=int, default=512)
    parser.add_argument("--gpu-peak-tflops", type=float, default=None)
    parser.add_argument(
        "--gpu-attention", choices=["auto", "xla", "cudnn"], default="auto", help="attention kernel"
    )
    parser.add_argument("--gpu-remat", action="store_true", help="recompute layer activations")
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU part even with a GPU")
    parser.add_argument("--gpu-only", action="store_true", help="skip the CPU comparison")
    args = parser.parse_args(argv)

    figures: dict = {}
    if args.gpu_only:
        threads = pin_threads(0, async_dispatch=True)  # the GPU's host side gets every core
    else:
        threads = pin_threads(args.threads, args.async_dispatch)
        figures.update(cpu_figures(args.batch, args.seq, args.warmup, args.steps, threads))
        figures["jax_cpu_async_dispatch"] = args.async_dispatch
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    if args.no_gpu:
        figures.update(gpu_ran=False, gpu_skipped="--no-gpu")
    elif not has_gpu:
        figures.update(gpu_ran=False, gpu_skipped="no GPU visible to JAX")
        print("GPU part not run: no GPU visible to JAX")
    else:
        peak = args.gpu_peak_tflops
        attention = None if args.gpu_attention == "auto" else args.gpu_attention
        figures.update(
            gpu_figures(
                args.gpu_batch,
                args.gpu_seq,
                args.warmup,
                args.steps,
                peak,
                attention,
                args.gpu_remat,
            )
        )
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
