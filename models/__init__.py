"""The model side: ALBERT in Flax NNX, its PyTorch bridge, data parallelism.

Text (tokenizer, batch pipeline, document sources, synthetic corpus) lives in ``models.text``.
"""

from models.albert import (
    AlbertConfig,
    AlbertForPreTraining,
    AlbertForPreTrainingOutput,
    AlbertForSequenceClassification,
    AlbertForTokenClassification,
    AlbertModel,
    AlbertModelOutput,
    ClassifierOutput,
    count_params,
    load_backbone,
    masked_lm_loss,
    pretraining_batch_loss,
    pretraining_loss,
    sentence_order_loss,
)
from models.hf import albert_from_torch, albert_to_torch, config_from_hf, config_to_hf
from models.sharding import make_grad_step, make_mesh, make_train_step, shard_batch

__all__ = [
    "AlbertConfig",
    "AlbertForPreTraining",
    "AlbertForPreTrainingOutput",
    "AlbertForSequenceClassification",
    "AlbertForTokenClassification",
    "AlbertModel",
    "AlbertModelOutput",
    "ClassifierOutput",
    "albert_from_torch",
    "albert_to_torch",
    "config_from_hf",
    "config_to_hf",
    "count_params",
    "load_backbone",
    "make_grad_step",
    "make_mesh",
    "make_train_step",
    "masked_lm_loss",
    "pretraining_batch_loss",
    "pretraining_loss",
    "sentence_order_loss",
    "shard_batch",
]
