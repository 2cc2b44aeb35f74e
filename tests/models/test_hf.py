"""The Flax ALBERT against transformers' PyTorch one, with the same weights."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from models.albert import AlbertConfig, count_params  # noqa: E402
from models.hf import albert_from_torch, albert_to_torch, config_from_hf  # noqa: E402

# Widths of 64 and up: XLA:CPU compiles smaller matmuls far more slowly (3-5x here).
SMALL = dict(
    vocab_size=99,
    embedding_size=32,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    intermediate_size=96,
    max_position_embeddings=40,
    type_vocab_size=2,
)
CONFIGS = {
    "shared-gelu_new": dict(SMALL),
    # 6 applications over 3 groups of 2 inner layers: groups 0,0,1,1,2,2.
    "groups-gelu": dict(
        SMALL, num_hidden_layers=6, num_hidden_groups=3, inner_group_num=2, hidden_act="gelu"
    ),
    # 5 over 2 groups: int(i / 2.5) gives groups 0,0,0,1,1.
    "uneven-relu": dict(SMALL, num_hidden_layers=5, num_hidden_groups=2, hidden_act="relu"),
}


def torch_albert(fields: dict, attn: str = "eager", seed: int = 0):
    """A transformers AlbertForPreTraining with random weights larger than its init's, so that
    activations and logits are of order one and a mismatch shows."""
    torch.manual_seed(seed)
    cfg = transformers.AlbertConfig(**fields, attn_implementation=attn)
    model = transformers.AlbertForPreTraining(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm_scale = name.endswith(("LayerNorm.weight", "layer_norm.weight"))
            p.normal_(1.0 if is_norm_scale else 0.0, 0.15)
    return model


def inputs(vocab: int, batch: int = 3, seq: int = 17, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (batch, seq))
    mask = np.ones((batch, seq), np.int64)
    mask[0, 11:] = 0  # right padding
    mask[2, 4:] = 0
    types = np.zeros((batch, seq), np.int64)
    types[:, 6:] = 1
    types *= mask
    return ids, mask, types


def run_torch(model, ids, mask, types):
    with torch.no_grad():
        out = model(
            torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types)
        )
    return out.prediction_logits.numpy(), out.sop_logits.numpy()


@nnx.jit
def run_flax(model, ids, mask, types):
    out = model(ids, mask, types)
    return out.prediction_logits, out.sop_logits


def assert_close(actual, expected, tol=1e-5):
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_allclose(np.asarray(a), e, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_flax_matches_torch_and_round_trips(name):
    fields = CONFIGS[name]
    eager = torch_albert(fields, attn="eager")
    ids, mask, types = inputs(fields["vocab_size"])
    expected = run_torch(eager, ids, mask, types)
    assert np.abs(expected[0]).max() > 1.0  # logits large enough for 1e-5 to mean something

    model = albert_from_torch(eager)
    assert model.config == config_from_hf(eager.config)
    n_torch = sum(p.numel() for p in eager.parameters())  # tied decoder counted once
    assert count_params(model) == n_torch
    assert_close(run_flax(model, ids, mask, types), expected)

    # torch's attention implementation must not matter: sdpa agrees with eager, and with us.
    sdpa = torch_albert(fields, attn="sdpa")
    sdpa.load_state_dict(eager.state_dict())
    assert_close(run_torch(sdpa, ids, mask, types), expected)

    # Back to torch: the same weights, the same outputs.
    back = albert_to_torch(model)
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(back.state_dict()[key], value, rtol=0, atol=0)
    assert_close(run_torch(back, ids, mask, types), expected)


@pytest.mark.parametrize(("rate", "gathered"), [(0.15, True), (0.5, False)])
def test_gradients_match_torch(rate: float, gathered: bool):
    """The training signal, not just the forward: the pretraining loss and the gradient of
    every weight agree with torch's autograd (our dense layers and attention have their own
    CPU code paths for speed; the tied decoder's gradient adds two contributions; as torch's
    padding_idx, the padding row learns nothing from the lookups; the MLM head runs on the
    labelled positions only when every row's labels fit its slots, else on all of them)."""
    from flax.traverse_util import flatten_dict

    from models.albert import MLM_CAPACITY, pretraining_batch_loss
    from models.hf import _torch_name

    fields = CONFIGS["shared-gelu_new"]
    eager = torch_albert(fields, attn="eager")
    ids, mask, types = inputs(fields["vocab_size"])
    ids = np.where(mask == 1, ids, 0)  # padding positions hold the pad id, as in real batches
    rng = np.random.default_rng(1)
    mlm = np.where((rng.random(ids.shape) < rate) & (mask == 1), ids, -100)
    slots = math.ceil(MLM_CAPACITY * ids.shape[1])
    assert ((mlm != -100).sum(1).max() <= slots) == gathered  # the path this case is for
    sop = np.array([0, 1, 1])
    out = eager(
        torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        token_type_ids=torch.tensor(types),
        labels=torch.tensor(mlm),
        sentence_order_label=torch.tensor(sop),
    )
    out.loss.backward()
    expected = {name: p.grad.numpy() for name, p in eager.named_parameters()}

    model = albert_from_torch(eager)
    batch = dict(
        input_ids=ids, attention_mask=mask, token_type_ids=types, mlm_labels=mlm, sop_labels=sop
    )
    loss_fn = lambda m, b: pretraining_batch_loss(m, b, deterministic=True)  # noqa: E731
    loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, batch)
    np.testing.assert_allclose(float(loss), out.loss.item(), rtol=1e-5)
    flat = flatten_dict(nnx.to_pure_dict(grads))
    assert len(flat) == len(expected)
    for path, g in flat.items():
        g = np.asarray(g).T if path[-1] == "kernel" else np.asarray(g)
        np.testing.assert_allclose(g, expected[_torch_name(path)], rtol=1e-4, atol=1e-5)


def test_round_trip_from_flax_keeps_every_weight():
    model = albert_from_torch(torch_albert(CONFIGS["groups-gelu"]))
    again = albert_from_torch(albert_to_torch(model))
    a, b = nnx.state(model, nnx.Param), nnx.state(again, nnx.Param)
    for x, y in zip(nnx.to_flat_state(a), nnx.to_flat_state(b), strict=True):
        assert x[0] == y[0]
        np.testing.assert_array_equal(np.asarray(x[1][...]), np.asarray(y[1][...]))


def test_config_conversion_and_overrides():
    hf = transformers.AlbertConfig(**CONFIGS["groups-gelu"])
    cfg = config_from_hf(hf, dtype="bfloat16", remat=True)
    assert (cfg.num_hidden_groups, cfg.inner_group_num, cfg.hidden_act) == (3, 2, "gelu")
    assert (cfg.dtype, cfg.remat) == ("bfloat16", True)
    sahaj = config_from_hf(transformers.AlbertConfig(**_sahajbert_hf_fields()))
    assert sahaj == AlbertConfig.sahajbert()


def test_mismatched_torch_model_is_refused():
    eager = torch_albert(SMALL)
    eager.predictions.extra = torch.nn.Linear(2, 2)  # a weight we would not know where to put
    with pytest.raises(ValueError, match="unused"):
        albert_from_torch(eager)


def _sahajbert_hf_fields():
    return dict(
        vocab_size=32000,
        embedding_size=128,
        hidden_size=1024,
        num_hidden_layers=24,
        num_hidden_groups=1,
        inner_group_num=1,
        num_attention_heads=16,
        intermediate_size=4096,
        hidden_act="gelu_new",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.1,
        layer_norm_eps=1e-12,
        max_position_embeddings=512,
        type_vocab_size=2,
        pad_token_id=0,
        initializer_range=0.02,
    )
