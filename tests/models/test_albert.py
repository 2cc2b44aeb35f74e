"""The Flax NNX ALBERT: shapes, parameter counts, masking, dropout, dtypes, losses, training."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models.albert import (
    IGNORE_INDEX,
    AlbertConfig,
    AlbertForPreTraining,
    AlbertForPreTrainingOutput,
    AlbertForSequenceClassification,
    AlbertForTokenClassification,
    AlbertModel,
    count_params,
    load_backbone,
    masked_lm_loss,
    pretraining_loss,
    sentence_order_loss,
)
from models.sharding import make_grad_step, make_train_step

TINY = AlbertConfig.tiny()


def make_batch(cfg: AlbertConfig, batch=4, seq=32, seed=0) -> dict:
    """A pretraining batch: two segments, right padding, ~15% of real tokens labelled."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, cfg.vocab_size, (batch, seq)).astype(np.int32)
    lengths = rng.integers(seq // 2, seq + 1, batch)
    lengths[0] = seq
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
    types = ((np.arange(seq)[None, :] >= lengths[:, None] // 2) & (mask == 1)).astype(np.int32)
    ids = np.where(mask == 1, ids, cfg.pad_token_id).astype(np.int32)
    labelled = (rng.random((batch, seq)) < 0.15) & (mask == 1)
    labelled[:, 1] = True  # at least one per row
    mlm = np.where(labelled, ids, IGNORE_INDEX).astype(np.int32)
    sop = rng.integers(0, 2, batch).astype(np.int32)
    return dict(
        input_ids=ids, attention_mask=mask, token_type_ids=types, mlm_labels=mlm, sop_labels=sop
    )


def _forward(model, batch, deterministic=None):
    ids, mask, types = batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]
    return model(ids, mask, types, deterministic=deterministic)


forward = nnx.jit(_forward)


def test_parameter_counts_at_sahajbert_config():
    cfg = AlbertConfig.sahajbert()
    pretraining = nnx.eval_shape(lambda: AlbertForPreTraining(cfg, rngs=nnx.Rngs(0)))
    encoder = nnx.eval_shape(lambda: AlbertModel(cfg, rngs=nnx.Rngs(0)))
    assert count_params(pretraining) == 18_105_474
    assert count_params(encoder) == 17_939_968


def test_presets_and_validation():
    sahaj = AlbertConfig.sahajbert()
    assert (sahaj.vocab_size, sahaj.hidden_size, sahaj.num_hidden_layers) == (32000, 1024, 24)
    assert (sahaj.num_hidden_groups, sahaj.inner_group_num, sahaj.hidden_act) == (1, 1, "gelu_new")
    assert (sahaj.classifier_dropout_prob, sahaj.hidden_dropout_prob) == (0.1, 0.0)
    assert dataclasses.replace(TINY, vocab_size=3000).vocab_size == 3000
    assert AlbertConfig.tiny(dtype=jnp.bfloat16) == AlbertConfig.tiny(dtype="bfloat16")
    assert AlbertConfig.tiny(dtype=jnp.bfloat16).dtype == "bfloat16"
    with pytest.raises(ValueError, match="hidden_act"):
        AlbertConfig.tiny(hidden_act="swish")
    with pytest.raises(ValueError, match="multiple"):
        AlbertConfig.tiny(num_attention_heads=3)
    with pytest.raises(ValueError, match="groups"):
        AlbertConfig.tiny(num_hidden_groups=5)
    with pytest.raises(TypeError):
        AlbertConfig.tiny(dtype="float33")


def test_layer_to_group_schedule():
    def schedule(layers, groups):
        cfg = AlbertConfig.tiny(num_hidden_layers=layers, num_hidden_groups=groups)
        return [cfg.group_of_layer(i) for i in range(layers)]

    assert schedule(24, 1) == [0] * 24
    assert schedule(6, 3) == [0, 0, 1, 1, 2, 2]
    assert schedule(5, 2) == [0, 0, 0, 1, 1]
    assert schedule(4, 4) == [0, 1, 2, 3]


def test_shapes_and_that_padding_is_ignored():
    model = AlbertForPreTraining(TINY, rngs=nnx.Rngs(0))
    batch = make_batch(TINY)
    out = forward(model, batch)
    assert out.prediction_logits.shape == (4, 32, TINY.vocab_size)
    assert out.sop_logits.shape == (4, 2)
    assert out.prediction_logits.dtype == jnp.float32

    # Whatever sits at padded positions changes nothing at the real ones.
    noisy = dict(batch, input_ids=np.where(batch["attention_mask"] == 1, batch["input_ids"], 7))
    assert (noisy["input_ids"] != batch["input_ids"]).any()
    again = forward(model, noisy)
    real = batch["attention_mask"] == 1
    np.testing.assert_allclose(
        again.prediction_logits[real], out.prediction_logits[real], rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(again.sop_logits, out.sop_logits, rtol=1e-5, atol=1e-5)

    with pytest.raises(ValueError, match="positions"):
        model(np.zeros((1, TINY.max_position_embeddings + 1), np.int32))

    # No mask and no token types: the same as an all-ones mask and all-zero types.
    ids = batch["input_ids"]
    plain = nnx.jit(lambda m, i: m(i))(model, ids)
    full = forward(model, dict(batch, attention_mask=np.ones_like(ids), token_type_ids=0 * ids))
    np.testing.assert_allclose(plain.prediction_logits, full.prediction_logits, atol=1e-5)


def test_weights_are_tied_and_padding_row_starts_at_zero():
    model = AlbertForPreTraining(TINY, rngs=nnx.Rngs(0))
    table = model.albert.embeddings.word_embeddings.embedding[...]
    assert not np.asarray(table[TINY.pad_token_id]).any()
    assert np.asarray(table[TINY.pad_token_id + 1]).any()
    # The decoder is the word-embedding table: no separate [vocab, E] parameter exists.
    shapes = [p.shape for p in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert shapes.count((TINY.vocab_size, TINY.embedding_size)) == 1


def test_dropout_follows_mode_and_argument():
    cfg = AlbertConfig.tiny(
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, num_hidden_layers=2
    )
    model = AlbertForPreTraining(cfg, rngs=nnx.Rngs(0))
    batch = make_batch(cfg)
    first = forward(model, batch).prediction_logits
    np.testing.assert_array_equal(forward(model, batch).prediction_logits, first)  # eval default

    model.train()
    a, b = forward(model, batch).prediction_logits, forward(model, batch).prediction_logits
    assert not np.allclose(a, first) and not np.allclose(a, b)  # fresh masks each call
    override = nnx.jit(lambda m, b: _forward(m, b, deterministic=True))  # in train mode
    np.testing.assert_array_equal(override(model, batch).prediction_logits, first)
    model.eval()
    np.testing.assert_array_equal(forward(model, batch).prediction_logits, first)


def test_bfloat16_compute_keeps_float32_weights():
    batch = make_batch(TINY)
    ref = forward(AlbertForPreTraining(TINY, rngs=nnx.Rngs(0)), batch)
    model = AlbertForPreTraining(dataclasses.replace(TINY, dtype="bfloat16"), rngs=nnx.Rngs(0))
    assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {np.dtype("float32")}
    out = forward(model, batch)
    assert out.prediction_logits.dtype == jnp.bfloat16
    logits, expected = np.asarray(out.prediction_logits, np.float32), ref.prediction_logits
    assert np.abs(logits - expected).max() < 0.02 * np.abs(expected).max()
    loss = pretraining_loss(out, batch["mlm_labels"], batch["sop_labels"])
    ref_loss = pretraining_loss(ref, batch["mlm_labels"], batch["sop_labels"])
    assert loss.dtype == jnp.float32
    assert abs(float(loss) - float(ref_loss)) < 0.01


@pytest.mark.slow
def test_bfloat16_gradients_agree_with_float32_within_bfloat16_tolerance():
    """Forward and backward in bf16 compute (fp32 master weights) follow the fp32 ones: the
    loss to 1%, every gradient within a tenth of its scale and pointing the same way (cosine
    > 0.99; bf16 keeps 8 mantissa bits). Runs on the tests' backend: here the CPU, the GPU in
    bench/gpu_check.sh."""
    batch = make_batch(TINY)

    def loss(model, batch):
        out = forward(model, batch)
        return pretraining_loss(out, batch["mlm_labels"], batch["sop_labels"])

    grad_step = make_grad_step(loss)
    ref_loss, ref = grad_step(AlbertForPreTraining(TINY, rngs=nnx.Rngs(0)), batch)
    bf16 = AlbertForPreTraining(dataclasses.replace(TINY, dtype="bfloat16"), rngs=nnx.Rngs(0))
    got_loss, got = grad_step(bf16, batch)
    assert abs(float(got_loss) - float(ref_loss)) < 0.01 * abs(float(ref_loss))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        assert g.dtype == r.dtype == jnp.float32  # master-weight gradients
        scale = float(jnp.abs(r).max())
        assert float(jnp.abs(g - r).max()) <= 0.1 * scale + 1e-6, scale
        if scale > 1e-4:  # and they point the same way
            cos = float(jnp.vdot(g, r) / (jnp.linalg.norm(g) * jnp.linalg.norm(r)))
            assert cos > 0.99


@pytest.mark.slow
def test_remat_gives_the_same_loss_and_gradients():
    cfg = AlbertConfig.tiny(num_hidden_layers=2)
    batch = make_batch(cfg)

    def loss(encoder, batch):
        h = encoder(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])[0]
        return jnp.mean(h**2)

    grad_step = make_grad_step(loss)
    plain = AlbertModel(cfg, add_pooling_layer=False, rngs=nnx.Rngs(0))
    remat = AlbertModel(
        dataclasses.replace(cfg, remat=True), add_pooling_layer=False, rngs=nnx.Rngs(0)
    )
    (value, grads), (value_r, grads_r) = grad_step(plain, batch), grad_step(remat, batch)
    np.testing.assert_allclose(value_r, value, rtol=1e-6)
    for g, g_r in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_r), strict=True):
        np.testing.assert_allclose(g_r, g, rtol=1e-4, atol=1e-7)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-3


def test_cpu_products_and_attention_equal_the_plain_ones():
    """The dense product's own weight gradient (transposing x or dy, whichever is smaller) and
    the CPU attention give what autodiff and jax.nn.dot_product_attention give, with padding."""
    from models.albert import _heads_first_attention, _linear_dot

    rng = np.random.default_rng(0)
    for d_in, d_out in (3, 7), (7, 3):
        x = jnp.asarray(rng.standard_normal((2, 5, d_in)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((d_in, d_out)), jnp.float32)
        ours = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(_linear_dot(x, w))), (0, 1)))
        plain = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), (0, 1)))
        for a, b in zip(jax.tree.leaves(ours(x, w)), jax.tree.leaves(plain(x, w)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    q, k, v = (jnp.asarray(rng.standard_normal((2, 6, 3, 4)), jnp.float32) for _ in range(3))
    mask = jnp.asarray(np.arange(6)[None, None, None, :] < np.array([6, 4])[:, None, None, None])

    def loss(attention):
        return lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v, mask=mask)))

    ours = jax.jit(jax.value_and_grad(loss(_heads_first_attention), (0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.value_and_grad(loss(jax.nn.dot_product_attention), (0, 1, 2)))(q, k, v)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_losses_skip_ignored_labels():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    labels = np.full((2, 5), IGNORE_INDEX)
    labels[0, 1], labels[1, 3], labels[1, 4] = 3, 0, 6
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.mean([log_probs[0, 1, 3], log_probs[1, 3, 0], log_probs[1, 4, 6]])
    np.testing.assert_allclose(masked_lm_loss(logits, labels), expected, rtol=1e-5)
    assert float(masked_lm_loss(logits, np.full((2, 5), IGNORE_INDEX))) == 0.0

    sop_logits = rng.normal(size=(2, 2)).astype(np.float32)
    sop_labels = np.array([1, 0])
    sop_log_probs = sop_logits - np.log(np.exp(sop_logits).sum(-1, keepdims=True))
    sop_expected = -np.mean([sop_log_probs[0, 1], sop_log_probs[1, 0]])
    np.testing.assert_allclose(sentence_order_loss(sop_logits, sop_labels), sop_expected, rtol=1e-5)

    total = pretraining_loss(AlbertForPreTrainingOutput(logits, sop_logits), labels, sop_labels)
    np.testing.assert_allclose(total, expected + sop_expected, rtol=1e-5)


@pytest.mark.slow
def test_tiny_model_overfits_a_fixed_batch():
    model = AlbertForPreTraining(TINY, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    train_step = make_train_step()
    batch = make_batch(TINY, batch=8, seq=32)
    losses = [float(train_step(model, optimizer, batch)) for _ in range(40)]
    assert losses[0] > 6.0  # about log(vocab) + log(2) at the start
    assert losses[-1] < 0.3 * losses[0], losses


def test_classification_models_and_backbone_loading():
    pretrained = AlbertForPreTraining(TINY, rngs=nnx.Rngs(0))
    tokens = AlbertForTokenClassification(TINY, num_labels=7, rngs=nnx.Rngs(1))
    sequences = AlbertForSequenceClassification(TINY, num_labels=6, rngs=nnx.Rngs(2))
    assert tokens.albert.pooler is None
    h = TINY.hidden_size
    encoder = count_params(AlbertModel(TINY, rngs=nnx.Rngs(0)))
    assert count_params(tokens) == encoder - (h * h + h) + (h * 7 + 7)
    assert count_params(sequences) == encoder + h * 6 + 6

    load_backbone(tokens, pretrained)
    load_backbone(sequences, pretrained)
    source = nnx.to_pure_dict(nnx.state(pretrained.albert, nnx.Param))
    for model in tokens, sequences:
        loaded = nnx.to_pure_dict(nnx.state(model.albert, nnx.Param))
        if model is tokens:
            assert "pooler" not in loaded
        same = jax.tree.map(np.array_equal, loaded, {k: source[k] for k in loaded})
        assert all(jax.tree.leaves(same))
    batch = make_batch(TINY)
    assert forward(tokens, batch).logits.shape == (4, 32, 7)
    assert forward(sequences, batch).logits.shape == (4, 6)


def test_the_attention_kernel_is_a_choice_of_three():
    assert AlbertConfig.tiny(attention="cudnn").attention == "cudnn"
    with pytest.raises(ValueError, match="attention"):
        AlbertConfig.tiny(attention="flash")
