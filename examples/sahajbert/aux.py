"""The ``aux`` role: a peer without an accelerator that lends its bandwidth to averaging.

It joins every averaging round and reduces a share of the gradients, but computes none and
contributes no samples (DeDLOC's auxiliary peers). It only needs the shapes of the averaged
arrays, which it takes from the model the run trains. It runs until interrupted, or until the
run reaches ``--max-epochs``.
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from examples.sahajbert import trainer, training
from examples.sahajbert.config import NetConfig, TrainerConfig

log = logging.getLogger(__name__)


def run_aux(cfg: TrainerConfig, net: NetConfig) -> int:
    if net.client_mode:
        raise ValueError("an aux peer must be reachable: it cannot run in client mode")
    tokenizer, _ = training.prepare_data(cfg)
    model_cfg = training.model_config(cfg.model, len(tokenizer), cfg.seq_length, cfg.bf16)
    _, params, _ = training.build_model(model_cfg, seed=cfg.seed)
    template = [np.zeros(np.shape(x), np.float32) for x in jax.tree.leaves(params)]
    collab = trainer.open_collaboration(cfg, net, mode="aux")
    try:
        if not hasattr(collab, "run_aux"):
            log.error("this dedloc_jax has no aux support (Collaboration.run_aux); exiting")
            return 2
        rounds = 0
        # One round per call, so that with --max-epochs the helper stops with the run even
        # when it joined late (it follows the run's epoch, not a count of rounds).
        while cfg.max_epochs is None or collab.epoch < cfg.max_epochs:
            rounds += collab.run_aux(template, epochs=1)
            log.info("aux peer: %d averaging rounds joined, now at epoch %d", rounds, collab.epoch)
        return 0
    finally:
        collab.close()
