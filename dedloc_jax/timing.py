"""Adaptive deadlines, derived from predictions instead of fixed knobs.

hivemind asks users for ``matchmaking_time`` and ``averaging_timeout``; a value right for 40
volunteers is wrong for 4 peers on a LAN. Here the matchmaking window follows how stale each
peer's view of the progress can be, and the averaging timeout follows the load-balancing LP's
lower bound on the round time for the actual group and vector size.
"""

from __future__ import annotations


def matchmaking_window(refresh_delay: float, dht_latency: float, *, minimum: float = 0.2) -> float:
    """How long a leader waits for joins after it decides to average.

    Peers learn that the target is reached at most one refresh period apart, then need a DHT
    read and an RPC to join: wait for both, twice over for safety.
    """
    return max(minimum, 2.0 * (refresh_delay + 2.0 * dht_latency))


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
