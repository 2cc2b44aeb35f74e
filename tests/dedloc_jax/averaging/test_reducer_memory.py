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
    config = AllReduceConfig.testing().with_(window_chunks=4)
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
