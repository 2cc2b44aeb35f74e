"""Share fractions that minimise a butterfly round's time given each peer's two link speeds.

Model (for a vector of S bytes; A = members that send and need results (nodes and clients),
n = |A|; w_i = fraction of the vector reduced by member i):

* a node uploads (1 - w_i) S (its parts of the others' shares) plus w_i S (n - 1) (its averaged
  share to every other member of A), and downloads the mirror image: (1 - w_i) S of results plus
  w_i S (n - 1) of parts from the other senders;
* an aux peer (w_i >= 0) downloads w_i S n parts and uploads w_i S n results;
* a client (w_i = 0) uploads S and downloads S whatever the split.

Each peer's upload volume over its upload bandwidth, and download volume over its download
bandwidth, must be <= T; minimise T subject to sum(w) = 1, w >= 0. Clients' constraints do not
depend on w, so the LP is solved over reducers only (which keeps the split balanced among them
even when a slow client is the bottleneck) and the clients' times are folded into the bound.
The optimum is a lower bound on the round: it ignores latency, protocol overhead and pipeline
fill, and assumes every link runs in full duplex at its rate.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import GroupError, LoadBalancingError
from .group import Member
from .partition import FRACTION_GRID, fractions_to_parts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShareSolution:
    """The LP's answer: fractions, their grid integers, and seconds per byte of vector."""

    fractions: tuple[float, ...]
    parts: tuple[int, ...]
    seconds_per_byte: float

    def lower_bound(self, vector_bytes: int) -> float:
        """The round's lower bound (seconds) for a vector of ``vector_bytes`` on the wire."""
        return self.seconds_per_byte * vector_bytes


def _volumes(members: Sequence[Member], fractions: Sequence[float]) -> list[float]:
    """Bytes each member moves in each direction, per byte of vector (same both ways)."""
    n = sum(1 for m in members if m.sends)
    out = []
    for m, w in zip(members, fractions, strict=True):
        if m.mode == "client":
            out.append(1.0)
        elif m.mode == "aux":
            out.append(w * n)
        else:
            out.append((1.0 - w) + w * (n - 1))
    return out


def predicted_time(
    members: Sequence[Member], fractions: Sequence[float], vector_bytes: int
) -> float:
    """Round time the model predicts for any split (to compare e.g. an equal split with the LP)."""
    worst = 0.0
    for m, vol in zip(members, _volumes(members, fractions), strict=True):
        slowest = min(m.upload_bps, m.download_bps)
        if vol > 0:
            worst = max(worst, vol * vector_bytes / slowest)
    return worst


def _floor(m: Member, n_send: int) -> float:
    """Seconds per byte a member needs even when it reduces nothing."""
    if m.mode == "aux":
        return 0.0
    return 1.0 / min(m.upload_bps, m.download_bps)


def _solve_lp(
    members: Sequence[Member],
    reducers: Sequence[int],
    caps: dict[int, float],
    n_send: int,
    scale: float,
) -> tuple[list[float], float]:
    """min T s.t. each reducer's upload and download time <= T (or <= its cap when frozen),
    sum(w) = 1, w >= 0. Times are in seconds per byte; returns (w per reducer, T)."""
    k = len(reducers)
    a_ub, b_ub = [], []
    for col, i in enumerate(reducers):
        m = members[i]
        for bw in (m.upload_bps, m.download_bps):
            inv = scale / bw  # 0 for an infinite link
            row = [0.0] * (k + 1)
            if m.mode == "aux":  # n w / b <= T
                row[col] = n_send * inv
                rhs = 0.0
            else:  # (1 + (n - 2) w) / b <= T
                row[col] = (n_send - 2) * inv
                rhs = -inv
            if i in caps:
                rhs += caps[i] * scale
            else:
                row[k] = -1.0
            a_ub.append(row)
            b_ub.append(rhs)
    from scipy.optimize import linprog  # lazy: importing scipy.optimize costs ~1.6 s

    res = linprog(
        [0.0] * k + [1.0],
        A_ub=np.array(a_ub),
        b_ub=np.array(b_ub),
        A_eq=np.array([[1.0] * k + [0.0]]),
        b_eq=[1.0],
        bounds=[(0.0, 1.0)] * k + [(0.0, None)],
        method="highs",
    )
    if res.status != 0 or res.x is None:
        raise LoadBalancingError(f"load-balancing LP failed: {res.message}")
    return [max(0.0, float(v)) for v in res.x[:k]], float(res.x[k]) / scale


def solve_shares(members: Sequence[Member]) -> ShareSolution:
    """Solve the LP (HiGHS), balance ties, and quantise the fractions to the shared grid.

    The LP's optimum can be set by a peer that is slow even when it reduces nothing (a client, or
    a node on a thin link); then many splits reach it. To pick a balanced one, reducers whose
    floor already reaches the optimum have their time frozen at that optimum and the LP is
    re-solved for the others' maximum, until none is blocked (each step a tiny LP). With no
    bandwidth information at all (every link infinite), or two senders and no aux peer (every
    split moves the same bytes), reducers get shares proportional to their slower link (equal
    when unknown).
    """
    members = tuple(members)
    reducers = [i for i, m in enumerate(members) if m.mode != "client"]
    n_send = sum(1 for m in members if m.sends)
    if not reducers or n_send == 0:
        raise GroupError("a group needs a reducer (node or aux) and a sender (node or client)")
    links = [b for i in reducers for b in (members[i].upload_bps, members[i].download_bps)]
    finite = [b for m in members for b in (m.upload_bps, m.download_bps) if math.isfinite(b)]
    scale = max(finite) if finite else 1.0  # bandwidths in units of the fastest link

    fractions = [0.0] * len(members)
    uninformative = all(math.isinf(b) for b in links) or (
        n_send <= 2 and all(members[i].mode == "node" for i in reducers)
    )
    if len(reducers) == 1:
        fractions[reducers[0]] = 1.0
    elif uninformative:
        _by_speed(members, reducers, fractions)
    else:
        try:
            w, level = _solve_lp(members, reducers, {}, n_send, scale)
        except LoadBalancingError as e:  # not seen in practice; the round must not fail
            logger.warning("%s; splitting by link speed instead", e)
            _by_speed(members, reducers, fractions)
        else:
            caps: dict[int, float] = {}
            while True:
                active = [i for i in reducers if i not in caps]
                blocked = [i for i in active if _floor(members[i], n_send) >= level * (1 - 1e-9)]
                if not blocked or len(blocked) == len(active):
                    break
                caps.update((i, level * (1 + 1e-9)) for i in blocked)
                try:
                    w, level = _solve_lp(members, reducers, caps, n_send, scale)
                except LoadBalancingError as e:
                    # Freezing the blocked peers at the optimum can be infeasible within the
                    # solver's tolerance (links 10^6 times apart): the last split is optimal,
                    # only less balanced among the others.
                    logger.info("rebalancing stopped: %s", e)
                    break
            for i, wi in zip(reducers, w, strict=True):
                fractions[i] = wi
    parts = fractions_to_parts(fractions, FRACTION_GRID)
    quantised = tuple(p / FRACTION_GRID for p in parts)
    return ShareSolution(quantised, parts, predicted_time(members, quantised, 1))


def _by_speed(members: Sequence[Member], reducers: Sequence[int], fractions: list[float]) -> None:
    """Shares proportional to each reducer's slower link (equal among unknown ones)."""
    speeds = [min(members[i].upload_bps, members[i].download_bps) for i in reducers]
    if any(math.isinf(s) for s in speeds):
        speeds = [1.0 if math.isinf(s) else 0.0 for s in speeds]
    total = sum(speeds)
    for i, s in zip(reducers, speeds, strict=True):
        fractions[i] = s / total


def equal_split(members: Sequence[Member]) -> tuple[float, ...]:
    """The naive split (every reducer an equal share), for comparison in benchmarks."""
    reducers = [m.mode != "client" for m in members]
    k = sum(reducers)
    return tuple((1.0 / k) if r else 0.0 for r in reducers)
