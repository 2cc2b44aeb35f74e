"""What trainers, the coordinator and fine-tuning share: data, model, optimizer, the jitted step.

Parameters travel as an ``nnx.State`` of ``nnx.Param`` (a pytree); the rest of the model (dropout
RNG counters) stays outside the step. The optimizer is sahajBERT's: the collaboration's averaged
gradient is clipped to norm 1.0 and fed to LAMB with weight decay on every weight except biases
and LayerNorm parameters, on a warmup-then-linear-decay schedule indexed by the collaboration
epoch. Clipping sits inside :func:`dedloc_jax.collaborative`, so it acts on the global average
(the same vector on every peer) rather than on each micro-batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from examples.sahajbert.config import OptimizerConfig, TrainerConfig
from models.albert import AlbertConfig, AlbertForPreTraining, pretraining_batch_loss

log = logging.getLogger(__name__)

SYNTHETIC_DOCUMENTS = 1000  # documents of the synthetic corpus the demo trains on
TOKENIZER_VOCAB = 32000  # sahajBERT's size; a small corpus yields fewer pieces


# ------------------------------------------------------------------------------------ data
TOKENIZER_DOCUMENTS = 200_000  # documents of a streamed corpus the organiser's tokenizer sees


def _synthetic_texts(cfg: TrainerConfig) -> list[str]:
    from models.text.corpus import write_corpus
    from models.text.sources import read_local_documents

    path = cache_dir(cfg) / "corpus.txt"
    if not path.is_file():
        log.info("writing the synthetic Bengali corpus to %s (once)", path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".corpus.{os.getpid()}.tmp")
        write_corpus(tmp, SYNTHETIC_DOCUMENTS, seed=0)
        os.replace(tmp, path)
    return read_local_documents(path)


def sources(cfg: TrainerConfig) -> Any:
    """The ``--data`` sources (None: the synthetic corpus); FileNotFoundError naming a local
    one that is missing here."""
    from models.text.sources import check_local, parse_data

    if cfg.data is None:
        return None
    specs = parse_data(cfg.data, cfg.data_mix)
    check_local(specs)
    return specs


def prepare_tokenizer(cfg: TrainerConfig, documents: int = TOKENIZER_DOCUMENTS) -> tuple[Any, Path]:
    """The organiser's tokenizer: ``--tokenizer`` if given, else the one trained once (on
    the synthetic corpus, or the first ``documents`` of the streamed data) and kept in the
    work directory. Returns ``(tokenizer, directory)``. Volunteers never call this."""
    from models.text.sources import sample_documents
    from models.text.tokenizer import load_tokenizer, train_tokenizer

    if cfg.tokenizer:
        return load_tokenizer(cfg.tokenizer), Path(cfg.tokenizer)
    tok_dir = cache_dir(cfg) / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file():
        return load_tokenizer(tok_dir), tok_dir
    specs = sources(cfg)
    if specs is None:
        texts: Any = _synthetic_texts(cfg)
    else:
        texts = sample_documents(specs, documents, seed=cfg.seed)
        log.info("training the tokenizer on %d documents of the data", len(texts))
    return train_tokenizer(texts, TOKENIZER_VOCAB, tok_dir), tok_dir


def prepare_data(cfg: TrainerConfig) -> tuple[Any, Any]:
    """``(tokenizer, corpus)``: the tokenized synthetic corpus (cached under the work
    directory), or, for ``--data``, the sources to stream (tokenized on the fly).

    A trainer passes the manifest's tokenizer (``cfg.tokenizer``); without one the
    organiser's is prepared (:func:`prepare_tokenizer`)."""
    from models.text.data import load_or_tokenize, tokenizer_fingerprint

    tokenizer, _ = prepare_tokenizer(cfg)
    specs = sources(cfg)
    if specs is not None:
        return tokenizer, specs
    name = f"corpus-{tokenizer_fingerprint(tokenizer)[:16]}.npz"
    return tokenizer, load_or_tokenize(cache_dir(cfg) / name, _synthetic_texts(cfg), tokenizer)


def cache_dir(cfg: TrainerConfig) -> Path:
    """The directory of the synthetic corpus, or of the organiser's tokenizer for ``--data``."""
    if cfg.data is None:
        return cfg.work_dir / "synthetic"
    digest = hashlib.sha256(f"{cfg.data}|{cfg.data_mix}".encode()).hexdigest()[:12]
    return cfg.work_dir / f"data-{digest}"


def tokenizer_dir(cfg: TrainerConfig) -> Path:
    return Path(cfg.tokenizer) if cfg.tokenizer else cache_dir(cfg) / "tokenizer"


DROPOUT_SEED = "dropout_seed"  # batch key: per-example seeds of the dropout masks


def batches(cfg: TrainerConfig, corpus: Any, vocab: int, peer_seed: int) -> Iterator[dict]:
    """Endless ``[grad_accumulation, micro_batch, seq]`` batches for one peer: from the
    tokenized corpus, or streamed from the sources (``corpus`` a tuple of SourceSpec) in this
    peer's own order."""
    from models.text.data import (
        PretrainingConfig,
        TokenizedCorpus,
        pretraining_batches,
        streaming_batches,
    )

    micro = cfg.per_device_batch_size * jax.local_device_count()
    data_cfg = PretrainingConfig(seq_len=cfg.seq_length, shuffle_buffer=256, **dict(cfg.masking))
    if isinstance(corpus, TokenizedCorpus):
        stream = pretraining_batches(
            corpus,
            batch_size=micro * cfg.grad_accumulation,
            seed=cfg.seed,
            peer_seed=peer_seed,
            config=data_cfg,
            vocab_size=vocab,
        )
    else:
        from models.text.sources import stream_documents
        from models.text.tokenizer import load_tokenizer

        docs = stream_documents(corpus, seed=(cfg.seed << 32) ^ peer_seed)
        stream = streaming_batches(
            docs,
            load_tokenizer(tokenizer_dir(cfg)),
            batch_size=micro * cfg.grad_accumulation,
            seed=cfg.seed,
            peer_seed=peer_seed,
            config=data_cfg,
            vocab_size=vocab,
        )
    # Dropout seeds, one per example (so they split across devices like the rest of the batch),
    # from this peer's own stream: no two peers or steps draw the same SOP dropout mask.
    rng = np.random.default_rng([cfg.seed, peer_seed, 0xD0])
    for batch in stream:
        out = {k: v.reshape(cfg.grad_accumulation, micro, *v.shape[1:]) for k, v in batch.items()}
        out[DROPOUT_SEED] = rng.integers(0, 1 << 31, (cfg.grad_accumulation, micro), np.uint32)
        yield out


# ------------------------------------------------------------------------------------ model
def model_config(name: str, vocab_size: int, seq_length: int, bf16: bool) -> AlbertConfig:
    """The ALBERT shape for ``name`` with the tokenizer's vocabulary."""
    base = AlbertConfig.tiny if name == "tiny" else AlbertConfig.sahajbert
    overrides: dict[str, Any] = {"vocab_size": vocab_size}
    overrides["max_position_embeddings"] = max(seq_length, 128 if name == "tiny" else 512)
    if bf16:
        overrides["dtype"] = "bfloat16"
    return base(**overrides)


def save_model_config(config: AlbertConfig, path: Path) -> None:
    fields = {k: v for k, v in vars(config).items() if isinstance(v, int | float | str | bool)}
    path.write_text(json.dumps(fields, indent=1))


def load_model_config(path: Path) -> AlbertConfig:
    return AlbertConfig(**json.loads(path.read_text()))


def build_model(config: AlbertConfig, seed: int = 0) -> tuple[Any, Any, Any]:
    """``(graphdef, params, rest)`` of a fresh pretraining model (same init on every peer).

    Initialised in one compiled program (op-by-op initialisation is slow on a busy CPU).
    """

    @nnx.jit
    def create() -> AlbertForPreTraining:
        return AlbertForPreTraining(config, rngs=nnx.Rngs(seed))

    return nnx.split(create(), nnx.Param, ...)


def _is_decayed(path: tuple, _: Any) -> bool:
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    names = [n for n in names if n != "value"]
    if names and names[-1] == "bias":
        return False
    return not any("LayerNorm" in n or "layer_norm" in n for n in names)


def weight_decay_mask(params: Any) -> Any:
    """True for weights that decay: everything but biases and LayerNorm parameters."""
    return jax.tree_util.tree_map_with_path(_is_decayed, params)


def schedule(opt: OptimizerConfig) -> optax.Schedule:
    """Linear warmup to the peak rate, then linear decay to 0 at ``total_steps``."""
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, opt.learning_rate, max(opt.warmup_steps, 1)),
            optax.linear_schedule(opt.learning_rate, 0.0, opt.total_steps - opt.warmup_steps),
        ],
        [max(opt.warmup_steps, 1)],
    )


def inner_optimizer(opt: OptimizerConfig, *, decay: bool = True) -> optax.GradientTransformation:
    """Clip + LAMB at :func:`schedule`; ``decay`` False: the rate stays at its peak after the
    warmup (DiLoCo's inner optimizer, whose step count is this peer's micro-steps, a number
    no peer knows in advance; the run's decay is then the outer rate's, see
    :func:`outer_optimizer`)."""
    lr = (
        schedule(opt)
        if decay
        else optax.linear_schedule(0.0, opt.learning_rate, max(opt.warmup_steps, 1))
    )
    return optax.chain(
        optax.clip_by_global_norm(opt.clip_norm),
        optax.lamb(
            lr,
            b1=opt.b1,
            b2=opt.b2,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            mask=weight_decay_mask,
        ),
    )


DILOCO_OUTER_LR = 0.7  # DiLoCo's outer rate (its peak here)


def outer_optimizer(opt: OptimizerConfig, inner_steps: int) -> optax.GradientTransformation:
    """DiLoCo's outer step for a run of ``opt.total_steps`` target batches, one outer step per
    ``inner_steps`` of them: Nesterov SGD (momentum 0.9) whose rate decays from DiLoCo's 0.7
    to 0 (cosine) at the run's last outer step, since a constant rate overshoots once the
    model nears its loss floor. Every peer derives the same schedule from the run's settings."""
    outer_steps = max(1, opt.total_steps // inner_steps)
    lr = optax.cosine_decay_schedule(DILOCO_OUTER_LR, outer_steps)
    return optax.sgd(lr, momentum=0.9, nesterov=True)


def diloco_inner_recipe(
    opt: OptimizerConfig, samples_per_step: int, target_batch_size: int
) -> OptimizerConfig:
    """The inner optimizer's recipe in DiLoCo mode: the run's, at ``samples_per_step /
    target_batch_size`` of its rate. The run's rate is for one step of a target batch; an inner
    step takes one micro-batch of this peer's, so at the run's rate every peer moved
    ``target / micro`` times as far per sample as a DeDLOC step does, and the outer momentum
    multiplied that: the demo's prepared run (micro-batches of 4, target 96) rose from 6.35 at
    its third outer step to NaN by the 50th (``tests/examples/test_sahajbert_diloco.py``)."""
    rate = opt.learning_rate * min(1.0, samples_per_step / target_batch_size)
    return opt.replace(learning_rate=rate)


def trainer_inner(cfg: TrainerConfig, samples_per_step: int) -> optax.GradientTransformation:
    """The (jitted) inner optimizer of a trainer of ``cfg`` taking ``samples_per_step``
    samples a micro-step: the run's recipe in DeDLOC mode; :func:`diloco_inner_recipe` at its
    peak after the warmup in DiLoCo mode."""
    if cfg.mode != "diloco":
        return jitted_inner(cfg.optimizer)
    inner = diloco_inner_recipe(cfg.optimizer, samples_per_step, cfg.target_batch_size)
    return jitted_inner(inner, decay=False)


def jitted_inner(opt: OptimizerConfig, *, decay: bool = True) -> optax.GradientTransformation:
    """The inner optimizer with its ``init`` and ``update`` jitted on their own."""
    inner = inner_optimizer(opt, decay=decay)
    return optax.GradientTransformation(jax.jit(inner.init), jax.jit(inner.update))


def make_optimizer(
    opt: OptimizerConfig,
    collab: Any,
    target_batch_size: int,
    *,
    inner: optax.GradientTransformation | None = None,
    diloco: Any = None,
    inner_steps: int = 1,
    compression: Any = None,
) -> Any:
    """``collaborative(clip + LAMB)``; the inner optimizer is jitted on its own. ``diloco``
    (a wire codec, or a ``dedloc_jax.TopK``): ``dedloc_jax.diloco`` instead, an outer step
    every ``inner_steps`` target batches (``target_batch_size`` is then the outer step's
    samples), clip + LAMB at its peak
    after the warmup as its inner optimizer (a trainer passes :func:`trainer_inner`, at its
    rate per micro-batch) and :func:`outer_optimizer` as its outer one (with a TopK:
    ``diloco``'s default for it). ``compression``: a ``dedloc_jax.PowerSGD`` for
    ``collaborative`` (None: the run's codec carries gradients).

    The training step runs ``collaborative`` on the host (its documented non-jit path): the
    expensive pieces (gradients, the inner update) are separate jitted functions without host
    callbacks, which JAX's persistent compilation cache can store. Peers of a local demo then
    compile once instead of once each. Pass ``inner`` (from :func:`jitted_inner`) to share its
    compiled programs with another ``collaborative`` (the warm-up's).
    """
    import dedloc_jax

    inner = inner if inner is not None else jitted_inner(opt, decay=diloco is None)
    if diloco is not None:
        # TopK: diloco's own default outer step (SparseLoCo's constant SGD at rate 1, whose
        # error feedback a decayed or momentum outer step would fight)
        outer = outer_optimizer(opt, inner_steps) if isinstance(diloco, str) else None
        wire = {"codec": diloco} if isinstance(diloco, str) else {"compression": diloco}
        return dedloc_jax.diloco(
            inner, collab, target_batch_size=target_batch_size, outer=outer, **wire
        )
    return dedloc_jax.collaborative(
        inner, collab, target_batch_size=target_batch_size, compression=compression
    )


class WarmUpHost:
    """A stand-in collaboration: every second micro-step averages (with itself)."""

    def report_progress(self, epoch: int, samples: int, batch_size: int) -> bool:
        return samples > batch_size

    def average_gradients(self, epoch: int, gradients: Any, samples: int) -> Any:
        from dedloc_jax.history import RoundOutcome

        return RoundOutcome(epoch, 2, average=[np.asarray(g) for g in gradients])


def warm_up_step(
    grad_step: Any,
    inner: optax.GradientTransformation,
    samples_per_step: int,
    params: Any,
    batch: dict,
) -> float:
    """Compile (or load from the persistent cache) every program of a trainer's steps; seconds.

    Two micro-steps (one accumulating, one averaging with :class:`WarmUpHost`) through the same
    ``grad_step`` and ``inner`` the real step uses reach them all: the gradients, the eager
    accumulation of ``collaborative`` and the inner update. Their results are dropped, so a peer
    that then reports progress computes at its real pace from the first micro-step.
    """
    import dedloc_jax

    start = time.perf_counter()
    tx = dedloc_jax.collaborative(inner, WarmUpHost(), target_batch_size=samples_per_step)
    step = make_train_step(None, None, tx, samples_per_step, grad_step=grad_step)
    opt_state = tx.init(params)
    for _ in range(2):
        params, opt_state, loss = step(params, opt_state, batch)
    jax.block_until_ready((params, loss))
    return time.perf_counter() - start


def enable_compilation_cache(directory: Path) -> None:
    """Share compiled programs between this machine's processes (and runs).

    Every program is kept, also the quick ones: a trainer's first steps compile dozens of small
    ones (the eager accumulation of :func:`dedloc_jax.collaborative`, one per leaf shape), which
    together cost each process a few CPU seconds (measured ~9 -> ~5.5 s for the first steps).
    """
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def make_grad_step(graphdef: Any, rest: Any):
    """A jitted ``grad_step(params, batch) -> (mean grads, mean loss)``.

    ``batch`` arrays are ``[accumulation, micro_batch, ...]``: gradients of the micro-batches
    are averaged locally with ``lax.scan``.
    """

    def loss_fn(params: Any, batch: dict) -> jax.Array:
        model = nnx.merge(graphdef, params, rest)
        if DROPOUT_SEED not in batch:  # e.g. a benchmark's hand-made batch: no dropout
            return pretraining_batch_loss(model, batch, deterministic=True)
        # sahajBERT's recipe: classifier (SOP) dropout 0.1 while pretraining; the encoder's
        # dropout rates are 0, so only the SOP head draws a mask, keyed by the batch's seed.
        key = jax.random.key(batch[DROPOUT_SEED][0])
        features = {k: v for k, v in batch.items() if k != DROPOUT_SEED}
        return pretraining_batch_loss(model, features, deterministic=False, dropout_key=key)

    grad_fn = jax.value_and_grad(loss_fn)

    @jax.jit
    def grad_step(params: Any, batch: dict) -> tuple[Any, jax.Array]:
        def body(acc: Any, mb: dict) -> tuple[Any, jax.Array]:
            loss, grads = grad_fn(params, mb)
            return jax.tree.map(jnp.add, acc, grads), loss

        zeros = jax.tree.map(jnp.zeros_like, params)
        grad_sum, losses = jax.lax.scan(body, zeros, batch)
        n = losses.shape[0]
        return jax.tree.map(lambda g: g / n, grad_sum), jnp.mean(losses)

    return grad_step


_apply_updates = jax.jit(optax.apply_updates)


def make_train_step(
    graphdef: Any, rest: Any, tx: Any, samples_per_step: int, *, grad_step: Any = None
):
    """``step(params, opt_state, batch) -> (params, opt_state, loss)``: the gradients of the
    batch go to ``tx`` (the collaborative optimizer) as ``samples_per_step`` samples."""
    grad_step = grad_step if grad_step is not None else make_grad_step(graphdef, rest)

    def step(params: Any, opt_state: Any, batch: dict) -> tuple[Any, Any, jax.Array]:
        grads, loss = grad_step(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params, batch_size=samples_per_step)
        return _apply_updates(params, updates), opt_state, loss

    return step


# ------------------------------------------------------------------------------ saving
def flat_params(params: Any) -> dict[str, np.ndarray]:
    """``{"albert.embeddings.LayerNorm.bias": array, ...}`` on the host: every path element but
    the Variable's own ``.value`` attribute (a module named ``value``, the V projection, stays:
    ``attention.value.kernel``; these are the torch names but for the leaf's)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(params)):
        if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
            path = path[:-1]
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        out[".".join(names)] = np.asarray(leaf)
    return out


def _legacy_name(name: str) -> str:
    """The name checkpoints written before the fix above used: no element named ``value``."""
    return ".".join(n for n in name.split(".") if n != "value")


def unflat_params(template: Any, flat: dict[str, np.ndarray]) -> Any:
    """Fill a params pytree shaped like ``template`` from :func:`flat_params` output (or from
    an older checkpoint's, which dropped the V projection's ``value`` from its names)."""
    names = list(flat_params(jax.eval_shape(lambda: template)).keys())
    leaves, treedef = jax.tree.flatten(template)
    if len(names) != len(leaves):
        raise ValueError("checkpoint does not match the model")
    if any(n not in flat for n in names) and all(_legacy_name(n) in flat for n in names):
        names_in_flat = [_legacy_name(n) for n in names]
    else:
        names_in_flat = names
    missing = [n for n in names_in_flat if n not in flat]
    if missing:
        raise ValueError(f"checkpoint lacks {missing[:3]}...")
    new = []
    for name, leaf in zip(names_in_flat, leaves, strict=True):
        got = np.asarray(flat[name])
        if got.shape != np.shape(leaf):
            raise ValueError(f"{name}: checkpoint shape {got.shape}, model {np.shape(leaf)}")
        new.append(jnp.asarray(got, dtype=jnp.result_type(leaf)))
    return jax.tree.unflatten(treedef, new)
