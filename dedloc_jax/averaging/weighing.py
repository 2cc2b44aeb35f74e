"""What a verified round's aggregation weighed of each sender's contribution (pure).

A member that checked every share (:mod:`.audit`) holds every sender's signed weight and, per
chunk, its part's norm: the inputs of the reducers' robust weights
(:func:`.verify.robust_weights`), which every member recomputes alike. From them, per sender,
the fraction of the values it sent that counted for something (a non-zero robust weight); a
sender that registered or signed weight 0 kept nothing. Progress counts a sender's sample
claims only while its contribution weighs (:mod:`dedloc_jax.rounds.claims`): a -1000x gradient
weighs nothing, and its samples counted toward every epoch's target all the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .group import Member
from .verify import Statement, clips, counted_weight, robust_weights


def kept_fractions(
    members: Sequence[Member],
    statements: Mapping[int, Statement],
    chunks: Iterable[tuple[int, int, frozenset[int], int]],
    robust: bool,
    fixed_tau: float | None,
) -> dict[str, float]:
    """Per sending member (by peer ID): the fraction of the values it contributed to
    ``chunks`` ((share, chunk, contributors, values) each) whose part had a non-zero weight in
    the aggregate; 0.0 for one whose group spec or signed statement gives it weight 0. A sender
    in no chunk (its parts lost, repaired away) is left out: nothing was weighed."""
    sent = [0] * len(members)
    kept = [0] * len(members)
    for j, k, mask, size in chunks:
        order = sorted(mask)
        figs = [statements[i].shares.get(j) if i in statements else None for i in order]
        if any(f is None or not math.isfinite(f.q[k]) for f in figs):
            continue  # not checked (a statement missing): no verdict from this chunk
        raw = [counted_weight(statements[i].weight, float(members[i].weight)) for i in order]
        norms = [float(f.norms[k]) for f in figs]  # type: ignore[union-attr]
        clipped = clips(robust, fixed_tau, len(order))
        weights = robust_weights(raw, norms, fixed_tau) if clipped else raw
        for i, w in zip(order, weights, strict=True):
            sent[i] += size
            kept[i] += size if w > 0 else 0
    out: dict[str, float] = {}
    for i, m in enumerate(members):
        if not m.sends:
            continue
        st = statements.get(i)
        if not m.weight > 0 or (st is not None and not st.weight > 0):
            out[m.peer_id] = 0.0
        elif sent[i] > 0:
            out[m.peer_id] = kept[i] / sent[i]
    return out


def kept_of(rnd: Any) -> dict[str, float]:
    """:func:`kept_fractions` of a finished, audited :class:`~.butterfly.AllReduceState`."""
    chunks = []
    for j in rnd.reducers:
        for k, mask in enumerate(rnd.masks[j]):
            a, b = rnd.share_slice(j, k)
            chunks.append((j, k, mask, b - a))
    cfg = rnd.config
    return kept_fractions(rnd.members, rnd.statements, chunks, cfg.robust_mode, cfg.robust_tau)
