"""ALBERT (Lan et al., 2019) in Flax NNX, numerically equal to Hugging Face's PyTorch ALBERT.

ALBERT is BERT with two parameter savings:

* a factorised embedding: tokens are embedded in a small width E and mapped up to the hidden
  width H by one dense layer (``embedding_hidden_mapping_in``);
* cross-layer sharing: the L layer applications use only G groups of weights. Application i
  runs group ``int(i / (L / G))``, and each group is ``inner_group_num`` layers run in turn.
  sahajBERT uses one group of one layer, applied 24 times.

Attribute names follow the PyTorch parameter names of ``transformers`` (``LayerNorm``,
``albert_layer_groups``...), so a checkpoint maps one-to-one (see ``models.hf``).

Dropout: every call takes ``deterministic``. ``None`` (the default) follows the modules' mode,
which starts as evaluation (no dropout) and is switched by ``model.train()`` / ``model.eval()``;
``True`` / ``False`` override it for that call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

IGNORE_INDEX = -100  # label value that the losses skip, as in PyTorch / transformers

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    # gelu_new: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the tanh approximation
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # exact, with erf
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class AlbertConfig:
    """The fields and defaults of ``transformers.AlbertConfig``, plus speed options.

    ``dtype`` is the compute dtype (e.g. ``"bfloat16"``), ``param_dtype`` that of the stored
    (master) weights. ``remat`` recomputes each layer's activations in the backward pass
    instead of keeping them, trading compute for memory.
    """

    vocab_size: int = 30000
    embedding_size: int = 128
    hidden_size: int = 4096
    num_hidden_layers: int = 12
    num_hidden_groups: int = 1
    num_attention_heads: int = 64
    intermediate_size: int = 16384
    inner_group_num: int = 1
    hidden_act: str = "gelu_new"
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    classifier_dropout_prob: float = 0.1
    pad_token_id: int = 0
    dtype: str = "float32"  # also accepts a dtype (jnp.bfloat16), stored by name
    param_dtype: str = "float32"
    remat: bool = False
    # jax.nn.dot_product_attention's implementation off CPU: None (XLA picks), "xla", "cudnn"
    attention: str | None = None

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} not in {sorted(ACTIVATIONS)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if not 1 <= self.num_hidden_groups <= self.num_hidden_layers:
            raise ValueError("need 1 <= num_hidden_groups <= num_hidden_layers")
        if self.attention not in (None, "xla", "cudnn"):
            raise ValueError(f"attention must be None, 'xla' or 'cudnn', got {self.attention!r}")
        for name in "dtype", "param_dtype":  # canonical names: "bfloat16", never a class
            object.__setattr__(self, name, jnp.dtype(getattr(self, name)).name)

    @classmethod
    def sahajbert(cls, **overrides) -> AlbertConfig:
        """sahajBERT: ALBERT-large with a 32k vocabulary; one layer serves all 24 applications."""
        fields = dict(
            vocab_size=32000,
            embedding_size=128,
            hidden_size=1024,
            num_hidden_layers=24,
            num_hidden_groups=1,
            inner_group_num=1,
            num_attention_heads=16,
            intermediate_size=4096,
            max_position_embeddings=512,
        )
        return cls(**{**fields, **overrides})

    @classmethod
    def tiny(cls, **overrides) -> AlbertConfig:
        """sahajBERT's shape scaled down to run tests and demos quickly on a CPU."""
        fields = dict(
            vocab_size=1024,
            embedding_size=32,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=128,
        )
        return cls(**{**fields, **overrides})

    def group_of_layer(self, i: int) -> int:
        """The weight group that layer application ``i`` runs (transformers' formula)."""
        return int(i / (self.num_hidden_layers / self.num_hidden_groups))


# ----------------------------------------------------------------------------- building blocks


def _contract_last_first(x, w, precision):
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _linear_dot(x, w, precision=None):
    """``x @ w`` (x [..., in], w [in, out]) whose weight gradient XLA:CPU computes fast.

    Autodiff gives the weight gradient as ``dot(x, dy)`` contracting the leading (token) axis
    of both, which XLA:CPU runs on a generic path at about two thirds of the speed of a plain
    matrix product, after copying ``dy`` transposed. Transposing the smaller of ``x`` and ``dy``
    first (kept materialised by an optimization barrier) turns it into a plain product. Other
    platforms take autodiff's form: their GEMMs read transposed operands for free. The values
    are the same either way.
    """
    return _contract_last_first(x, w, precision)


def _linear_dot_fwd(x, w, precision):
    return _contract_last_first(x, w, precision), (x, w)


def _plain_matmul(a, b, precision):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision)


def _linear_dot_bwd(precision, residuals, dy):
    x, w = residuals
    dx = jax.lax.dot_general(dy, w, (((dy.ndim - 1,), (1,)), ((), ())), precision=precision)
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    barrier = jax.lax.optimization_barrier

    def transposed_first(x2, dy2):
        # The barriers keep XLA from folding the transposes back into the product.
        if x2.shape[1] <= dy2.shape[1]:
            return barrier(_plain_matmul(barrier(x2.T), dy2, precision))
        return barrier(_plain_matmul(barrier(dy2.T), x2, precision)).T

    def as_autodiff(x2, dy2):
        return jax.lax.dot_general(x2, dy2, (((0,), (0,)), ((), ())), precision=precision)

    dw = jax.lax.platform_dependent(x2, dy2, cpu=transposed_first, default=as_autodiff)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_linear_dot.defvjp(_linear_dot_fwd, _linear_dot_bwd)


def _dense_dot_general(lhs, rhs, dimension_numbers, precision=None, **kwargs):
    """``nnx.Linear``'s product through ``_linear_dot``; anything unusual goes to lax."""
    if dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ())) and not any(kwargs.values()):
        return _linear_dot(lhs, rhs, precision)
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, **kwargs)


def _dense(cfg: AlbertConfig, d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        kernel_init=nnx.initializers.normal(cfg.initializer_range),
        dot_general=_dense_dot_general,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        rngs=rngs,
    )


def _layer_norm(cfg: AlbertConfig, width: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # Statistics are taken in float32 even for bf16 compute; the two-pass variance is what
    # PyTorch computes, and keeps float32 agreement at 1e-5.
    return nnx.LayerNorm(
        width,
        epsilon=cfg.layer_norm_eps,
        use_fast_variance=False,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        rngs=rngs,
    )


def _embed(cfg: AlbertConfig, n: int, width: int, rngs: nnx.Rngs, pad: int | None = None):
    normal = nnx.initializers.normal(cfg.initializer_range)

    def init(key, shape, dtype):
        table = normal(key, shape, dtype)
        return table if pad is None else table.at[pad].set(0)  # as torch's padding_idx

    return nnx.Embed(
        n, width, embedding_init=init, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs
    )


def _dropout(rate: float, rngs: nnx.Rngs) -> nnx.Dropout:
    return nnx.Dropout(rate, deterministic=True, rngs=rngs)  # model.train() turns it on


class AlbertEmbeddings(nnx.Module):
    """Word + position + token-type embeddings (width E), LayerNorm, dropout."""

    def __init__(self, cfg: AlbertConfig, *, rngs: nnx.Rngs):
        e = cfg.embedding_size
        self.word_embeddings = _embed(cfg, cfg.vocab_size, e, rngs, pad=cfg.pad_token_id)
        self.pad_token_id = cfg.pad_token_id
        self.position_embeddings = _embed(cfg, cfg.max_position_embeddings, e, rngs)
        self.token_type_embeddings = _embed(cfg, cfg.type_vocab_size, e, rngs)
        self.LayerNorm = _layer_norm(cfg, e, rngs)
        self.dropout = _dropout(cfg.hidden_dropout_prob, rngs)

    def __call__(self, input_ids, token_type_ids, *, deterministic=None):
        seq = input_ids.shape[1]
        if seq > self.position_embeddings.num_embeddings:  # a lookup past the table would clamp
            raise ValueError(
                f"sequence of {seq} > {self.position_embeddings.num_embeddings} positions"
            )
        positions = jnp.arange(seq)[None, :]
        words = self.word_embeddings(input_ids)
        # As torch's padding_idx: the pad row's value is used, but lookups never train it.
        is_pad = (input_ids == self.pad_token_id)[..., None]
        words = jnp.where(is_pad, jax.lax.stop_gradient(words), words)
        x = words + self.position_embeddings(positions) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x), deterministic=deterministic)


class AlbertAttention(nnx.Module):
    """Multi-head self-attention with residual and post-LayerNorm: LN(x + dense(attn(x)))."""

    def __init__(self, cfg: AlbertConfig, *, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.implementation = cfg.attention
        self.query = _dense(cfg, h, h, rngs)
        self.key = _dense(cfg, h, h, rngs)
        self.value = _dense(cfg, h, h, rngs)
        self.dense = _dense(cfg, h, h, rngs)
        self.LayerNorm = _layer_norm(cfg, h, rngs)
        self.attention_dropout = _dropout(cfg.attention_probs_dropout_prob, rngs)
        self.output_dropout = _dropout(cfg.hidden_dropout_prob, rngs)

    def __call__(self, x, mask, *, deterministic=None):
        """x: [B, T, H]; mask: bool [B, 1, 1, T], True where a key may be attended, or None."""
        b, t, h = x.shape

        def heads(y):
            return y.reshape(b, t, self.num_heads, h // self.num_heads)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        drop = self.attention_dropout
        if drop.rate == 0 or (drop.deterministic if deterministic is None else deterministic):
            context = jax.lax.platform_dependent(
                q,
                k,
                v,
                cpu=functools.partial(_heads_first_attention, mask=mask),
                default=functools.partial(
                    jax.nn.dot_product_attention, mask=mask, implementation=self.implementation
                ),
            )  # scale = head_dim^-0.5
        else:
            context = self._attention_with_dropout(q, k, v, mask, deterministic)
        out = self.dense(context.reshape(b, t, h))
        out = self.output_dropout(out, deterministic=deterministic)
        return self.LayerNorm(x + out)

    def _attention_with_dropout(self, q, k, v, mask, deterministic):
        # jax.nn.dot_product_attention has no dropout on the probabilities: spell it out.
        scores = jnp.einsum("btnd,bsnd->bnts", q, k, preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = self.attention_dropout(probs, deterministic=deterministic).astype(v.dtype)
        return jnp.einsum("bnts,bsnd->btnd", probs, v)


def _heads_first_attention(q, k, v, *, mask):
    """``jax.nn.dot_product_attention`` (q, k, v: [B, T, N, D]) for XLA:CPU, where it runs
    forward and backward about a quarter faster with the heads moved ahead of the positions
    once, so that both products are plain batched matrix products."""
    q, k, v = (y.transpose(0, 2, 1, 3) for y in (q, k, v))  # [B, N, T, D]
    scores = jnp.matmul(q, k.swapaxes(-1, -2), preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.matmul(probs, v).transpose(0, 2, 1, 3)


class AlbertLayer(nnx.Module):
    """Attention, then the feed-forward block LN(a + W2 act(W1 a)).

    transformers' AlbertLayer owns a dropout that it never applies after the FFN; neither do we.
    """

    def __init__(self, cfg: AlbertConfig, *, rngs: nnx.Rngs):
        self.attention = AlbertAttention(cfg, rngs=rngs)
        self.ffn = _dense(cfg, cfg.hidden_size, cfg.intermediate_size, rngs)
        self.ffn_output = _dense(cfg, cfg.intermediate_size, cfg.hidden_size, rngs)
        self.full_layer_layer_norm = _layer_norm(cfg, cfg.hidden_size, rngs)
        self.activation = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x, mask, *, deterministic=None):
        a = self.attention(x, mask, deterministic=deterministic)
        return self.full_layer_layer_norm(self.ffn_output(self.activation(self.ffn(a))) + a)


class AlbertLayerGroup(nnx.Module):
    """One group of shared weights: ``inner_group_num`` layers run in turn."""

    def __init__(self, cfg: AlbertConfig, *, rngs: nnx.Rngs):
        self.albert_layers = nnx.List(
            [AlbertLayer(cfg, rngs=rngs) for _ in range(cfg.inner_group_num)]
        )


def _run_layer(layer: AlbertLayer, x, mask, deterministic):
    return layer(x, mask, deterministic=deterministic)


_run_layer_remat = nnx.remat(_run_layer, static_argnums=(3,))


class AlbertTransformer(nnx.Module):
    """Map E -> H, then ``num_hidden_layers`` applications of the shared layer groups."""

    def __init__(self, cfg: AlbertConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embedding_hidden_mapping_in = _dense(cfg, cfg.embedding_size, cfg.hidden_size, rngs)
        self.albert_layer_groups = nnx.List(
            [AlbertLayerGroup(cfg, rngs=rngs) for _ in range(cfg.num_hidden_groups)]
        )

    def __call__(self, x, mask, *, deterministic=None):
        cfg = self.config
        run = _run_layer_remat if cfg.remat else _run_layer
        x = self.embedding_hidden_mapping_in(x)
        # A Python loop: the compiled graph holds every application (weights shared, not copied).
        for i in range(cfg.num_hidden_layers):
            for layer in self.albert_layer_groups[cfg.group_of_layer(i)].albert_layers:
                x = run(layer, x, mask, deterministic)
        return x


# ----------------------------------------------------------------------------- models and heads


class AlbertModelOutput(NamedTuple):
    last_hidden_state: jax.Array  # [B, T, H]
    pooler_output: jax.Array | None  # [B, H]: tanh(dense(h[:, 0])), None without a pooler


class AlbertModel(nnx.Module):
    """The ALBERT encoder: embeddings, shared transformer layers, optional pooler."""

    def __init__(self, config: AlbertConfig, *, add_pooling_layer: bool = True, rngs: nnx.Rngs):
        self.config = config
        self.embeddings = AlbertEmbeddings(config, rngs=rngs)
        self.encoder = AlbertTransformer(config, rngs=rngs)
        h = config.hidden_size
        self.pooler = _dense(config, h, h, rngs) if add_pooling_layer else None

    def __call__(
        self, input_ids, attention_mask=None, token_type_ids=None, *, deterministic=None
    ) -> AlbertModelOutput:
        """input_ids, attention_mask (1 = token, 0 = padding), token_type_ids: int [B, T]."""
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        mask = None if attention_mask is None else attention_mask[:, None, None, :].astype(bool)
        x = self.embeddings(input_ids, token_type_ids, deterministic=deterministic)
        h = self.encoder(x, mask, deterministic=deterministic)
        pooled = None if self.pooler is None else jnp.tanh(self.pooler(h[:, 0]))
        return AlbertModelOutput(h, pooled)


class AlbertMLMHead(nnx.Module):
    """dense H -> E, act, LayerNorm, then the decoder: the word embeddings (tied) + own bias."""

    def __init__(self, cfg: AlbertConfig, *, rngs: nnx.Rngs):
        self.dense = _dense(cfg, cfg.hidden_size, cfg.embedding_size, rngs)
        self.LayerNorm = _layer_norm(cfg, cfg.embedding_size, rngs)
        self.bias = nnx.Param(jnp.zeros((cfg.vocab_size,), jnp.dtype(cfg.param_dtype)))
        self.activation = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, h, word_embeddings: nnx.Embed):
        e = self.LayerNorm(self.activation(self.dense(h)))
        # e @ table.T in the compute dtype (as word_embeddings.attend), with _linear_dot's gradient
        e, table = word_embeddings.promote_dtype(
            (e, word_embeddings.embedding[...]), dtype=word_embeddings.dtype
        )
        logits = _linear_dot(e, table.T)
        return logits + self.bias[...].astype(logits.dtype)


class AlbertSOPHead(nnx.Module):
    """Sentence-order prediction: dropout, then dense H -> 2 on the pooled output."""

    def __init__(self, cfg: AlbertConfig, *, rngs: nnx.Rngs):
        self.dropout = _dropout(cfg.classifier_dropout_prob, rngs)
        self.classifier = _dense(cfg, cfg.hidden_size, 2, rngs)

    def __call__(self, pooled, *, deterministic=None, rngs=None):
        """``rngs``: a key for the dropout mask (else the module's own stream)."""
        return self.classifier(self.dropout(pooled, deterministic=deterministic, rngs=rngs))


class AlbertForPreTrainingOutput(NamedTuple):
    prediction_logits: jax.Array  # [B, T, vocab]
    sop_logits: jax.Array  # [B, 2]


class AlbertForPreTraining(nnx.Module):
    """ALBERT with its pretraining heads: masked-LM and sentence-order prediction."""

    def __init__(self, config: AlbertConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.albert = AlbertModel(config, rngs=rngs)
        self.predictions = AlbertMLMHead(config, rngs=rngs)
        self.sop_classifier = AlbertSOPHead(config, rngs=rngs)

    def __call__(
        self, input_ids, attention_mask=None, token_type_ids=None, *, deterministic=None
    ) -> AlbertForPreTrainingOutput:
        h, pooled = self.albert(
            input_ids, attention_mask, token_type_ids, deterministic=deterministic
        )
        return AlbertForPreTrainingOutput(
            prediction_logits=self.predictions(h, self.albert.embeddings.word_embeddings),
            sop_logits=self.sop_classifier(pooled, deterministic=deterministic),
        )


class ClassifierOutput(NamedTuple):
    logits: jax.Array


class AlbertForTokenClassification(nnx.Module):
    """Per-token labels (e.g. NER): dropout + dense H -> num_labels on every position."""

    def __init__(self, config: AlbertConfig, num_labels: int, *, rngs: nnx.Rngs):
        self.config = config
        self.albert = AlbertModel(config, add_pooling_layer=False, rngs=rngs)
        self.dropout = _dropout(config.classifier_dropout_prob, rngs)
        self.classifier = _dense(config, config.hidden_size, num_labels, rngs)

    def __call__(
        self, input_ids, attention_mask=None, token_type_ids=None, *, deterministic=None
    ) -> ClassifierOutput:
        h = self.albert(input_ids, attention_mask, token_type_ids, deterministic=deterministic)
        return ClassifierOutput(self.classifier(self.dropout(h[0], deterministic=deterministic)))


class AlbertForSequenceClassification(nnx.Module):
    """One label per sequence: dropout + dense H -> num_labels on the pooled output."""

    def __init__(self, config: AlbertConfig, num_labels: int, *, rngs: nnx.Rngs):
        self.config = config
        self.albert = AlbertModel(config, rngs=rngs)
        self.dropout = _dropout(config.classifier_dropout_prob, rngs)
        self.classifier = _dense(config, config.hidden_size, num_labels, rngs)

    def __call__(
        self, input_ids, attention_mask=None, token_type_ids=None, *, deterministic=None
    ) -> ClassifierOutput:
        out = self.albert(input_ids, attention_mask, token_type_ids, deterministic=deterministic)
        return ClassifierOutput(self.classifier(self.dropout(out[1], deterministic=deterministic)))


def load_backbone(dst: nnx.Module, src: nnx.Module) -> None:
    """Copy the encoder weights of ``src.albert`` (e.g. a pretrained model) into ``dst.albert``.

    The pooler is copied when both have one; heads are left as they are.
    """
    params = nnx.to_pure_dict(nnx.state(src.albert, nnx.Param))
    if dst.albert.pooler is None:
        params.pop("pooler", None)
    target = nnx.state(dst.albert, nnx.Param)
    nnx.replace_by_pure_dict(target, params)
    nnx.update(dst.albert, target)


def count_params(model: nnx.Module) -> int:
    """Number of trainable parameters (works on abstract models from ``nnx.eval_shape`` too)."""
    return sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ----------------------------------------------------------------------------- losses


def _mean_cross_entropy(logits, labels):
    """Cross-entropy averaged over labels != IGNORE_INDEX (0 when there are none), in float32."""
    valid = labels != IGNORE_INDEX
    nll = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), jnp.where(valid, labels, 0)
    )
    return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def masked_lm_loss(prediction_logits, mlm_labels):
    """Mean cross-entropy over the positions whose label is not -100."""
    return _mean_cross_entropy(prediction_logits, mlm_labels)


def sentence_order_loss(sop_logits, sop_labels):
    """Mean cross-entropy of the sentence-order labels (1 = segments swapped)."""
    return _mean_cross_entropy(sop_logits, sop_labels)


def pretraining_loss(output: AlbertForPreTrainingOutput, mlm_labels, sop_labels):
    """MLM loss + SOP loss, as transformers' AlbertForPreTraining (where the MLM loss of a batch
    with no labelled position would be NaN, here it is 0)."""
    return masked_lm_loss(output.prediction_logits, mlm_labels) + sentence_order_loss(
        output.sop_logits, sop_labels
    )


MLM_CAPACITY = 0.25  # share of the positions the training loss runs the MLM head on


def _labelled_mlm_loss(head: AlbertMLMHead, words: nnx.Embed, h, labels, capacity: float):
    """``masked_lm_loss(head(h, words), labels)``, with the head run only where labels are.

    The head (a dense layer, LayerNorm and the vocabulary-wide decoder, a quarter of a small
    model's step) is spent on the ~15% labelled positions, gathered into ``ceil(capacity * T)``
    slots per row, as the original BERT and ALBERT code does with ``masked_lm_positions``. A
    batch with a row holding more labels than that takes the full-width path (``lax.cond``:
    only one branch runs), so the loss and its gradients are the same either way.
    """
    t = labels.shape[1]
    k = min(t, math.ceil(capacity * t))
    if k >= t:
        return masked_lm_loss(head(h, words), labels)
    valid = labels != IGNORE_INDEX

    def gathered(h, labels):
        slots = jnp.argsort(~valid, axis=1, stable=True)[:, :k]  # labelled positions first
        h_k = jnp.take_along_axis(h, slots[..., None], axis=1)
        return masked_lm_loss(head(h_k, words), jnp.take_along_axis(labels, slots, axis=1))

    def full(h, labels):
        return masked_lm_loss(head(h, words), labels)

    fits = jnp.max(jnp.sum(valid, axis=1)) <= k
    return jax.lax.cond(fits, gathered, full, h, labels)


def pretraining_batch_loss(
    model: AlbertForPreTraining,
    batch: dict,
    deterministic=False,
    mlm_capacity: float = MLM_CAPACITY,
    dropout_key: jax.Array | None = None,
):
    """``pretraining_loss`` of a batch dict with keys ``input_ids``, ``mlm_labels``,
    ``sop_labels`` and optionally ``attention_mask`` and ``token_type_ids``. Training mode
    (dropout on) unless ``deterministic``. The MLM head runs only on the labelled positions
    (see ``_labelled_mlm_loss``; ``mlm_capacity=1`` runs it everywhere); the value is the same.
    ``dropout_key`` draws the SOP head's dropout mask: a step that merges the model afresh from
    its state must pass a new one each time, or every step drops the same units.
    """
    h, pooled = model.albert(
        batch["input_ids"],
        batch.get("attention_mask"),
        batch.get("token_type_ids"),
        deterministic=deterministic,
    )
    words = model.albert.embeddings.word_embeddings
    mlm = _labelled_mlm_loss(model.predictions, words, h, batch["mlm_labels"], mlm_capacity)
    sop_logits = model.sop_classifier(pooled, deterministic=deterministic, rngs=dropout_key)
    return mlm + sentence_order_loss(sop_logits, batch["sop_labels"])
