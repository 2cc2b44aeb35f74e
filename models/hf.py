"""Weights to and from transformers' PyTorch ``AlbertForPreTraining``.

Our modules carry the PyTorch attribute names, so a parameter's torch name is its NNX path
joined by dots, with the leaf renamed (``kernel`` / ``embedding`` / ``scale`` -> ``weight``).
Linear weights are [out, in] in torch and [in, out] here. The torch decoder is tied to the word
embeddings and to ``predictions.bias``; we keep no copy of it.

torch and transformers are imported inside the functions: they are only a test / bench extra.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict

from models.albert import AlbertConfig, AlbertForPreTraining

_LEAF_TO_TORCH = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}
_TIED = ("predictions.decoder.weight", "predictions.decoder.bias")
# The AlbertConfig fields that transformers' AlbertConfig has too (the rest are ours: dtypes...).
_SPEED_FIELDS = ("dtype", "param_dtype", "remat", "attention")
HF_FIELDS = tuple(f.name for f in dataclasses.fields(AlbertConfig) if f.name not in _SPEED_FIELDS)


def config_from_hf(hf_config, **overrides) -> AlbertConfig:
    """An AlbertConfig from a ``transformers.AlbertConfig``; ``overrides`` e.g. dtype="bfloat16"."""
    fields = {name: getattr(hf_config, name) for name in HF_FIELDS}
    return AlbertConfig(**{**fields, **overrides})


def config_to_hf(config: AlbertConfig):
    import transformers

    return transformers.AlbertConfig(**{name: getattr(config, name) for name in HF_FIELDS})


def _torch_name(path: tuple) -> str:
    *modules, leaf = (str(p) for p in path)
    if tuple(path) == ("predictions", "bias"):
        return "predictions.bias"
    return ".".join([*modules, _LEAF_TO_TORCH[leaf]])


def albert_from_torch(torch_model, **config_overrides) -> AlbertForPreTraining:
    """A Flax AlbertForPreTraining with the weights of a transformers AlbertForPreTraining."""
    config = config_from_hf(torch_model.config, **config_overrides)
    tensors = {
        name: t.detach().cpu().float().numpy()
        for name, t in torch_model.state_dict().items()
        if name not in _TIED
    }
    model = AlbertForPreTraining(config, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    flat = flatten_dict(nnx.to_pure_dict(params))
    names = {path: _torch_name(path) for path in flat}
    if set(names.values()) != set(tensors):
        missing = sorted(set(names.values()) - set(tensors))
        unused = sorted(set(tensors) - set(names.values()))
        raise ValueError(f"torch weights do not match: missing {missing}, unused {unused}")
    dtype = jnp.dtype(config.param_dtype)
    for path, name in names.items():
        array = tensors[name].T if path[-1] == "kernel" else tensors[name]
        if array.shape != flat[path].shape:
            raise ValueError(f"{name}: torch shape {array.shape}, ours {flat[path].shape}")
        flat[path] = jnp.asarray(array, dtype)
    nnx.replace_by_pure_dict(params, unflatten_dict(flat))
    nnx.update(model, params)
    return model


def albert_to_torch(model: AlbertForPreTraining):
    """A transformers AlbertForPreTraining (float32, eval mode) with this model's weights."""
    import torch
    import transformers

    torch_model = transformers.AlbertForPreTraining(config_to_hf(model.config)).eval()
    state = {}
    for path, value in flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items():
        array = np.array(value, np.float32)
        if path[-1] == "kernel":
            array = np.ascontiguousarray(array.T)
        state[_torch_name(path)] = torch.from_numpy(array)
    state["predictions.decoder.weight"] = state["albert.embeddings.word_embeddings.weight"]
    state["predictions.decoder.bias"] = state["predictions.bias"]
    torch_model.load_state_dict(state, strict=True)
    return torch_model
