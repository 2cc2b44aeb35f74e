"""DeDLOC mode against DiLoCo mode at equal samples: the demo's tiny ALBERT, 3 peers.

Both modes train the demo's model (``TrainerConfig.demo()``: tiny ALBERT, the synthetic
corpus, micro-batches of 16, target batch 96) from one initialisation on the same data
streams, each peer its own: DeDLOC mode (``collaborative`` with the demo's clip + LAMB, fp16
gradients) and DiLoCo mode (``diloco`` with that same optimizer as the inner one, the default
Nesterov outer step, int8 pseudo-gradients, an outer step every ``--inner-steps`` target
batches). By default the outer rate (peak 0.7, momentum 0.9: ``diloco``'s defaults) decays
to 0 over the run on a cosine, as a run of known length would schedule it;
``--outer-schedule constant`` keeps ``diloco``'s constant rate, which at this tiny scale
reaches the loss floor early and then overshoots it (``bench/README.md`` has both figures
and why). The peers are threads of this process averaging through an in-process group that
applies the codec as the butterfly does (each contribution and the mean pass through it),
so the comparison is about the optimisation, not the network.

Reported (last line, JSON): the final MLM+SOP loss of each mode on held-out batches, their
ratio (goal: DiLoCo within 5% of DeDLOC), the bytes each peer sends (per averaging, a
butterfly member sends ``2 (n - 1) / n`` of the encoded vector), the averaging rounds, and a
PNG of both held-out loss curves against samples. ``--modes diloco,diloco-topk`` compares
int8 DiLoCo with TopK DiLoCo (:class:`dedloc_jax.TopK`, payloads swapped as the all-gather
does, each peer sending ``n - 1`` payloads, ``diloco``'s outer step for TopK: SGD at rate 1;
the ``--outer-*`` options are int8 DiLoCo's); the ratio is then the last mode's over the first's.

    python -m bench.diloco_quality [--samples 5760] [--inner-steps 4] [--peers 3] [--out DIR]
        [--outer-lr 0.7] [--outer-momentum 0.9] [--outer-schedule cosine|constant]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import dedloc_jax
from dedloc_jax.averaging.chunk_codecs import get_codec
from dedloc_jax.averaging.leaf_codecs import leaf_codec_names
from dedloc_jax.diloco import outer_params_after_step
from dedloc_jax.history import RoundOutcome
from dedloc_jax.powersgd import PowerSGD
from dedloc_jax.topk import Payload, TopK, mean_of, pack, unpack
from examples.sahajbert import training
from examples.sahajbert.config import TrainerConfig
from models.albert import pretraining_batch_loss


class Group:
    """``n`` in-process peers in lockstep: every micro-step all report, and an averaging
    gives every peer the same weighted mean, passed through the wire codec (each leaf through
    its own under a per-leaf policy)."""

    def __init__(self, n: int, target: int, codec: str) -> None:
        self.n, self.target, self.codec = n, target, codec
        self.barrier = threading.Barrier(n)
        self.samples = [0] * n
        self.sent: list[list] = [[] for _ in range(n)]
        self.bytes_sent = [0] * n
        self.rounds = 0

    def peer(self, index: int) -> Peer:
        return Peer(self, index)


class Peer:
    def __init__(self, group: Group, index: int) -> None:
        self.group, self.index = group, index

    def report_progress(self, epoch: int, samples: int, batch_size: int) -> bool:
        g = self.group
        g.samples[self.index] = samples
        g.barrier.wait()
        ready = sum(g.samples) >= g.target
        g.barrier.wait()
        return ready

    def average_gradients(
        self, epoch: int, gradients: Sequence[np.ndarray], samples: int, *, codec: str | None = None
    ) -> RoundOutcome:
        g = self.group
        if isinstance(codec, TopK):
            return self._gather(epoch, gradients, samples, codec)
        if isinstance(codec, PowerSGD):
            return self._low_rank(epoch, gradients, samples, codec)
        mean = self._mean(gradients, samples, codec or g.codec)
        if self.index == 0:
            g.rounds += 1
        return RoundOutcome(epoch, g.n, average=mean)

    def _low_rank(self, epoch: int, sent: Sequence[np.ndarray], samples: int, cfg: PowerSGD):
        """PowerSGD's two phases (:mod:`dedloc_jax.powersgd`), each a mean through the
        factors' codec as :meth:`_mean` gives it."""
        g = self.group
        count = int(np.asarray(sent[-1]))
        plan = cfg.plan([np.shape(a) for a in sent[:count]])
        ms, qs = plan.unpack_sent(sent)
        c = len(plan.compressed)
        mean_p = self._mean(plan.phase_p(ms, qs), samples, cfg.codec)
        ps, local_q = plan.phase_q(ms, mean_p[:c])
        mean_q = self._mean(local_q, samples, cfg.codec) if c else []
        mean, errors = plan.finish(ms, ps, mean_q, mean_p[c:])
        if self.index == 0:
            g.rounds += 1
        return RoundOutcome(epoch, g.n, average=[*mean, *plan.next_q(mean_q), *errors])

    def _mean(self, gradients: Sequence[np.ndarray], samples: int, codec: str) -> list:
        """Every peer's weighted mean of ``gradients``, each contribution and the mean passed
        through the codec (the bytes a butterfly member sends counted)."""
        g = self.group
        names = leaf_codec_names(codec, [np.shape(x) for x in gradients])
        wires = [get_codec(name) for name in names]

        def through(x: np.ndarray, i: int) -> np.ndarray:
            flat = np.ascontiguousarray(x, np.float32).reshape(-1)
            return wires[i].decode(wires[i].encode(flat), flat.size).reshape(x.shape)

        g.sent[self.index] = ([through(x, i) for i, x in enumerate(gradients)], samples)
        size = sum(w.encoded_size(int(np.size(x))) for w, x in zip(wires, gradients, strict=True))
        g.bytes_sent[self.index] += int(2 * (g.n - 1) / g.n * size)
        g.barrier.wait()
        total = sum(w for _, w in g.sent)
        mean = [
            through(sum(np.float32(w / total) * arrays[i] for arrays, w in g.sent), i)
            for i in range(len(gradients))
        ]
        g.barrier.wait()
        return mean

    def _gather(self, epoch: int, payload: Sequence[np.ndarray], samples: int, cfg: TopK):
        """As the sparse all-gather: each peer's packed payload to the n - 1 others, the mean
        of the decoded payloads in peer order."""
        g = self.group
        n = int(payload[3])
        g.sent[self.index] = (pack(cfg, Payload(*payload[:3]), n), samples)
        g.bytes_sent[self.index] += (g.n - 1) * cfg.payload_bytes(n)
        g.barrier.wait()
        got = [(unpack(cfg, d, n), w) for d, w in g.sent]
        mean = mean_of(cfg, [p for p, _ in got], [w for _, w in got], n)
        g.barrier.wait()
        if self.index == 0:
            g.rounds += 1
        return RoundOutcome(epoch, g.n, average=[mean])


apply_updates = jax.jit(optax.apply_updates)


def _eval_loss(graphdef: Any, rest: Any) -> Callable[[Any, dict], jax.Array]:
    @jax.jit
    def loss(params: Any, batch: dict) -> jax.Array:
        model = nnx.merge(graphdef, params, rest)
        return pretraining_batch_loss(model, batch, deterministic=True)

    return loss


def train(
    mode: str,
    args: argparse.Namespace,
    cfg: TrainerConfig,
    corpus: Any,
    vocab: int,
    model: tuple[Any, Any, Any],
    held_out: list[dict],
    codec: str | None = None,
    compression: PowerSGD | None = None,
    topk: TopK | None = None,
    outer: optax.GradientTransformation | None = None,
) -> dict[str, Any]:
    """One mode's run: every peer feeds ``args.samples / peers`` samples; held-out loss at
    every averaging of peer 0 (DiLoCo: its outer parameters). ``codec``: on the wire (None:
    int8 for DiLoCo, fp16 for DeDLOC); ``compression``: DeDLOC's PowerSGD (its factors in
    ``codec``); ``topk``: diloco-topk's settings (default ``TopK(density=args.topk_density)``);
    ``outer``: DiLoCo's outer optimizer (default: Nesterov at ``args.outer_lr``,
    ``args.outer_momentum``, ``args.outer_schedule``; diloco-topk: ``diloco``'s default with a
    TopK, SGD at rate 1)."""
    graphdef, params0, rest = model
    micro = cfg.per_device_batch_size
    per_peer = args.samples // args.peers
    diloco = mode.startswith("diloco")
    target = cfg.target_batch_size * (args.inner_steps if diloco else 1)
    group = Group(args.peers, target, codec or ("int8" if diloco else "fp16"))
    grad_step = training.make_grad_step(graphdef, rest)
    # As the trainer runs it: the transform eagerly around separately jitted pieces (one jit of
    # the whole step compiles for minutes on a busy CPU), shared by the peers.
    inner = training.jitted_inner(cfg.optimizer)
    evaluate = _eval_loss(graphdef, rest)
    curve: list[tuple[int, float]] = []
    finals: list[Any] = [None] * args.peers
    errors: list[BaseException] = []

    def held_out_loss(params: Any) -> float:
        return float(np.mean([float(evaluate(params, b)) for b in held_out]))

    def run(i: int) -> None:
        try:
            peer = group.peer(i)
            if diloco:
                outer_lr: float | optax.Schedule = args.outer_lr
                if args.outer_schedule == "cosine":  # to 0 at the run's last outer step
                    outer_lr = optax.cosine_decay_schedule(
                        args.outer_lr, per_peer * args.peers // target
                    )
                outer_tx = outer or optax.sgd(outer_lr, momentum=args.outer_momentum, nesterov=True)
                sparse = None
                if mode == "diloco-topk":  # diloco's default outer for TopK, as a trainer's
                    sparse = topk or TopK(density=args.topk_density)
                    outer_tx = outer
                tx = dedloc_jax.diloco(
                    inner,
                    peer,
                    target_batch_size=target,
                    outer=outer_tx,
                    codec=group.codec,
                    compression=sparse,
                )
            else:
                tx = dedloc_jax.collaborative(
                    inner, peer, target_batch_size=target, compression=compression
                )

            def step(params, state, batch):
                grads, loss = grad_step(params, batch)
                updates, state = tx.update(grads, state, params, batch_size=micro)
                return apply_updates(params, updates), state, loss

            params = jax.tree.map(lambda x: x.copy(), params0)
            state = tx.init(params)
            data = training.batches(cfg, corpus, vocab, peer_seed=1000 + i)
            epoch = 0
            for _ in range(per_peer // micro):
                params, state, _ = step(params, state, next(data))
                if int(state.epoch) != epoch:
                    epoch = int(state.epoch)
                    params = outer_params_after_step(params, state)  # (DeDLOC: unchanged)
                    # (DeDLOC: at the samples of each DiLoCo outer step, for one curve)
                    if (
                        i == 0
                        and (epoch * target) % (args.inner_steps * cfg.target_batch_size) == 0
                    ):
                        curve.append((epoch * target, held_out_loss(params)))
            finals[i] = params
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)
            group.barrier.abort()

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(args.peers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    final = held_out_loss(finals[0])
    identical = all(
        all(
            np.asarray(a).tobytes() == np.asarray(b).tobytes()
            for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(finals[0]), strict=True)
        )
        for p in finals[1:]
    )
    return {
        "final_loss": round(final, 4),
        "best_loss": round(min([v for _, v in curve] + [final]), 4),
        "curve": [(n, round(v, 4)) for n, v in curve],
        "rounds": group.rounds,
        "bytes_sent_per_peer": int(np.mean(group.bytes_sent)),
        "samples": per_peer * args.peers,
        "peers_identical": identical,
        "seconds": round(time.perf_counter() - started, 1),
    }


def plot_curves(results: dict[str, dict], path: Path) -> Path | None:
    """A PNG at ``path`` of each run's held-out loss against samples (None without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, r in results.items():
        xs, ys = zip(*r["curve"], strict=True) if r["curve"] else ((), ())
        ax.plot(xs, ys, marker="o", label=f"{mode} ({r['bytes_sent_per_peer'] / 1e6:.1f} MB/peer)")
    ax.set_xlabel("samples processed (all peers)")
    ax.set_ylabel("held-out MLM+SOP loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def prepare(cfg: TrainerConfig, held_out_batches: int) -> tuple[Any, int, Any, list[dict]]:
    """The demo's corpus, vocabulary size, initial model and ``held_out_batches`` held-out
    batches (one stream no peer trains on): what every mode of a comparison starts from."""
    training.enable_compilation_cache(cfg.work_dir / "jax-cache")
    tokenizer, corpus = training.prepare_data(cfg)
    vocab = len(tokenizer)
    model = training.build_model(
        training.model_config(cfg.model, vocab, cfg.seq_length, cfg.bf16), seed=cfg.seed
    )
    stream = training.batches(cfg, corpus, vocab, peer_seed=999)
    held_out = []
    for _ in range(held_out_batches):
        b = next(stream)
        held_out.append({k: v[0] for k, v in b.items() if k != training.DROPOUT_SEED})
    return corpus, vocab, model, held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=5760, help="samples, all peers together")
    parser.add_argument("--inner-steps", type=int, default=4, help="target batches per outer step")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument(
        "--outer-lr", type=float, default=0.7, help="outer Nesterov SGD's rate (its peak, cosine)"
    )
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument(
        "--outer-schedule",
        choices=("constant", "cosine"),
        default="cosine",
        help="the outer rate: cosine-decayed to 0 over the run, or constant (diloco's default)",
    )
    parser.add_argument("--held-out", type=int, default=8, help="held-out batches of 16")
    parser.add_argument("--out", type=Path, default=Path("diloco_quality"))
    parser.add_argument(
        "--modes",
        default="dedloc,diloco",
        help="comma-separated, of dedloc, diloco (int8), diloco-topk (TopK, all-gathered)",
    )
    parser.add_argument("--topk-density", type=float, default=1 / 64)
    args = parser.parse_args()
    cfg = TrainerConfig.demo()
    if args.samples % (args.peers * cfg.per_device_batch_size):
        parser.error("--samples must split into the peers' micro-batches")
    corpus, vocab, model, held_out = prepare(cfg, args.held_out)
    results = {}
    modes = args.modes.split(",")
    if not modes or not set(modes) <= {"dedloc", "diloco", "diloco-topk"}:
        parser.error("--modes: a comma-separated list of dedloc, diloco, diloco-topk")
    for mode in modes:
        r = train(mode, args, cfg, corpus, vocab, model, held_out)
        results[mode] = r
        print(
            f"{mode}: final held-out loss {r['final_loss']} after {r['samples']} samples, "
            f"{r['rounds']} averaging rounds, {r['bytes_sent_per_peer']:,} bytes sent per "
            f"peer, peers identical {r['peers_identical']}, {r['seconds']} s"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    plot = plot_curves(results, args.out / "diloco_quality.png")
    base, other = modes[0], modes[-1]
    ratio = results[other]["final_loss"] / results[base]["final_loss"]
    print(f"{other}'s final loss / {base}'s: {ratio:.4f} (goal <= 1.05); plot {plot}")
    out = {
        "loss_ratio": round(ratio, 4),
        "inner_steps": args.inner_steps,
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
        "outer_schedule": args.outer_schedule,
        "peers": args.peers,
        "plot": str(plot) if plot else None,
        **{f"{m}_{k}": v for m, r in results.items() for k, v in r.items() if k != "curve"},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
