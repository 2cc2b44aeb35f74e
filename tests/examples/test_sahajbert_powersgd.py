"""The sahajBERT example with ``--compression powersgd``: a short demo (slow)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from examples.sahajbert.__main__ import parse_args, trainer_config
from examples.sahajbert.config import DEFAULT_WORK_DIR, DemoConfig, TrainerConfig
from examples.sahajbert.demo import cli_args, run_collaboration


def test_the_demo_passes_powersgd_on_to_its_trainers() -> None:
    demo = TrainerConfig.demo().replace(compression="powersgd", powersgd_rank=2)
    again = trainer_config(parse_args(["trainer", *cli_args(demo), "--initial-peers", "/x"]))
    assert (again.compression, again.powersgd_rank, again.codec) == ("powersgd", 2, None)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_powersgd_demo_ends_bit_identical_and_checkpointed(tmp_path: Path) -> None:
    cfg = TrainerConfig.demo(DEFAULT_WORK_DIR).replace(
        run_id="sahajbert-powersgd-test", compression="powersgd", powersgd_rank=2
    )
    demo = DemoConfig(trainers=2, client_trainers=1, epochs=3, checkpoint_every=3, timeout=400)
    result = run_collaboration(demo, cfg, tmp_path, live=False)
    assert result.returncodes == {"coordinator": 0, "trainer0": 0, "trainer1": 0}
    assert [r["epoch"] for r in result.rows] == list(range(demo.epochs))
    assert result.identical  # the trainers' final parameters, bit for bit
    final = dict(np.load(result.final_params[0]))
    assert int(final.pop("__epoch__")) == demo.epochs
    assert result.checkpoint is not None
