"""The model side: ALBERT in Flax NNX, its PyTorch bridge, data parallelism."""
# ruff: noqa: F401  (re-exports)

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
