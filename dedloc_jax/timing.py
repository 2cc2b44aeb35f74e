"""Adaptive deadlines, derived from predictions instead of fixed knobs.

hivemind asks users for ``matchmaking_time`` and ``averaging_timeout``; a value right for 40
volunteers is wrong for 4 peers on a LAN. Here the matchmaking window follows how stale each
peer's view of the progress can be, and the averaging timeout follows the load-balancing LP's
lower bound on the round time for the actual group and vector size.
"""

from __future__ import annotations


def matchmaking_window(
    refresh_delay: float,
    dht_latency: float,
    step_interval: float = 0.0,
    *,
    minimum: float = 0.2,
    maximum: float = 60.0,
) -> float:
    """How long a peer waits for others to register, and a leader for joins.

    Peers notice that the target is reached up to one refresh period apart, and a peer only
    looks between micro-steps, so the slowest peer's ``step_interval`` adds to the spread; each
    then needs a DHT write and read and an RPC to join.
    """
    spread = 1.2 * step_interval + refresh_delay
    return min(maximum, max(minimum, spread + 2.0 * (refresh_delay + 2.0 * dht_latency)))


def averaging_timeout(
    lp_bound_seconds: float, rtt: float, *, slack: float = 3.0, minimum: float = 5.0
) -> float:
    """How long an all-reduce round may take before stragglers are dropped.

    ``lp_bound_seconds`` is the LP's optimal round time for the group's measured bandwidths;
    ``slack`` covers measurement error and protocol overhead.
    """
    if lp_bound_seconds < 0 or rtt < 0:
        raise ValueError("times must be non-negative")
    return max(minimum, slack * lp_bound_seconds + 10.0 * rtt)
