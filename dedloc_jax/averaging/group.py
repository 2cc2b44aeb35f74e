"""The agreed description of an all-reduce group, identical on every member.

Matchmaking produces a :class:`GroupSpec`; every member checks it holds the same one by comparing
:meth:`GroupSpec.digest` (the butterfly protocol sends it with every stream and rejects a mismatch).
Share sizes come from the spec alone, so members never disagree on who reduces which range.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import msgpack

from .errors import GroupError
from .partition import FRACTION_GRID

Mode = Literal["node", "client", "aux"]
MODES: tuple[str, ...] = ("node", "client", "aux")
_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Member:
    """One member: peer ID (base58 text), mode, measured bandwidths in BYTES/s, expected weight.

    ``node`` sends its vector and reduces a share; ``client`` (behind NAT/firewall) only sends and
    receives over connections it dials; ``aux`` (no accelerator) only reduces.
    """

    peer_id: str
    mode: Mode = "node"
    upload_bps: float = math.inf
    download_bps: float = math.inf
    weight: float = math.inf
    """The most this member's contribution counts for (its samples, as the leader bounded
    its claim: rounds/claims.py); a larger weight it states in the round counts as this.
    Infinite: the spec does not bound it (groups made by hand, private tests)."""

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, str) or not self.peer_id:
            raise GroupError(f"member peer_id must be non-empty text, got {self.peer_id!r}")
        if self.mode not in MODES:
            raise GroupError(f"member mode must be one of {MODES}, got {self.mode!r}")
        for name in ("upload_bps", "download_bps"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or math.isnan(value) or value <= 0:
                raise GroupError(f"{name} of {self.peer_id} must be > 0, got {value!r}")
        w = self.weight
        if not isinstance(w, int | float) or math.isnan(w) or w < 0:
            raise GroupError(f"weight of {self.peer_id} must be >= 0, got {w!r}")

    @property
    def sends(self) -> bool:
        """Whether this member contributes a vector (and so needs the result back)."""
        return self.mode != "aux"

    def _canonical(self) -> list:
        return [
            self.peer_id,
            self.mode,
            float(self.upload_bps),
            float(self.download_bps),
            float(self.weight),
        ]


@dataclass(frozen=True)
class GroupSpec:
    """Ordered members plus (optionally) the share split chosen by the group's leader.

    ``parts`` are integers out of :data:`FRACTION_GRID`, one per member (0 for clients). When the
    leader leaves them out, every member solves the same load-balancing LP and quantises its result
    to the grid; carrying them in the spec makes agreement independent of the solver's platform.
    """

    members: tuple[Member, ...]
    group_id: bytes = b""
    parts: tuple[int, ...] | None = None
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple(self.members))
        if not self.members:
            raise GroupError("a group needs at least one member")
        ids = [m.peer_id for m in self.members]
        if len(set(ids)) != len(ids):
            raise GroupError("duplicate peer IDs in group")
        if not any(m.sends for m in self.members):
            raise GroupError("a group needs at least one node or client (aux peers only reduce)")
        if not any(m.mode != "client" for m in self.members):
            raise GroupError("a group needs at least one node or aux peer to reduce")
        if self.parts is not None:
            parts = tuple(int(p) for p in self.parts)
            object.__setattr__(self, "parts", parts)
            if len(parts) != len(self.members) or any(p < 0 for p in parts):
                raise GroupError("parts must give one non-negative integer per member")
            if sum(parts) != FRACTION_GRID:
                raise GroupError(f"parts must sum to {FRACTION_GRID}")
            if any(p and m.mode == "client" for p, m in zip(parts, self.members, strict=True)):
                raise GroupError("a client cannot own a share")

    # ---- canonical form -------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """Canonical serialisation: same spec -> same bytes on every machine."""
        body = [
            _FORMAT_VERSION,
            bytes(self.group_id),
            [m._canonical() for m in self.members],
            list(self.parts) if self.parts is not None else None,
        ]
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> GroupSpec:
        """Parse and validate bytes from :meth:`to_bytes` (possibly from the network)."""
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=True)
            version, group_id, members, parts = body
            if version != _FORMAT_VERSION or not isinstance(group_id, bytes):
                raise GroupError("unknown group spec format")
            parsed = tuple(Member(str(p), mode, up, down, w) for p, mode, up, down, w in members)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise GroupError(f"malformed group spec: {e}") from e
        if parts is not None and not (
            isinstance(parts, list) and all(isinstance(p, int) for p in parts)
        ):
            raise GroupError("malformed parts in group spec")
        return cls(parsed, group_id, tuple(parts) if parts is not None else None)

    @cached_property
    def digest(self) -> bytes:
        """SHA-256 of the canonical bytes: members compare it to know they agree."""
        return hashlib.sha256(self.to_bytes()).digest()

    # ---- roles ----------------------------------------------------------------------------
    def index_of(self, peer_id: object) -> int:
        key = str(peer_id)
        for i, m in enumerate(self.members):
            if m.peer_id == key:
                return i
        raise GroupError(f"{key} is not a member of this group")

    @property
    def senders(self) -> tuple[int, ...]:
        """Indices of members that contribute a vector and receive the result (node, client)."""
        return tuple(i for i, m in enumerate(self.members) if m.sends)

    def share_parts(self) -> tuple[int, ...]:
        """The agreed integer share split (from the spec, else from the load-balancing LP)."""
        if self.parts is not None:
            return self.parts
        if "parts" not in self._cache:
            from .load_balancing import solve_shares

            self._cache["parts"] = solve_shares(self.members).parts
        return self._cache["parts"]

    def lower_bound(self, vector_bytes: int) -> float:
        """The round's lower bound in seconds for the agreed split (the load-balancing model,
        :func:`~dedloc_jax.averaging.load_balancing.predicted_time`), for a timeout: no LP
        when the leader's spec carries the parts (one LP per round, not one per member)."""
        from .load_balancing import predicted_time

        fractions = [p / FRACTION_GRID for p in self.share_parts()]
        return predicted_time(self.members, fractions, vector_bytes)

    @property
    def reducers(self) -> tuple[int, ...]:
        """Indices of members that own a non-empty share fraction."""
        return tuple(i for i, p in enumerate(self.share_parts()) if p > 0)

    def with_parts(self, parts: tuple[int, ...] | None = None) -> GroupSpec:
        """A copy carrying explicit parts (the LP's, by default): what a leader distributes."""
        return GroupSpec(self.members, self.group_id, parts or self.share_parts())
