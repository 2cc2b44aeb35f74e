"""``export``: a checkpoint of the tiny model becomes a transformers directory that
``AutoModelForPreTraining`` / ``AutoTokenizer`` load, with the Flax model's logits; checkpoint
names keep every path element (the V projection is ``attention.value.*``)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from examples.sahajbert import checkpoint, training  # noqa: E402
from examples.sahajbert.__main__ import main  # noqa: E402
from models.text.corpus import generate_documents  # noqa: E402
from models.text.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(300)

V = "albert.encoder.albert_layer_groups.0.albert_layers.0.attention.value"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of the tiny model with weights perturbed away from their init (so a
    mix-up of any two tensors shows in the logits) and a small trained tokenizer."""
    root = tmp_path_factory.mktemp("export")
    docs = generate_documents(200, seed=1)
    train_tokenizer(docs, 300, root / "tok")
    vocab = len(load_tokenizer(root / "tok"))
    model_cfg = training.model_config("tiny", vocab, 64, False)
    _, params, _ = training.build_model(model_cfg)
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(0)
    leaves = [x + rng.normal(0, 0.1, np.shape(x)).astype(np.float32) for x in leaves]
    params = jax.tree.unflatten(treedef, leaves)
    checkpoint.save_checkpoint(
        root / "ckpt", 7, training.flat_params(params), model_cfg, root / "tok", "export-test"
    )
    return root / "ckpt"


def test_checkpoint_names_keep_the_value_projection(tiny_checkpoint: Path) -> None:
    _, flat, _ = checkpoint.load_checkpoint(tiny_checkpoint)
    assert f"{V}.kernel" in flat and f"{V}.bias" in flat
    assert not any(n.endswith("attention.kernel") or n.endswith("attention.bias") for n in flat)
    # the names are the torch ones but for the leaf (kernel/embedding/scale -> weight)
    small = transformers.AlbertConfig(
        vocab_size=8, embedding_size=4, hidden_size=4, num_attention_heads=1, intermediate_size=4
    )
    torch_names = set(transformers.AlbertForPreTraining(small).state_dict())
    leaf = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}
    for name in flat:
        *modules, last = name.split(".")
        assert ".".join([*modules, leaf[last]]) in torch_names, name


def test_a_checkpoint_with_the_old_names_still_loads(tiny_checkpoint: Path) -> None:
    config, flat, _ = checkpoint.load_checkpoint(tiny_checkpoint)
    old = {n.replace(".value.", "."): a for n, a in flat.items()}
    assert len(old) == len(flat)
    _, template, _ = training.build_model(config)
    params = training.unflat_params(template, old)
    assert training.flat_params(params).keys() == flat.keys()
    for name, array in training.flat_params(params).items():
        np.testing.assert_array_equal(array, flat[name])


def test_export_from_the_cli_loads_in_transformers_with_equal_logits(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(tiny_checkpoint), "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    hf_model = transformers.AutoModelForPreTraining.from_pretrained(out).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert type(hf_model).__name__ == "AlbertForPreTraining"
    ours = load_tokenizer(checkpoint.resolve(tiny_checkpoint) / "tokenizer")
    texts = generate_documents(3, seed=9)
    enc = hf_tok(texts, padding=True, truncation=True, max_length=48, return_tensors="np")
    ref = ours(texts, padding=True, truncation=True, max_length=48, return_tensors="np")
    np.testing.assert_array_equal(enc["input_ids"], ref["input_ids"])  # the same vocabulary
    model, _ = checkpoint.load_model(tiny_checkpoint)
    flax_out = model(
        enc["input_ids"], enc["attention_mask"], enc["token_type_ids"], deterministic=True
    )
    with torch.no_grad():
        torch_out = hf_model(
            input_ids=torch.from_numpy(enc["input_ids"]),
            attention_mask=torch.from_numpy(enc["attention_mask"]),
            token_type_ids=torch.from_numpy(enc["token_type_ids"]),
        )
    np.testing.assert_allclose(
        torch_out.prediction_logits.numpy(), np.asarray(flax_out.prediction_logits), atol=1e-5
    )
    np.testing.assert_allclose(
        torch_out.sop_logits.numpy(), np.asarray(flax_out.sop_logits), atol=1e-5
    )


def test_export_of_a_directory_without_a_checkpoint_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "o")]) == 1
    assert "is not a checkpoint" in capsys.readouterr().err
