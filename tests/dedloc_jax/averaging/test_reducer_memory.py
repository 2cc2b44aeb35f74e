"""A reducer's memory is a fixed number of chunks, whatever the size of its share."""

from __future__ import annotations

import numpy as np
import pytest

from dedloc_jax.averaging import AllReduceConfig
from dedloc_jax.averaging.reducer import Reducer

from .helpers import check_survivors, make_tree, run_round


@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_reducer_holds_at_most_its_window_of_chunks(monkeypatch, codec):
    held: list[tuple[int, int]] = []  # (encoded results kept, accumulator slots) per chunk
    finalise = Reducer._finalise

    def spy(self: Reducer, k: int) -> None:
        finalise(self, k)
        held.append((len(self.enc), len(self.acc)))

    monkeypatch.setattr(Reducer, "_finalise", spy)
    config = AllReduceConfig.testing().replace(window_chunks=4)
    rng = np.random.default_rng(0)
    trees = [make_tree(rng, [(16 * 300,)]) for _ in range(4)]
    weights = [1.0, 2.0, 3.0, 4.0]
    # a slow receiver (1 MB/s down) lags behind the reducers' results
    bandwidth = [(5e6, 1e6), (5e6, 20e6), (10e6, 20e6), (20e6, 20e6)]
    outcome, _, names = run_round(
        ["node"] * 4, trees, weights, codec=codec, config=config, bandwidth=bandwidth
    )
    lossy = codec == "fp16"
    check_survivors(
        outcome, trees, weights, names, rtol=1e-2 if lossy else 1e-5, atol=1e-2 if lossy else 1e-6
    )
    assert len(held) > 4 * 50  # every share spans many more chunks than the window
    assert max(e for e, _ in held) <= 4 + 1
    assert max(a for _, a in held) <= 4


def test_a_finished_round_keeps_only_its_result(monkeypatch):
    """What lingers for late repairs is the result: not the vector (a private copy of a
    multi-leaf tree), the reducer's buffers or a repair's share-sized buffers."""
    from dedloc_jax.averaging.butterfly import AveragingService

    closed = []
    close = AveragingService._close

    def spy(self: AveragingService, rnd) -> None:
        close(self, rnd)
        closed.append(rnd)

    monkeypatch.setattr(AveragingService, "_close", spy)
    rng = np.random.default_rng(1)
    trees = [make_tree(rng, [(40, 3), (70,)]) for _ in range(3)]
    weights = [1.0, 2.0, 3.0]
    outcome, _, names = run_round(["node"] * 3, trees, weights)
    check_survivors(outcome, trees, weights, names, rtol=1e-5, atol=1e-6)
    assert len(closed) == 3
    for rnd in closed:
        assert rnd.finished and rnd.vec is None and rnd.reducer is None and not rnd.repairs
        assert rnd.out is not None and all(rnd.held[j] == len(rnd.chunks[j]) for j in rnd.chunks)
