"""The simulator soak's figures and checks (``bench.soak`` runs it): what its logs show
about a run (see that module's docstring for each figure) and what a run must show."""

from __future__ import annotations

import itertools
import math
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from bench.soak import Log, SoakPlan


def summarize(plan: SoakPlan, logs: list[Log], events: dict) -> dict:
    """The run's figures (see the module docstring)."""
    done = [r["epoch"] for r in logs[0].rows]
    groups: dict[tuple[int, bytes], list[np.ndarray]] = defaultdict(list)
    nans = 0
    for log in logs:
        for r in log.rows:
            nans += not bool(np.isfinite(r["got"]).all())
            if r["group"] > 1 and r["complete"]:
                groups[(r["epoch"], r["digest"])].append(r["got"])
    divergent = sorted(
        {e for (e, _), vs in groups.items() if any(v.tobytes() != vs[0].tobytes() for v in vs)}
    )
    # Parameters each peer holds after each epoch (a digest): how many versions coexist, and
    # what share of the peers that finished the epoch hold its most common one.
    versions: dict[int, Counter] = defaultdict(Counter)
    settled: Counter = Counter()  # per epoch: peers that went on (in sync or not)
    for log in logs:
        for r in log.rows:
            if r["settled"]:
                settled[r["epoch"]] += 1
                if r["params"] is not None:
                    versions[r["epoch"]][r["params"]] += 1
    in_sync = [max(c.values()) / settled[e] for e, c in sorted(versions.items())]
    return {
        "peers": plan.peers + plan.joiners,
        "epochs": done[-1] + 1 if done else 0,
        "averaged": len(set(done)),
        "averaged_in_order": _in_order(logs[0].rows),
        "grouped": sum(r["group"] > 1 for r in logs[0].rows),
        "incomplete": sum(not r["complete"] for log in logs for r in log.rows),
        "groups": len(groups),
        "mean_group": float(np.mean([len(v) for v in groups.values()])) if groups else 0.0,
        "divergences": len(divergent),
        "divergent_epochs": divergent,
        "nans": nans,
        "kills": events["kills"],
        "joins": events["joins"],
        "joiners_averaged": sum(
            any(r["group"] > 1 for r in log.rows) for log in logs[plan.peers :]
        ),
        "resyncs": sum(log.resyncs for log in logs),
        "state_loads": sum(log.loads for log in logs),
        "state_load_failures": sum(log.load_failures for log in logs),
        "fork_adoptions": sum(log.forks for log in logs),
        "params_agreed": sum(len(c) == 1 for c in versions.values()),
        "params_disagreed_epochs": sorted(e for e, c in versions.items() if len(c) > 1),
        "param_versions_max": max((len(c) for c in versions.values()), default=0),
        "params_in_sync": round(float(np.mean(in_sync)), 3) if in_sync else 0.0,
        "params_in_sync_min": round(float(min(in_sync)), 3) if in_sync else 0.0,
        "left_behind": events["left_behind"],
        "partitioned_at": events["partitioned_at"],
        "healed_at": events["healed_at"],
        "virtual_seconds": round(float(events.get("virtual_seconds", 0.0)), 1),
    }


def _in_order(rows: list[dict]) -> bool:
    """The peer's epochs went forward, except after a step it knew missed part of the epoch
    (alone, or its round across groups failed): its lineage lost the fork check, and it
    loaded the winner's state of that epoch (or an older one) and averaged it again."""
    return all(
        b["epoch"] > a["epoch"] or not a["complete"] or a["group"] <= 1
        for a, b in itertools.pairwise(rows)
    )


def _unnamed(row: dict) -> bool:
    """Whether ``row`` averaged in a group (complete) but names none."""
    return row["group"] > 1 and row["complete"] and row["digest"] is None


def check_soak(plan: SoakPlan, logs: list[Log], events: dict) -> dict:
    """Assert what a soak must show; returns :func:`summarize`'s figures.

    The collaboration kept stepping: the bootstrap peer reached the end, averaging nearly
    every epoch (it may skip a few it fell behind in, e.g. a round that outlasted the others',
    and average one again after a step without the whole collaboration whose lineage lost),
    most of them in a group. Members of one group hold the same finite average, bit for bit.
    Every joiner averaged in a group after joining. Every peer holds the same parameters after
    each epoch (capped groups average across groups too), except while the partition lasts
    (each side averages apart; after it heals, the smaller side loads the larger side's state):
    from the round in flight when it began to the newest epoch any peer trained when it healed.
    """
    s = summarize(plan, logs, events)
    # A grouped row names its group: unnamed, every such row of an epoch counted as one group
    # (the two sides of a partition then showed as a divergence).
    unnamed = sorted({r["epoch"] for log in logs for r in log.rows if _unnamed(r)})
    assert not unnamed, f"averaged in a group the soak did not record at epochs {unnamed}"
    done = [r["epoch"] for r in logs[0].rows]
    assert s["averaged_in_order"] and s["epochs"] == plan.epochs, done
    assert s["averaged"] >= plan.epochs - max(1, plan.epochs // 10), done
    assert s["grouped"] >= plan.epochs * 2 // 3, f"only {s['grouped']} of {plan.epochs} grouped"
    assert s["kills"] == plan.killed and s["joins"] == plan.joiners, s
    assert s["healed_at"] is not None
    assert s["nans"] == 0, s
    assert s["divergences"] == 0, f"divergent averages at epochs {s['divergent_epochs']}"
    assert s["joiners_averaged"] == plan.joiners, s
    apart = _apart(s)
    assert not apart, f"peers held different parameters after epochs {apart}"
    return s


def partial_figures(plan: SoakPlan, logs: list[Log], events: dict) -> dict:
    """The figures of a run still going (:func:`summarize`'s), and ``params_apart``: the
    epochs so far after which peers held different parameters outside the partition (the
    final check asserts there are none). A long run prints them as it goes."""
    s = summarize(plan, logs, events)
    s["params_apart"] = _apart(s)
    return s


def _apart(s: dict) -> list[int]:
    """Epochs whose peers held different parameters outside the partition's window: from
    the round in flight when it began (cut too: rows settle an epoch late) to the newest
    epoch any peer trained when it healed; a partition not healed yet runs to the end."""
    start, healed = s["partitioned_at"], s["healed_at"]
    if start is None:
        return list(s["params_disagreed_epochs"])
    end = healed + 1 if healed is not None else math.inf
    return [e for e in s["params_disagreed_epochs"] if not start - 1 <= e < end]
