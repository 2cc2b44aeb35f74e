"""One averaging round of an epoch, from the trigger to the wire, read top-down:

- :mod:`~dedloc_jax.rounds.deadlines`: every deadline of a round, one frozen object (pure);
- :mod:`~dedloc_jax.rounds.plan`: whom a peer expects, whom its lineage leaves out, which group
  it is in (pure; :mod:`~dedloc_jax.rounds.grouping`: the consistent hashing behind it);
- :mod:`~dedloc_jax.rounds.wire`: what matchmaking peers send each other (pure);
- :mod:`~dedloc_jax.rounds.context`: what a round needs from its peer, passed in at
  construction;
- :mod:`~dedloc_jax.rounds.slots`: one record per slot (epoch, level), pruned in one place;
- :mod:`~dedloc_jax.rounds.matchmaking`: registering for a slot, reading the others and
  forming one group per slot, as follower or leader
  (:mod:`~dedloc_jax.rounds.following`, :mod:`~dedloc_jax.rounds.leading`: the two sides);
- :mod:`~dedloc_jax.rounds.across`: the second level, across capped groups;
- :mod:`~dedloc_jax.rounds.average`: :func:`average_round`, one round as trainers and aux peers
  run it, over all of the above;
- :mod:`~dedloc_jax.rounds.stepping`: a peer's averaging step around the round (its window, the
  verdict on the mean, the history).

Re-exported here: the names other modules use, and (deprecated) ``Rounds`` and ``RoundContext``,
the names ``Averager`` and ``PeerSide`` had before issue #47: they import with a warning.
"""

import warnings
from typing import Any

from dedloc_jax.rounds.across import AcrossGroups, averaged_weight, broadcast, representative
from dedloc_jax.rounds.average import Averager, average_round
from dedloc_jax.rounds.context import PeerSide
from dedloc_jax.rounds.deadlines import Deadlines, averaging_timeout, matchmaking_window
from dedloc_jax.rounds.matchmaking import Matchmaker
from dedloc_jax.rounds.plan import expected_peers
from dedloc_jax.rounds.slots import Slots
from dedloc_jax.rounds.wire import MAX_STATE_BYTES, group_key, member_for

__all__ = [
    "MAX_STATE_BYTES",
    "AcrossGroups",
    "Averager",
    "Deadlines",
    "Matchmaker",
    "PeerSide",
    "Slots",
    "average_round",
    "averaged_weight",
    "averaging_timeout",
    "broadcast",
    "expected_peers",
    "group_key",
    "matchmaking_window",
    "member_for",
    "representative",
]

_RENAMED = {"Rounds": "Averager", "RoundContext": "PeerSide"}
"""Old names of this package's classes: each still resolves, and warns, for code written
before they were renamed to say what they hold."""


def __getattr__(name: str) -> Any:
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"dedloc_jax.rounds.{name} is deprecated: use dedloc_jax.rounds.{new}",
        DeprecationWarning,
        stacklevel=2,
    )
    return globals()[new]
