"""The ``aux`` role: a peer without an accelerator that lends its bandwidth to averaging.

It joins every averaging round and reduces a share of the gradients, but computes none and
contributes no samples (DeDLOC's auxiliary peers). It only needs the shapes of the averaged
arrays, which it takes from the model the run trains. It runs until interrupted, or until the
run reaches ``--max-epochs``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import jax
import numpy as np
import trio

from examples.sahajbert import trainer, training
from examples.sahajbert.config import NetConfig, TrainerConfig

log = logging.getLogger(__name__)


ROUND_WAIT = 30.0  # seconds one call waits for a round before the loop looks again


async def _one_round(core: Any, *, template: list[np.ndarray]) -> int:
    with trio.move_on_after(ROUND_WAIT):
        return await core.run_aux(template, epochs=1)
    return 0


def run_aux(cfg: TrainerConfig, net: NetConfig) -> int:
    if net.client_mode:
        raise ValueError("an aux peer must be reachable: it cannot run in client mode")
    if cfg.compression == "powersgd":  # its rounds are two phases of factors only trainers make
        log.error("an aux peer cannot lend to a PowerSGD run (--compression powersgd); exiting")
        return 2
    training.enable_compilation_cache(cfg.work_dir / "jax-cache")
    from models.text.tokenizer import load_tokenizer

    # cfg carries the run manifest's settings and tokenizer (the CLI fetched them)
    vocab = len(load_tokenizer(training.tokenizer_dir(cfg)))
    model_cfg = training.model_config(cfg.model, vocab, cfg.seq_length, cfg.bf16)
    _, params, _ = training.build_model(model_cfg, seed=cfg.seed)
    template = [np.zeros(np.shape(x), np.float32) for x in jax.tree.leaves(params)]
    collab = trainer.open_collaboration(cfg, net, mode="aux")
    try:
        rounds, seen_epoch = 0, 0
        while True:
            seen_epoch = max(seen_epoch, collab.epoch, collab.estimate.epoch)
            if cfg.max_epochs is not None and seen_epoch >= cfg.max_epochs:
                break
            # One round at a time, each bounded: a helper that missed the last rounds of a run
            # (or whose trainers left) must not wait forever for a round that never comes.
            rounds += collab.run_async(functools.partial(_one_round, template=template))
            log.info("aux peer: %d averaging rounds joined, now at epoch %d", rounds, collab.epoch)
        return 0
    finally:
        collab.close()
