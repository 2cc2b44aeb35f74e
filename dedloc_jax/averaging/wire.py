"""Messages of the all-reduce protocols and their validation (pure; nothing here does I/O).

Everything read from the network goes through a ``parse_*`` function that checks types, ranges
and sizes against what the local round expects, and raises :class:`BadContributionError`
otherwise; no size or offset is ever taken from a message without such a check.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .errors import BadContributionError

PROTOCOL = "dedloc/allreduce/2"  # 2: a result signature signs .verify.result_claim
REPAIR_PROTOCOL = "dedloc/allreduce-repair/1"


def _get(msg: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(msg, dict):
        raise BadContributionError(f"expected a map, got {type(msg).__name__}")
    value = msg.get(key)
    if isinstance(value, bool) and kind is not bool:
        raise BadContributionError(f"field {key!r} has the wrong type")
    if not isinstance(value, kind):
        raise BadContributionError(f"field {key!r} missing or of the wrong type")
    return value


def kind_of(msg: Any) -> str:
    return _get(msg, "t", str)


@dataclass(frozen=True)
class Hello:
    """First message of a sender's exchange stream (and of a repair request)."""

    round_id: bytes
    digest: bytes
    sender: int
    weight: float
    size: int
    codec: str
    abstain: bool
    share: int = -1  # repair only: the share being repaired
    held: int = 0  # repair only: how many leading chunks of that share the sender holds
    signed: dict | None = None
    """A verified round's exchange: the sender's :class:`~.verify.SignedHello` (wire form),
    checked by the reducer (:meth:`~.butterfly.AllReduceState.check_hello`)."""


def hello(h: Hello) -> dict:
    msg = {
        "t": "hello",
        "r": h.round_id,
        "g": h.digest,
        "s": h.sender,
        "w": float(h.weight),
        "n": h.size,
        "c": h.codec,
        "a": h.abstain,
        "j": h.share,
        "h": h.held,
    }
    if h.signed is not None:
        msg["sh"] = h.signed
    return msg


def parse_hello(msg: Any) -> Hello:
    if kind_of(msg) != "hello":
        raise BadContributionError("expected hello")
    weight = float(_get(msg, "w", (int, float)))
    if not math.isfinite(weight) or weight < 0:
        raise BadContributionError(f"bad weight {weight!r}")
    size = _get(msg, "n", int)
    if size < 0:
        raise BadContributionError("negative vector size")
    return Hello(
        round_id=_get(msg, "r", bytes),
        digest=_get(msg, "g", bytes),
        sender=_get(msg, "s", int),
        weight=weight,
        size=size,
        codec=_get(msg, "c", str),
        abstain=_get(msg, "a", bool),
        share=_get(msg, "j", int),
        held=_get(msg, "h", int),
        signed=_get(msg, "sh", dict) if "sh" in msg else None,
    )


def part(k: int, data: bytes) -> dict:
    return {"t": "part", "k": k, "d": data}


def parse_chunk(msg: Any, expected_k: int, expected_bytes: int) -> bytes:
    """The payload of a part/res/held/final message for chunk ``expected_k`` of known size."""
    k = _get(msg, "k", int)
    if k != expected_k:
        raise BadContributionError(f"chunk {k} out of order (expected {expected_k})")
    data = _get(msg, "d", bytes)
    if len(data) != expected_bytes:
        raise BadContributionError(f"chunk {k}: {len(data)} bytes, expected {expected_bytes}")
    return data


def result(
    k: int,
    data: bytes,
    contributors: Iterable[int],
    kind: str = "res",
    tau: float | None = None,
    sig: bytes | None = None,
    key: bytes | None = None,
    statement: dict | None = None,
) -> dict:
    msg: dict = {"t": kind, "k": k, "d": data, "m": sorted(contributors)}
    if tau is not None:
        msg["u"] = float(tau)
    if sig is not None:
        msg["sg"] = sig
    if key is not None:
        msg["pk"] = key
    if statement is not None:
        msg["st"] = statement
    return msg


def statement_of(msg: Any) -> dict | None:
    """An aux reducer's signed statement, sent with its first result chunk (unchecked here:
    :func:`~.verify.parse_statement` checks it against the round)."""
    if not isinstance(msg, dict) or "st" not in msg:
        return None
    return _get(msg, "st", dict)


def parse_key(msg: Any) -> bytes | None:
    """The reducer's public key, sent with its first signed result chunk (None if absent)."""
    if not isinstance(msg, dict) or "pk" not in msg:
        return None
    key = _get(msg, "pk", bytes)
    if len(key) != 32:
        raise BadContributionError("malformed reducer key")
    return key


def parse_sig(msg: Any) -> bytes | None:
    """A result chunk's signature by its reducer (None when results are not verified)."""
    if not isinstance(msg, dict) or "sg" not in msg:
        return None
    sig = _get(msg, "sg", bytes)
    if len(sig) != 64:
        raise BadContributionError("malformed result signature")
    return sig


def parse_tau(msg: Any) -> float | None:
    """A result chunk's CenteredClip radius (None: a plain mean)."""
    if not isinstance(msg, dict) or "u" not in msg:
        return None
    tau = _get(msg, "u", float)
    if not math.isfinite(tau) or not tau > 0:
        raise BadContributionError(f"bad CenteredClip radius {tau!r}")
    return tau


def parse_contributors(msg: Any, allowed: frozenset[int]) -> frozenset[int]:
    raw = _get(msg, "m", list)
    if len(raw) > len(allowed) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in raw
    ):
        raise BadContributionError("malformed contributor list")
    out = frozenset(raw)
    if len(out) != len(raw) or not out <= allowed:
        raise BadContributionError("contributor list names non-senders or repeats")
    return out


def need(held: tuple[int, int], parts: tuple[int, int]) -> dict:
    return {"t": "need", "held": list(held), "parts": list(parts)}


def parse_need(msg: Any, n_chunks: int) -> tuple[tuple[int, int], tuple[int, int]]:
    if kind_of(msg) != "need":
        raise BadContributionError("expected need")
    out = []
    for key in ("held", "parts"):
        rng = _get(msg, key, list)
        if len(rng) != 2 or not all(isinstance(v, int) for v in rng):
            raise BadContributionError(f"malformed {key} range")
        a, b = rng
        if not 0 <= a <= b <= n_chunks:
            raise BadContributionError(f"{key} range {a}..{b} outside 0..{n_chunks}")
        out.append((a, b))
    return out[0], out[1]


def simple(kind: str, **fields: Any) -> dict:
    return {"t": kind, **fields}
