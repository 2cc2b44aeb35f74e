"""Robust aggregation: CenteredClip bounds what one peer sending scaled values can do."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dedloc_jax.averaging import AllReduceConfig
from dedloc_jax.averaging.robust import cap_weights, centered_clip, weighted_median

from .helpers import run_round


def test_agreeing_vectors_are_averaged_exactly():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 40))
    w = np.array([1.0, 2.0, 1.0, 3.0, 1.0])
    got = centered_clip(x, w, tau=100.0)  # nobody is clipped: the weighted mean
    np.testing.assert_allclose(got, (w @ x) / w.sum(), atol=1e-9)


def test_weighted_median_and_weight_cap():
    x = np.array([[1.0], [2.0], [100.0]])
    assert weighted_median(x, np.array([1.0, 1.0, 1.0]))[0] == 2.0
    assert weighted_median(x, np.array([1.0, 1.0, 5.0]))[0] == 100.0
    np.testing.assert_array_equal(cap_weights([1.0, 1.0, 1e9]), [1.0, 1.0, 2.0])


@pytest.mark.parametrize("bad", [{"tau": 0.0}, {"weights": [0.0, 0.0]}, {"weights": [1.0]}])
def test_bad_arguments_are_refused(bad):
    args = {"values": np.ones((2, 3)), "weights": [1.0, 1.0], "tau": 1.0} | bad
    with pytest.raises(ValueError):
        centered_clip(**args)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n_honest=st.integers(3, 8),
    dim=st.integers(1, 64),
    tau=st.floats(0.1, 10.0),
    scale=st.sampled_from([1e3, 1e6, -1e6]),
)
def test_one_byzantine_sender_moves_the_result_by_at_most_a_multiple_of_tau(
    seed, n_honest, dim, tau, scale
):
    rng = np.random.default_rng(seed)
    center = rng.standard_normal(dim) * 100
    # honest vectors within tau/3 of their mean (so the robust start sees them inside tau)
    noise = rng.standard_normal((n_honest, dim))
    noise -= noise.mean(axis=0)
    radius = np.linalg.norm(noise, axis=1).max()
    if radius > 0:
        noise *= (tau / 3) / radius / np.sqrt(n_honest)
    honest = center + noise
    # a scaled gradient, at least |scale| from the honest one in every coordinate (scaling
    # alone leaves a coordinate near -1 close to it: the plain mean then moved little)
    byz = scale * (np.abs(honest[0]) + 1)
    x = np.vstack([honest, byz])
    w = np.ones(n_honest + 1)
    got = centered_clip(x, w, tau, iters=50)
    beta = 1 / (n_honest + 1)
    bound = beta / (1 - beta) * tau
    err = np.linalg.norm(got - honest.mean(axis=0))
    assert err <= bound * 1.01 + 1e-6 * np.linalg.norm(center)
    # and the plain mean is off by far more (at least |scale| / (n + 1) >= 111 per coordinate)
    assert np.linalg.norm(x.mean(axis=0) - honest.mean(axis=0)) > 10 * bound


def _scaled_round(robust_tau: float | None) -> tuple[np.ndarray, np.ndarray, list]:
    rng = np.random.default_rng(7)
    dim, tau = 240, 1.0
    truth = rng.standard_normal(dim).astype(np.float32)
    vecs = [truth + 0.05 * rng.standard_normal(dim).astype(np.float32) for _ in range(5)]
    honest_mean = np.mean(np.asarray(vecs[:4], np.float64), axis=0)
    vecs[4] = vecs[4] * np.float32(1e4)  # peer 4 sends a scaled gradient
    cfg = AllReduceConfig.testing().replace(robust_tau=robust_tau and tau)
    outcome, _, _ = run_round(["node"] * 5, [{"g": v} for v in vecs], [1.0] * 5, config=cfg)
    results = [o for o in outcome if not isinstance(o, Exception)]
    assert len(results) == 5, outcome
    got = results[0].vector
    for r in results[1:]:
        assert r.vector.tobytes() == got.tobytes()  # everybody still agrees
    return got.astype(np.float64), honest_mean, results


def test_end_to_end_one_peer_scaling_its_gradient_is_bounded_only_with_centered_clip():
    tau, chunk = 1.0, AllReduceConfig.testing().chunk_elems
    got, honest, _ = _scaled_round(tau)
    # per chunk the error is at most beta/(1-beta)*tau = tau/4 in L2 (beta = 1/5); an aligned
    # block of chunk_elems values overlaps at most two chunks
    for a in range(0, got.size, chunk):
        err = np.linalg.norm(got[a : a + chunk] - honest[a : a + chunk])
        assert err <= np.sqrt(2) * tau / 4 + 1e-3
    plain, honest2, _ = _scaled_round(None)
    np.testing.assert_array_equal(honest, honest2)
    assert np.abs(plain - honest).max() > 100 * tau  # without the option: poisoned


def test_cap_weights_caps_at_twice_numpys_median_to_the_bit():
    """The cap's median is taken without np.median (a tenth of a verified round's CPU went to
    it): every member and every checker must still get the same float64 figure."""
    from dedloc_jax.averaging.robust import WEIGHT_CAP

    rng = np.random.default_rng(0)
    for n in range(1, 12):
        for scale in (1.0, 3.0, 1e-300, 1e300):
            w = rng.random(n) * scale
            want = np.minimum(w, WEIGHT_CAP * float(np.median(w)))
            assert cap_weights(list(w)).tobytes() == want.tobytes()
    assert np.isnan(cap_weights([1.0, float("nan"), 2.0])).all()  # as np.median: NaN
