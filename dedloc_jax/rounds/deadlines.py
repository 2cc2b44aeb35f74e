"""Adaptive deadlines, derived from predictions instead of fixed knobs.

hivemind asks users for ``matchmaking_time`` and ``averaging_timeout``; a value right for 40
volunteers is wrong for 4 peers on a LAN. Here the matchmaking window follows how stale each
peer's view of the progress can be, and the averaging timeout follows the load-balancing LP's
lower bound on the round time for the actual group and vector size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


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


@dataclass(frozen=True)
class Deadlines:
    """Every deadline of one epoch's round, derived in one place.

    The matchmaking part follows the window (how stale peers' views are); the averaging part
    follows the group's links and the vector size through the LP's lower bound (members not
    measured yet count as slow home links, never as infinitely fast ones: a bound of zero
    would time the first round out).
    """

    window: float
    """How long a peer waits for others to register, and a leader for joins."""
    lp_bound: float = 0.0
    """The LP's optimal round time for the group (0 before the group is known)."""
    averaging: float = 0.0
    """How long the all-reduce round may take (0 before the group is known)."""
    eager: bool = False
    """Every peer the round expects checks mid-step whether to average (each announces it:
    :meth:`~dedloc_jax.rounds.stepping.Stepper.poll`), so all notice the target a poll apart:
    the matchmaking asks the missing ones at once and reads without a first poll
    (:class:`~dedloc_jax.rounds.matchmaking.Matchmaker`)."""

    @property
    def max_wait(self) -> float:
        """The longest a peer waits for others to register (then it goes with what it has)."""
        return 10 * self.window + 5.0

    @property
    def member_wait(self) -> float:
        """The longest a leader waits for a member it saw registered in its group."""
        return min(self.max_wait, 4 * self.window + 2.0)

    @property
    def registration_ttl(self) -> float:
        """How long a registration lives: past every wait of the matchmaking it is for."""
        return self.max_wait + 6 * self.window + 30.0

    @property
    def relocate_interval(self) -> float:
        """How often a follower of the registrations looks for the key's holders again."""
        return self.max_wait + 6 * self.window

    @property
    def join_timeout(self) -> float:
        """A follower's call to its leader: the leader may hold the group up to max_wait."""
        return self.max_wait + 6 * self.window + 10.0

    @property
    def cross_wait(self) -> float:
        """How long a member waits for its representative's round across groups: that
        round's matchmaking (at most) and two all-reduce rounds."""
        return 2 * self.max_wait + 4 * self.window + 2 * self.averaging

    def for_group(
        self,
        lp_bound_seconds: float,
        rtt: float,
        *,
        override: float | None = None,
    ) -> Deadlines:
        """These deadlines with the averaging part for a group whose LP bound is known;
        ``override`` is a user-set averaging timeout."""
        timeout = override or averaging_timeout(lp_bound_seconds, rtt)
        return replace(self, lp_bound=lp_bound_seconds, averaging=timeout)
