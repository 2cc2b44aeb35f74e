"""The coordinator's poll loop against a scripted collaboration: it checkpoints the run's last
epoch even after the estimate fell back (the trainers left), downloads only what is newer
than its last checkpoint, and gives up with a clear error instead of waiting forever."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

from dedloc_jax import CollaborationEstimate
from examples.sahajbert import coordinator as coordinator_mod
from examples.sahajbert.config import NetConfig, TrainerConfig
from examples.sahajbert.coordinator import Coordinator, CoordinatorOptions, FinalStateMissing

pytestmark = pytest.mark.timeout(60)  # a coordinator that never gives up would loop forever


class _DHT:
    async def get(self, key: str, **_: Any) -> None:
        return None

    async def store(self, *_: Any) -> bool:
        return True

    def now(self) -> float:
        return 0.0


class _Core:
    run_id = "test"
    dht = _DHT()


class ScriptedCollab:
    """Each poll reads the next estimate epoch and the next newest served epoch (the last one
    repeats); a download returns the state of the newest served epoch."""

    def __init__(self, estimates: list[int], served: list[int | None]) -> None:
        self._estimates = _repeat_last(estimates)
        self._served = _repeat_last(served)
        self.newest: int | None = None
        self.downloads: list[int] = []
        self.shared: list[int] = []

    @property
    def estimate(self) -> CollaborationEstimate:
        return CollaborationEstimate(
            epoch=next(self._estimates), samples=0.0, samples_per_second=0.0, eta=0.0,
            num_peers=0, num_clients=0, target=96,
        )  # fmt: skip

    def run_async(self, async_fn: Any, *args: Any) -> Any:
        import trio

        return trio.run(async_fn, _Core(), *args)

    def newest_state_epoch(self) -> int | None:
        self.newest = next(self._served)
        return self.newest

    def load_state(self, *, timeout: float = 60.0) -> tuple[int, list[np.ndarray]]:
        assert self.newest is not None
        self.downloads.append(self.newest)
        return self.newest, [np.full(3, float(self.newest), np.float32)]

    def share_state(self, arrays: Any, epoch: int) -> None:
        self.shared.append(epoch)


def _repeat_last(values: list) -> Iterator:
    yield from values
    while True:
        yield values[-1]


@pytest.fixture
def saved(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, float]]:
    """Checkpoints the coordinator saves: (epoch, the value of the saved array)."""
    calls: list[tuple[int, float]] = []

    def save(directory: Path, epoch: int, flat: dict, *_: Any) -> Path:
        calls.append((epoch, float(next(iter(flat.values()))[0])))
        return directory / f"epoch_{epoch}"

    monkeypatch.setattr(coordinator_mod.checkpoint, "save_checkpoint", save)
    return calls


def _coordinator(tmp_path: Path, **opts: Any) -> Coordinator:
    options = CoordinatorOptions(
        out_dir=tmp_path, checkpoint_every=2, poll_interval=0.0, exit_after_epoch=4, **opts
    )
    coord = Coordinator(TrainerConfig.demo(tmp_path), NetConfig(), options)
    coord.template = ({"w": jnp.zeros(3, jnp.float32)}, ())
    coord.model_cfg = None
    return coord


class _Dash:
    url = "http://127.0.0.1:1/"
    status: dict = {}


def test_the_last_epoch_is_saved_after_the_estimate_fell_back(tmp_path, saved) -> None:
    # The run reaches epoch 4 while the trainers still serve epoch 3, then the estimate falls
    # back to 2 (as when they leave); the state of epoch 4 shows up two polls later.
    collab = ScriptedCollab(estimates=[2, 4, 2], served=[2, 3, 3, 4])
    status = _coordinator(tmp_path)._poll(collab, _Dash(), [])
    assert [epoch for epoch, _ in saved] == [2, 3, 4]
    assert saved[-1][1] == 4.0  # the downloaded state, not the template
    assert status["checkpoint_epoch"] == 4
    # epoch 3, served on two polls, was downloaded once
    assert collab.downloads == [2, 3, 4]
    assert len(collab.shared) == 3  # and serves each checkpoint


def test_without_the_last_state_it_gives_up_with_a_clear_error(tmp_path, saved) -> None:
    collab = ScriptedCollab(estimates=[4, 3], served=[3])
    coord = _coordinator(tmp_path, final_wait=0.3)
    with pytest.raises(FinalStateMissing, match="reached epoch 4.*newest checkpoint is of epoch 3"):
        coord._poll(collab, _Dash(), [])
    assert [epoch for epoch, _ in saved] == [3]
    assert collab.downloads == [3]
