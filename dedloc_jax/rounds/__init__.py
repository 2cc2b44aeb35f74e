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

Re-exported here: the names other modules use.
"""

from dedloc_jax.rounds.across import AcrossGroups, averaged_weight, broadcast, representative
from dedloc_jax.rounds.average import Rounds, average_round
from dedloc_jax.rounds.context import RoundContext
from dedloc_jax.rounds.deadlines import Deadlines, averaging_timeout, matchmaking_window
from dedloc_jax.rounds.matchmaking import Matchmaker
from dedloc_jax.rounds.plan import expected_peers
from dedloc_jax.rounds.slots import Slots
from dedloc_jax.rounds.wire import MAX_STATE_BYTES, group_key, member_for

__all__ = [
    "MAX_STATE_BYTES",
    "AcrossGroups",
    "Deadlines",
    "Matchmaker",
    "RoundContext",
    "Rounds",
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
