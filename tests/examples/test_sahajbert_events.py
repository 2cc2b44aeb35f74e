"""``trainer --events FILE``: phases around averaging and loading, epochs with a parameter
digest, one flushed JSON line each (what bench.chaos --peer sahajbert reads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.chaos import _final_in_step
from examples.sahajbert.events import EventLog, PhaseHost, params_digest


class _Collab:
    keeper = "the keeper"

    def average_gradients(self, epoch: int, gradients: Any, samples: int) -> str:
        return f"averaged {epoch}"

    def load_state(self, **kw: Any) -> tuple[int, list]:
        return 7, [kw]


def test_phases_and_epochs_are_written_as_they_happen(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    host = PhaseHost(_Collab(), log)
    assert host.average_gradients(3, [], 8) == "averaged 3"
    assert host.load_state(timeout=5.0) == (7, [{"timeout": 5.0}])
    assert host.keeper == "the keeper"  # everything else is the collaboration's
    params = {"w": np.ones(3, np.float32)}
    log.epoch(4, "step", params, group=2, loss=0.5)
    log.epoch(4, "load", {"w": np.array([np.nan], np.float32)})
    rows = [json.loads(line) for line in path.read_text().splitlines()]  # flushed already
    assert [r.get("phase") for r in rows[:3]] == ["averaging", "accumulating", "loading"]
    assert rows[1]["epoch"] == 4
    step, load = rows[3], rows[4]
    assert step == {**step, "ev": "epoch", "how": "step", "group": 2, "finite": True}
    assert step["digest"] == params_digest(params) != params_digest({"w": np.zeros(3)})
    assert load["finite"] is False
    EventLog(None).epoch(1, "step", params)  # no file: nothing written, nothing raised


class _MidStep(_Collab):
    def __init__(self, began: bool) -> None:
        self.began, self.handed = began, None

    def report_whole_steps(self, epoch: int, samples: int, batch_size: int) -> bool:
        return False

    def lands_within(self, seconds: float) -> bool:
        return True

    def hand_over(self, epoch: int, gradients: Any, samples: int, **kw: Any) -> None:
        self.handed = (epoch, samples)

    def take_over(self) -> str | None:
        return f"averaged {self.handed[0]}" if self.began else None


def test_a_trainer_with_events_averages_mid_step_and_marks_the_hand_over(tmp_path: Path) -> None:
    """The trainer's --events host must stay a MidStepHost (collaborative checks the class):
    without it, the peers bench.chaos runs would wait for their micro-steps to end."""
    from dedloc_jax.host import MidStepHost

    path = tmp_path / "events.jsonl"
    for began in (True, False):
        host = PhaseHost(_MidStep(began), EventLog(path))
        assert isinstance(host, MidStepHost)
        assert host.lands_within(1.0) and not host.report_whole_steps(3, 8, 4)
        host.hand_over(3, [], 8)
        assert host.take_over() == ("averaged 3" if began else None)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["phase"], r["epoch"]) for r in rows] == [
        ("averaging", 3), ("accumulating", 4), ("averaging", 3), ("accumulating", 3)
    ]  # fmt: skip


def test_the_final_comparison_takes_the_last_epoch_all_peers_held_in_step() -> None:
    in_step = {
        5: {"aa": [0, 1, 2]},
        6: {"bb": [0, 1], "cc": [2]},  # a divergence at 6 (all three in step)
        7: {"dd": [0, 1]},  # peer 2 not in step at 7
    }
    assert _final_in_step(in_step, 3) == (6, {"0": "bb", "1": "bb", "2": "cc"})
    assert _final_in_step({7: {"dd": [0]}}, 3) == (None, {})
