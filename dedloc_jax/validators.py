"""Schemas of the run's own DHT keys, installed by default on every collaboration's DHT.

A node that stores or forwards a record of ``RUN.progress``, ``RUN.group.E`` (and ``.x``) or
``RUN.state`` checks it against the shape its readers expect (:mod:`dedloc_jax.progress`,
:mod:`dedloc_jax.round.wire`, :mod:`dedloc_jax.state.serving`): each is a signed subkey of
the peer it describes, fields typed and bounded, numbers finite. A record of another shape is
refused where it is stored, and the writer gets the reason back (``DHT.store`` raises it,
``python -m p2p.dht store`` prints it), instead of readers each skipping it later. Text such as
addresses is taken as data, never interpreted, and bounded in length. The NAT keys' schemas
come from :func:`p2p.nat.nat_validators`.
"""

from __future__ import annotations

import re

from dedloc_jax.averaging.group import MODES as MEMBER_MODES
from dedloc_jax.bans import MAX_EVIDENCE, MAX_REASON
from dedloc_jax.bans import MAX_RECORDS as MAX_BANS
from dedloc_jax.bans import ROLES as BAN_ROLES
from dedloc_jax.progress import MAX_DIGEST, MAX_LINEAGE, MAX_TARGET, MODES
from dedloc_jax.round.wire import MAX_STATE_BYTES
from p2p.dht import (
    Bool,
    Bytes,
    Float,
    Int,
    KeySchema,
    ListOf,
    OneOf,
    RecordValidator,
    Str,
    Struct,
    Tuple,
)
from p2p.nat import nat_validators

MAX_ADDRS = 32  # addresses a record may list (interfaces plus relayed ones)
MAX_ADDR_CHARS = 512
MAX_EPOCH = 1 << 53
MAX_RATE = 1e15  # samples/s, bytes/s: far above anything real, finite

_addrs = ListOf(Str(MAX_ADDR_CHARS), max_len=MAX_ADDRS)
_digest = Bytes(MAX_DIGEST)

PROGRESS = Struct(
    {
        "epoch": Int(0, MAX_EPOCH),
        "samples": Int(0, MAX_EPOCH),
        "sps": Float(0.0, MAX_RATE),
        "time": Float(),
        "mode": OneOf(MODES),
        "interval": Float(0.0, 1e9),
        "waiting": Bool(),
        "state": Tuple((Int(0, MAX_EPOCH), _digest, ListOf(_digest, max_len=MAX_LINEAGE))),
        "averages": Bool(),
        "target": Int(1, MAX_TARGET),
        "alone": Bool(),
    },
    optional=frozenset({"interval", "waiting", "state", "averages", "target", "alone"}),
)
"""A :class:`~dedloc_jax.progress.PeerProgress` record (``to_record``)."""

MEMBER = Struct(
    {
        "mode": OneOf(MEMBER_MODES),
        "up": Float(1e-9, MAX_RATE),
        "down": Float(1e-9, MAX_RATE),
        "weight": Float(0.0, MAX_RATE),
    }
)

REGISTRATION = Struct(
    {"member": MEMBER, "addrs": _addrs, "state": Bytes(MAX_STATE_BYTES)},
    optional=frozenset({"state"}),
)
"""A matchmaking registration under ``RUN.group.E`` (or ``RUN.group.E.x``)."""

STATE_ANNOUNCEMENT = Struct(
    {
        "epoch": Int(0, MAX_EPOCH),
        "digest": _digest,
        "lineage": ListOf(_digest, max_len=MAX_LINEAGE),
        "addrs": _addrs,
    }
)
"""A state donor's announcement under ``RUN.state``."""


BAN = Struct(
    {
        "bans": ListOf(
            Struct(
                {
                    "peer": Str(64),
                    "role": OneOf(BAN_ROLES),
                    "reason": Str(MAX_REASON),
                    "round": Bytes(64),
                    "evidence": Bytes(MAX_EVIDENCE),
                    "digest": Bytes(32),
                }
            ),
            max_len=MAX_BANS,
        )
    }
)
"""An accuser's convictions under ``RUN.bans`` (:mod:`dedloc_jax.bans`)."""


def run_validators(run_id: str) -> list[RecordValidator]:
    """The validators every DHT node of run ``run_id`` installs: its keys and the NAT keys."""
    run = re.escape(run_id)
    return [
        KeySchema("progress record", rf"{run}\.progress", PROGRESS),
        KeySchema("group registration", rf"{run}\.group\.[0-9]{{1,16}}(\.x)?", REGISTRATION),
        KeySchema("state announcement", rf"{run}\.state", STATE_ANNOUNCEMENT),
        KeySchema("ban list", rf"{run}\.bans", BAN),
        *nat_validators(),
    ]
