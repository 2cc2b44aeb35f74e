"""What matchmaking peers send each other: RPC names, the DHT key of an epoch's registrations,
slots, state digests and members on the wire. Pure: no I/O."""

from __future__ import annotations

import math
from typing import Any

from dedloc_jax.averaging.errors import GroupError
from dedloc_jax.averaging.group import Member

JOIN = "collab.join"
LEADER = "collab.leader"
"""Asked by a leader of a member it expected that has not joined: whom do you follow?"""


def group_key(run_id: str, epoch: int, level: int = 0) -> str:
    return f"{run_id}.group.{epoch}" + (".x" if level else "")


Slot = tuple[int, int]
"""(epoch, level): one group formation."""


def slot_of(request: Any) -> Slot:
    """The epoch and level a join or leader query is about (level 0 when left out)."""
    if not isinstance(request, dict) or not isinstance(request.get("epoch"), int):
        raise ValueError("a matchmaking request is a map with an integer epoch")
    level = request.get("level", 0)
    if level not in (0, 1) or isinstance(level, bool):
        raise ValueError(f"matchmaking level must be 0 or 1, got {level!r}")
    return request["epoch"], level


MAX_STATE_BYTES = 64


def state_from_wire(value: Any) -> bytes | None:
    """The digest of the state a peer steps from, as it sent it (None: it did not say)."""
    if value is None:
        return None
    if not isinstance(value, bytes) or not 0 < len(value) <= MAX_STATE_BYTES:
        raise GroupError(f"a state digest is 1 to {MAX_STATE_BYTES} bytes")
    return value


def member_to_wire(m: Member) -> dict[str, Any]:
    return {
        "mode": m.mode,
        "up": float(m.upload_bps),
        "down": float(m.download_bps),
        "weight": float(m.weight),
    }


def member_from_wire(peer_id: str, msg: Any) -> Member:
    if not isinstance(msg, dict):
        raise GroupError("a member description is a map")
    try:
        m = Member(peer_id, msg["mode"], msg["up"], msg["down"], msg["weight"])
    except KeyError as e:
        raise GroupError(f"member description misses {e}") from None
    except TypeError as e:
        raise GroupError(f"malformed member description: {e}") from None
    if not math.isfinite(m.weight):  # a claim of samples: a spec's "unbounded" is no claim
        raise GroupError(f"weight of {peer_id} must be finite, got {m.weight!r}")
    return m


MAX_BPS = 1e12
"""Bytes/s a member may state (what :func:`member_for` makes of an unknown link)."""


def member_for(
    peer_id: str, mode: str, upload_bps: float, download_bps: float, weight: float
) -> Member:
    """This peer's member entry; infinite, unknown or larger bandwidths become :data:`MAX_BPS`
    (a registration stating more is refused by every node: the peer would never register)."""

    def finite(x: float) -> float:
        return MAX_BPS if not math.isfinite(x) or x <= 0 else min(float(x), MAX_BPS)

    return Member(peer_id, mode, finite(upload_bps), finite(download_bps), float(weight))
