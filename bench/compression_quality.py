"""What each wire compression costs in loss: the demo's tiny ALBERT, 3 peers, equal samples.

One row per mode, every one from the same initialisation on the same per-peer data streams
(``bench.diloco_quality``'s in-process group, which passes each contribution and the mean
through the codec, each leaf through its own under a per-leaf policy):

* ``dedloc-fp16``: DeDLOC mode as sahajBERT ran it (the baseline);
* ``dedloc-int8``: every leaf in blockwise int8;
* ``dedloc-adaptive``: 1-D and small leaves in fp16, matrices in int8;
* ``dedloc-powersgd-r1``, ``dedloc-powersgd-r4``: ``collaborative(compression=PowerSGD(rank=r))``,
  rank-r gradients with error feedback, the factors and the uncompressed leaves in fp16;
* ``diloco-int8``: DiLoCo mode (``--inner-steps`` target batches per outer step), int8;
* ``diloco-topk``: DiLoCo mode with ``dedloc_jax.TopK()`` (density 1/64, 2 bits, error feedback
  0.95; payloads all-gathered) and ``diloco``'s outer step for it (SGD at rate 1), as a
  volunteer's ``--compression topk`` trains.

Reported per row: the held-out MLM+SOP loss at the end, its ratio to the baseline's, and the
bytes each peer sends (a butterfly member sends ``2 (n - 1) / n`` of the encoded vector per
averaging; an all-gather member ``n - 1`` payloads). A PNG of the held-out loss curves goes to
``--out DIR/compression_quality.png`` (with matplotlib). The last line is one JSON object
``{"rows": [{"name", "loss", "bytes_per_peer", ...}, ...]}``.

    python -m bench.compression_quality [--samples 5760] [--inner-steps 4] [--peers 3]
        [--only NAME ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.diloco_quality import plot_curves, prepare, train
from dedloc_jax.powersgd import PowerSGD
from dedloc_jax.topk import TopK
from examples.sahajbert.config import TrainerConfig

ROWS = (
    ("dedloc-fp16", "dedloc", "fp16"),
    ("dedloc-int8", "dedloc", "int8"),
    ("dedloc-adaptive", "dedloc", "adaptive"),
    ("diloco-int8", "diloco", "int8"),
    ("diloco-topk", "diloco-topk", None),
    ("dedloc-powersgd-r1", "dedloc", "fp16"),
    ("dedloc-powersgd-r4", "dedloc", "fp16"),
)
LOW_RANK = {"dedloc-powersgd-r1": 1, "dedloc-powersgd-r4": 4}
"""The rows that average PowerSGD's factors (in the row's codec), and their rank."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=5760, help="samples, all peers together")
    parser.add_argument("--inner-steps", type=int, default=4, help="diloco: target batches")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--held-out", type=int, default=8, help="held-out batches of 16")
    parser.add_argument("--only", nargs="*", choices=[r[0] for r in ROWS], help="these rows")
    parser.add_argument("--out", type=Path, default=Path("compression_quality"))
    args = parser.parse_args()
    # diloco's outer step as bench.diloco_quality runs it by default
    args.outer_lr, args.outer_momentum, args.outer_schedule = 0.7, 0.9, "cosine"
    cfg = TrainerConfig.demo()
    if args.samples % (args.peers * cfg.per_device_batch_size):
        parser.error("--samples must split into the peers' micro-batches")
    corpus, vocab, model, held_out = prepare(cfg, args.held_out)
    rows, curves = [], {}
    for name, mode, codec in ROWS:
        if args.only and name not in args.only:
            continue
        low_rank = PowerSGD(rank=LOW_RANK[name], codec=codec) if name in LOW_RANK else None
        topk = TopK() if mode == "diloco-topk" else None  # the product's defaults
        r = train(
            mode,
            args,
            cfg,
            corpus,
            vocab,
            model,
            held_out,
            codec=codec,
            compression=low_rank,
            topk=topk,
        )
        row = {
            "name": name,
            "loss": r["final_loss"],
            "bytes_per_peer": r["bytes_sent_per_peer"],
            "rounds": r["rounds"],
            "samples": r["samples"],
            "peers_identical": r["peers_identical"],
            "seconds": r["seconds"],
        }
        rows.append(row)
        curves[name] = r
        print(
            f"{name}: held-out loss {row['loss']} after {row['samples']} samples, "
            f"{row['rounds']} rounds, {row['bytes_per_peer']:,} bytes per peer, "
            f"{row['seconds']} s",
            flush=True,
        )
    base = next((r["loss"] for r in rows if r["name"] == "dedloc-fp16"), None)
    for row in rows:
        if base:
            row["loss_ratio"] = round(row["loss"] / base, 4)
    args.out.mkdir(parents=True, exist_ok=True)
    plot = plot_curves(curves, args.out / "compression_quality.png")
    print(f"plot {plot}")
    print(json.dumps({"rows": rows, "peers": args.peers, "inner_steps": args.inner_steps,
                      "plot": str(plot) if plot else None}))  # fmt: skip


if __name__ == "__main__":
    main()
