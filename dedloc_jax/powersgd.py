"""``PowerSGD``: rank-``r`` gradients in DeDLOC mode (Vogels et al. 2019; hivemind's
``PowerSGDGradientAverager``), in two all-reduce phases of one group.

Each leaf of two or more dimensions is seen as a matrix ``n x m`` (its first dimension by the
rest). It is *compressed* when ``r (n + m) < n m`` (it then sends fewer values); every other
leaf (one-dimensional, or too small to gain) is averaged as it is. With ``M = gradient + error``
(this peer's error feedback) and ``Q`` the rank-``r`` factor of the previous round (the same on
every peer: an average), a round is:

1. phase P: ``P = M Q``; all-reduce the ``P`` of every compressed leaf together with the
   uncompressed leaves (weighted mean);
2. orthogonalise every mean ``P`` (:func:`orthogonalise`: the same bits on every peer, which
   all hold the same mean);
3. phase Q: ``Q = M^T P``; all-reduce the ``Q``;
4. the mean gradient is ``P Q^T`` (a projection of the group's mean ``M`` onto ``P``'s columns),
   this peer's new error ``M - P Q^T``, and the mean ``Q`` is the next round's.

The arithmetic here is NumPy on the host (the round runs there, between the two all-reduces,
also while ``overlap=True`` averages in the background); :func:`dedloc_jax.collaborative`
keeps ``Q`` and the error in its state (fixed shapes) and adds the error before sending.
:func:`reference_round` is the same round written out for one process (tests replay it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "LowRankPlan",
    "PowerSGD",
    "initial_q",
    "orthogonalise",
    "reference_round",
]

Shape = tuple[int, ...]
SPAN_TOLERANCE = 1e-4
"""A column whose part outside the previous columns' span is under this fraction of its norm
counts as inside it (float32 products leave ~1e-7 relative noise)."""


@dataclass(frozen=True)
class PowerSGD:
    """Rank-``rank`` PowerSGD with error feedback for :func:`dedloc_jax.collaborative`.

    ``rank``: columns of the factors (1 to 64); ``seed``: the first round's ``Q`` (the same on
    every peer); ``codec``: what the factors and the uncompressed leaves travel in (a name of
    :data:`~dedloc_jax.averaging.leaf_codecs.COMPRESSIONS`). Every peer of a run must use the
    same settings."""

    rank: int = 4
    seed: int = 0
    codec: str = "fp16"

    def __post_init__(self) -> None:
        from dedloc_jax.averaging.leaf_codecs import COMPRESSIONS

        if not 1 <= self.rank <= 64:
            raise ValueError(f"rank must be 1 to 64, got {self.rank}")
        if self.codec not in COMPRESSIONS:
            raise ValueError(f"unknown codec {self.codec!r}; known: {list(COMPRESSIONS)}")

    def plan(self, shapes: Sequence[Shape]) -> LowRankPlan:
        """Which leaves of ``shapes`` are compressed, and the factors' shapes."""
        return LowRankPlan(self, tuple(tuple(int(d) for d in s) for s in shapes))


def matrix_shape(shape: Shape) -> tuple[int, int]:
    """A leaf as a matrix: its first dimension by the product of the others."""
    return int(shape[0]), int(math.prod(shape[1:]))


@dataclass(frozen=True)
class LowRankPlan:
    """The round's layout for leaves of ``shapes``: the same on every peer (a pure function of
    the settings and the shapes)."""

    cfg: PowerSGD
    shapes: tuple[Shape, ...]

    @property
    def compressed(self) -> tuple[int, ...]:
        """Indices of the compressed leaves (in order)."""
        r = self.cfg.rank
        out = []
        for i, s in enumerate(self.shapes):
            if len(s) >= 2:
                n, m = matrix_shape(s)
                if r * (n + m) < n * m:
                    out.append(i)
        return tuple(out)

    @property
    def plain(self) -> tuple[int, ...]:
        """Indices of the leaves averaged as they are."""
        c = set(self.compressed)
        return tuple(i for i in range(len(self.shapes)) if i not in c)

    def p_shapes(self) -> list[Shape]:
        return [(matrix_shape(self.shapes[i])[0], self.cfg.rank) for i in self.compressed]

    def q_shapes(self) -> list[Shape]:
        return [(matrix_shape(self.shapes[i])[1], self.cfg.rank) for i in self.compressed]

    def phase_p_shapes(self) -> list[Shape]:
        """What phase P all-reduces: every compressed leaf's ``P``, then the plain leaves."""
        return [*self.p_shapes(), *(self.shapes[i] for i in self.plain)]

    def values_sent(self) -> int:
        """Values one peer contributes per round (both phases)."""
        return sum(math.prod(s) for s in self.phase_p_shapes() + self.q_shapes())

    # --- the host's side of a round, phase by phase ---------------------------------------
    def phase_p(self, ms: Sequence[np.ndarray], qs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Phase P's arrays: ``M Q`` of each compressed leaf, then the plain leaves."""
        ps = [_mat(ms[i]) @ q.astype(np.float32) for i, q in zip(self.compressed, qs, strict=True)]
        return [*ps, *(np.asarray(ms[i], np.float32) for i in self.plain)]

    def phase_q(
        self, ms: Sequence[np.ndarray], mean_ps: Sequence[np.ndarray]
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The orthogonalised mean ``P`` of each compressed leaf, and this peer's ``M^T P``."""
        ps = [orthogonalise(p) for p in mean_ps]
        qs = [_mat(ms[i]).T @ p for i, p in zip(self.compressed, ps, strict=True)]
        return ps, qs

    def finish(
        self,
        ms: Sequence[np.ndarray],
        ps: Sequence[np.ndarray],
        mean_qs: Sequence[np.ndarray],
        mean_plain: Sequence[np.ndarray],
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The mean gradient of every leaf (``P Q^T`` or the plain mean) and this peer's new
        error of every compressed leaf (``M - P Q^T``)."""
        out: list[np.ndarray | None] = [None] * len(self.shapes)
        errors = []
        for i, p, q in zip(self.compressed, ps, mean_qs, strict=True):
            approx = (p @ np.asarray(q, np.float32).T).reshape(self.shapes[i])
            out[i] = approx
            errors.append(np.asarray(ms[i], np.float32) - approx)
        for i, mean in zip(self.plain, mean_plain, strict=True):
            out[i] = np.asarray(mean, np.float32).reshape(self.shapes[i])
        return [np.asarray(a, np.float32) for a in out], errors

    def next_q(self, mean_qs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The next round's ``Q``: the mean ``Q``, with every zero column (a zero gradient, or
        a column inside the others' span) replaced by the seed's, else ``M Q`` would stay 0."""
        seeds = initial_q(self.cfg, self.shapes)
        out = []
        for q, seed in zip(mean_qs, seeds, strict=True):
            q = np.array(q, np.float32)
            dead = ~q.any(axis=0)
            q[:, dead] = seed[:, dead]
            out.append(q)
        return out

    # --- what the transform sends and gets back --------------------------------------------
    def unpack_sent(self, arrays: Sequence[np.ndarray]) -> tuple[list, list]:
        """``(M of every leaf, Q of every compressed leaf)`` from what the transform sent:
        ``[*M, *Q, leaves]`` (checked against this plan)."""
        ms, qs = list(arrays[: len(self.shapes)]), list(arrays[len(self.shapes) : -1])
        want = [*self.shapes, *self.q_shapes()]
        got = [tuple(np.shape(a)) for a in (*ms, *qs)]
        if got != want:
            raise ValueError(f"PowerSGD arrays of shapes {got}, expected {want}")
        return [np.asarray(m, np.float32) for m in ms], [np.asarray(q, np.float32) for q in qs]


def unpack_leaf_count(arrays: Sequence[np.ndarray]) -> int:
    """How many leaves the transform's ``[*M, *Q, leaves]`` holds (its last array)."""
    count = int(np.asarray(arrays[-1]).reshape(()))
    if not 0 <= count <= len(arrays) - 1:
        raise ValueError(f"PowerSGD: {count} leaves in {len(arrays)} arrays")
    return count


def _mat(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return x.reshape(matrix_shape(x.shape))


def orthogonalise(p: np.ndarray) -> np.ndarray:
    """``p``'s columns made orthonormal by Gram-Schmidt (each projection done twice: "twice is
    enough"), in float64 and rounded to float32: the same bits on every peer that holds the
    same ``p`` (no pivoting, no data-dependent order). A column (nearly) in the span of the
    previous ones becomes 0: normalised, its rounding noise would be a random direction."""
    p = np.asarray(p, np.float64).copy()
    for j in range(p.shape[1]):
        col = p[:, j]
        before = math.sqrt(float(np.dot(col, col)))
        for _ in range(2):
            for k in range(j):
                col -= np.dot(p[:, k], col) * p[:, k]
        norm = math.sqrt(float(np.dot(col, col)))
        p[:, j] = col / norm if norm > SPAN_TOLERANCE * before else 0.0
    return p.astype(np.float32)


def initial_q(cfg: PowerSGD, shapes: Sequence[Shape]) -> list[np.ndarray]:
    """The first round's ``Q`` of each compressed leaf: standard normal from ``cfg.seed`` and
    the leaf's index (the same on every peer)."""
    plan = cfg.plan(shapes)
    return [
        np.random.default_rng([cfg.seed, i]).standard_normal(s).astype(np.float32)
        for i, s in zip(plan.compressed, plan.q_shapes(), strict=True)
    ]


def reference_round(
    cfg: PowerSGD,
    grads: Sequence[Sequence[np.ndarray]],
    errors: Sequence[Sequence[np.ndarray]],
    q: Sequence[np.ndarray],
    weights: Sequence[float],
) -> tuple[list[np.ndarray], list[list[np.ndarray]], list[np.ndarray]]:
    """One round for several peers in one process, exact means: the mean gradient, each
    peer's new error and the next ``Q`` (float64 throughout, QR for the orthogonalisation)."""
    shapes = [np.shape(g) for g in grads[0]]
    plan = cfg.plan(shapes)
    w = np.asarray(weights, np.float64) / float(np.sum(weights))
    ms = [[np.asarray(g, np.float64) for g in gs] for gs in grads]  # M = g + e
    for m, e in zip(ms, errors, strict=True):
        for i, err in zip(plan.compressed, e, strict=True):
            m[i] = m[i] + np.asarray(err, np.float64)
    mats = [[m[i].reshape(matrix_shape(m[i].shape)) for i in plan.compressed] for m in ms]
    mean_p = [sum(w[k] * mats[k][j] @ q[j] for k in range(len(ms))) for j in range(len(q))]
    ortho = []
    for p in mean_p:
        basis, r = np.linalg.qr(p)
        ortho.append(basis * np.sign(np.where(np.diag(r) == 0, 1.0, np.diag(r))))
    mean_q = [sum(w[k] * mats[k][j].T @ ortho[j] for k in range(len(ms))) for j in range(len(q))]
    mean = [sum(w[k] * ms[k][i] for k in range(len(ms))) for i in range(len(shapes))]
    new_errors: list[list[np.ndarray]] = [[] for _ in ms]
    for j, i in enumerate(plan.compressed):
        approx = (ortho[j] @ mean_q[j].T).reshape(shapes[i])
        mean[i] = approx
        for k in range(len(ms)):
            new_errors[k].append(ms[k][i] - approx)
    return mean, new_errors, mean_q
