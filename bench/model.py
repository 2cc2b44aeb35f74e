"""Training-step throughput: the Flax ALBERT against transformers' PyTorch one.

    python -m bench.model [--batch 8] [--seq 128] [--steps 6]

One step is forward, backward and an Adam update, on a fixed pretraining batch. Both run on the
CPU with the same threads and the same small config; each is warmed up (Flax compiles then),
then the median of the timed steps is kept. Where JAX sees a GPU, the sahajBERT config is timed
too at sequence 512 in bfloat16, with its model FLOPs utilisation. The last line printed is one
JSON object with the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

from models.albert import IGNORE_INDEX, AlbertConfig, AlbertForPreTraining
from models.sharding import make_train_step

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
H200_BF16_PEAK_FLOPS = 989e12  # dense bfloat16, no sparsity


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


def timed_steps(step, warmup: int, steps: int) -> float:
    """Median seconds of ``step()`` (which must wait for its own result) after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def flax_step_seconds(cfg: AlbertConfig, batch: dict, warmup: int, steps: int) -> float:
    model = AlbertForPreTraining(cfg, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)
    train_step = make_train_step()
    device_batch = jax.device_put(batch)
    return timed_steps(lambda: float(train_step(model, optimizer, device_batch)), warmup, steps)


def torch_step_seconds(cfg: AlbertConfig, batch: dict, warmup: int, steps: int) -> float:
    import torch

    from models.hf import albert_to_torch

    model = albert_to_torch(AlbertForPreTraining(cfg, rngs=nnx.Rngs(0))).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    tensors = {k: torch.from_numpy(v).long() for k, v in batch.items()}

    def step():
        optimizer.zero_grad(set_to_none=True)
        out = model(
            input_ids=tensors["input_ids"],
            attention_mask=tensors["attention_mask"],
            token_type_ids=tensors["token_type_ids"],
            labels=tensors["mlm_labels"],
            sentence_order_label=tensors["sop_labels"],
        )
        out.loss.backward()
        optimizer.step()
        out.loss.item()

    return timed_steps(step, warmup, steps)


def training_flops_per_token(cfg: AlbertConfig, seq: int) -> float:
    """Model FLOPs of one training token: 3x the forward (backward is twice the forward).

    Shared weights save memory, not compute: each of the L x inner layer applications counts.
    Per application: q, k, v, output (4 H^2) and the FFN (2 H I) multiply-adds, plus attention
    scores and their weighted sum (2 T H). Recomputation under remat is not counted.
    """
    e, h, i, v = cfg.embedding_size, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    applications = cfg.num_hidden_layers * cfg.inner_group_num
    per_layer = 4 * h * h + 2 * h * i + 2 * seq * h
    heads = h * e + e * v + (h * h + 2 * h) / seq  # MLM dense + tied decoder; pooler + SOP
    return 3 * 2 * (e * h + applications * per_layer + heads)


def gpu_figures(batch: int, seq: int, warmup: int, steps: int) -> dict:
    cfg = AlbertConfig.sahajbert(dtype="bfloat16")
    seconds = flax_step_seconds(cfg, make_batch(cfg, batch, seq), warmup, steps)
    tokens_per_s = batch * seq / seconds
    mfu = tokens_per_s * training_flops_per_token(cfg, seq) / H200_BF16_PEAK_FLOPS
    print(
        f"GPU sahajBERT bf16, batch {batch} x seq {seq}: {seconds * 1e3:.1f} ms/step, "
        f"{tokens_per_s:,.0f} tokens/s, MFU {mfu:.1%} of {H200_BF16_PEAK_FLOPS / 1e12:.0f} TFLOP/s"
    )
    return dict(
        gpu_device=str(jax.devices()[0].device_kind),
        gpu_batch=batch,
        gpu_seq=seq,
        gpu_step_ms=seconds * 1e3,
        gpu_tokens_per_s=tokens_per_s,
        gpu_mfu=mfu,
    )


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--gpu-batch", type=int, default=32)
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU part even with a GPU")
    args = parser.parse_args(argv)

    import torch

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    batch = make_batch(CPU_CONFIG, args.batch, args.seq)
    tokens = args.batch * args.seq
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        flax_s = flax_step_seconds(CPU_CONFIG, batch, args.warmup, args.steps)
    torch_s = torch_step_seconds(CPU_CONFIG, batch, args.warmup, args.steps)
    print(
        f"CPU, {threads} threads, batch {args.batch} x seq {args.seq}, "
        f"hidden {CPU_CONFIG.hidden_size}, {CPU_CONFIG.num_hidden_layers} layers:"
    )
    for name, s in ("flax", flax_s), ("torch", torch_s):
        print(f"  {name:5s} {s * 1e3:8.1f} ms/step  {tokens / s:10,.0f} tokens/s")
    print(f"  flax / torch throughput: {torch_s / flax_s:.2f}x")

    figures = dict(
        flax_tokens_per_s=tokens / flax_s,
        torch_tokens_per_s=tokens / torch_s,
        flax_seqs_per_s=args.batch / flax_s,
        torch_seqs_per_s=args.batch / torch_s,
        flax_step_ms=flax_s * 1e3,
        torch_step_ms=torch_s * 1e3,
        batch=args.batch,
        seq=args.seq,
        threads=threads,
        config={k: v for k, v in dataclasses.asdict(CPU_CONFIG).items() if k != "remat"},
    )
    if not args.no_gpu and jax.devices()[0].platform == "gpu":
        figures.update(gpu_figures(args.gpu_batch, 512, args.warmup, args.steps))
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
