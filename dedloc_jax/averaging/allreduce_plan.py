"""What one all-reduce round is, fixed when it starts, and what a member holds during it.

:class:`AllReducePlan` is built once per round and never changes: the group, our index, the
split into shares and chunks, the codec, our counted weight and the deadlines.
:class:`Holdings` is the part of a member's state the roles share while the round runs: its own
vector and the result values it holds, chunk by chunk. The reducer and the repair read the plan
and write the holdings; neither reads the round's state itself
(:class:`.butterfly.AllReduceState` wires the three together).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import trio

from .chunk_codecs import is_finite
from .config import AllReduceConfig
from .group import GroupSpec, Member
from .leaf_codecs import LeafCodecs
from .partition import chunk_bounds, share_bounds
from .verify import Statement, counted_weight


@dataclass(frozen=True)
class AllReducePlan:
    """One member's fixed view of a round (see :meth:`build`)."""

    round_id: bytes
    spec: GroupSpec
    me: int
    config: AllReduceConfig
    codec: LeafCodecs
    size: int
    """Values in the flat vector every member averages."""
    weight: float
    """Our counted weight (:meth:`bounded_weight` of the weight we were given)."""
    abstain: bool
    """We contribute nothing: an aux peer, a weight of 0, or a non-finite vector."""
    bounds: tuple[int, ...]
    """Share ``j`` is ``bounds[j]:bounds[j + 1]`` of the vector."""
    reducers: tuple[int, ...]
    """Members whose share is not empty."""
    chunks: Mapping[int, tuple[tuple[int, int], ...]]
    """Per reducer, its share's chunks (offsets within the share)."""
    deadline: float
    collect_at: float
    exchange_at: float
    join_at: float
    data_at: float
    senders: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "senders", frozenset(self.spec.senders))

    @classmethod
    def build(
        cls,
        spec: GroupSpec,
        me: int,
        vec: np.ndarray | None,
        weight: float,
        codec: LeafCodecs,
        config: AllReduceConfig,
        round_id: bytes,
        timeout: float,
    ) -> AllReducePlan:
        """The plan of a round starting now (its deadlines count from the current time)."""
        size = int(vec.size) if vec is not None else 0
        sends = spec.members[me].sends
        # A sender's weight counts for at most its member entry's (which the leader bounded,
        # rounds/claims.py): ours as theirs, so every member applies the same rule.
        counted = counted_weight(float(weight), float(spec.members[me].weight))
        abstain = (not sends) or counted <= 0 or (vec is not None and not is_finite(vec))
        bounds = share_bounds(size, spec.share_parts())
        reducers = tuple(j for j in range(len(spec.members)) if bounds[j + 1] > bounds[j])
        chunks = {j: chunk_bounds(bounds[j + 1] - bounds[j], config.chunk_elems) for j in reducers}
        t0 = trio.current_time()
        return cls(
            round_id,
            spec,
            me,
            config,
            codec,
            size,
            counted,
            abstain,
            bounds,
            reducers,
            MappingProxyType(chunks),
            deadline=t0 + timeout,
            collect_at=t0 + config.collect_fraction * timeout,
            exchange_at=t0 + config.exchange_fraction * timeout,
            join_at=t0 + config.join_fraction * timeout,
            data_at=t0 + config.data_fraction * timeout,
        )

    @property
    def members(self) -> tuple[Member, ...]:
        return self.spec.members

    @property
    def is_sender(self) -> bool:
        return self.members[self.me].sends

    def name(self, i: int) -> str:
        return self.members[i].peer_id

    def bounded_weight(self, s: int, stated: float) -> float:
        """The weight sender ``s`` counts for (:func:`.verify.counted_weight`)."""
        return counted_weight(stated, float(self.members[s].weight))

    def share_slice(self, j: int, k: int) -> tuple[int, int]:
        """Chunk ``k`` of share ``j``, as a range of the whole vector."""
        a, b = self.chunks[j][k]
        return self.bounds[j] + a, self.bounds[j] + b


class Holdings:
    """What this member holds in a round: its own vector (``vec``; None once the round is over
    or on an aux peer) and, per share, the result chunks it holds so far (``out`` is the whole
    result vector, None on an aux peer; ``held[j]`` chunks of share ``j`` are in it, with each
    chunk's contributor mask, CenteredClip radius, the reducer's signature and, in a verified
    round, the encoded bytes as received)."""

    def __init__(self, plan: AllReducePlan, vec: np.ndarray | None) -> None:
        reducers = plan.reducers
        self.vec = vec
        # Results land in the vector itself when it is our own copy of the tree (one vector of
        # memory, not two): a chunk is overwritten only after its part was sent, and the parts
        # a repair asks for are the chunks we never received.
        # A verified round keeps the parts until its check is over: results go elsewhere.
        private = (
            vec is not None and vec.flags.owndata and vec.flags.writeable and not plan.config.verify
        )
        self.out = (vec if private else np.zeros(plan.size, np.float32)) if plan.is_sender else None
        self.held = dict.fromkeys(reducers, 0)
        self.masks: dict[int, list[frozenset[int]]] = {j: [] for j in reducers}
        self.taus: dict[int, list[float | None]] = {j: [] for j in reducers}
        self.result_sigs: dict[int, list[bytes | None]] = {j: [] for j in reducers}
        self.result_bytes: dict[int, list[bytes]] = {j: [] for j in reducers}
        # A verified round: each held chunk's result digest (what its reducer signed) with the
        # mask and radius it covers, hashed once on receipt (or when we reduced it), not again
        # for our statement.
        self.result_digests: dict[int, list[tuple[frozenset[int], float | None, bytes]]] = {
            j: [] for j in reducers
        }
        # A verified round: each reducer's public key, proven against its peer ID on receipt
        # of its first result chunk (an aux reducer states nothing else that would name it).
        self.reducer_keys: dict[int, bytes] = {}
        # A verified round: each aux reducer's statement (it swaps none: it holds no result),
        # sent with its first result chunk; it lists the signed hellos it counted on.
        self.aux_statements: dict[int, Statement] = {}
        # A verified round's reducer: the signed hellos of the senders that opened an exchange
        # with it (and its own), by member: listed in its statement as what it may count.
        self.hellos: dict[int, dict] = {}
