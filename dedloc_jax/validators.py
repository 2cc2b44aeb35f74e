"""Schemas of the run's own DHT keys, installed by default on every collaboration's DHT.

A node that stores or forwards a record of ``RUN.progress``, ``RUN.group.E`` (and ``.x``) or
``RUN.state`` checks it against the shape its readers expect (:mod:`dedloc_jax.progress`,
:mod:`dedloc_jax.rounds.wire`, :mod:`dedloc_jax.state.serving`): each is a signed subkey of
the peer it describes, fields typed and bounded, numbers finite. A record of another shape is
refused where it is stored (and where it is read: a node that skips the checks cannot pass it
on), and the writer gets the reason back (``DHT.store`` raises it,
``python -m p2p.dht store`` prints it), instead of readers each skipping it later. Addresses
must parse as multiaddrs; every record lives at most ``MAX_RECORD_TTL``. The NAT keys' schemas
come from :func:`p2p.nat.nat_validators`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from dedloc_jax.averaging.group import MODES as MEMBER_MODES
from dedloc_jax.bans import MAX_EVIDENCE, MAX_PIECES, MAX_REASON, PIECE
from dedloc_jax.bans import MAX_RECORDS as MAX_BANS
from dedloc_jax.bans import ROLES as BAN_ROLES
from dedloc_jax.config import MAX_RECORD_TTL
from dedloc_jax.progress import (
    MAX_DIGEST,
    MAX_LINEAGE,
    MAX_OUTCOME,
    MAX_PEER_CHARS,
    MAX_POLL,
    MAX_TARGET,
    MIN_POLL,
    MODES,
)
from dedloc_jax.rounds.wire import MAX_BPS, MAX_STATE_BYTES
from dedloc_jax.state.vouching import MAX_MATES, MAX_VOUCHES
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
from p2p.errors import P2PError
from p2p.multiaddr import Multiaddr
from p2p.nat import nat_validators

MAX_ADDRS = 32  # addresses a record may list (interfaces plus relayed ones)
MAX_ADDR_CHARS = 512
MAX_EPOCH = 10**9  # a step every 0.1 s for three years; 2**53 - 1 was taken
MAX_SAMPLES = MAX_TARGET
MAX_RATE = 1e9  # samples/s of one peer: far above anything real, finite
CLOCK_SLACK = 60.0  # seconds of clock difference a record's lifetime is allowed on top
_DNS = ("dns", "dns4", "dns6", "dnsaddr")
_HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


@dataclass(frozen=True)
class Addr:
    """A multiaddr's text that parses, with host names of letters, digits, dots and dashes
    (markup in a state offer's addresses made every trainer log it once a second)."""

    max_len: int = MAX_ADDR_CHARS

    def check(self, value: Any, path: str) -> str | None:
        if not isinstance(value, str) or len(value) > self.max_len:
            return f"{path} must be a multiaddr of at most {self.max_len} characters"
        try:
            addr = Multiaddr.parse(value)
        except P2PError:
            return f"{path} is not a multiaddr"
        for proto, host in addr.components:
            if proto in _DNS and (host is None or _HOSTNAME.fullmatch(host) is None):
                return f"{path} names a malformed host"
        return None


_addrs = ListOf(Addr(), max_len=MAX_ADDRS)
# Fields a newer version adds to the records every peer publishes (progress, registration,
# state): stored and passed on, never read. The strict schema refused "poll" on older nodes.
NEWER_FIELDS = 4
_digest = Bytes(MAX_DIGEST)

PROGRESS = Struct(
    {
        "epoch": Int(0, MAX_EPOCH),
        "samples": Int(0, MAX_SAMPLES),
        "sps": Float(0.0, MAX_RATE),
        "time": Float(),
        "mode": OneOf(MODES),
        "interval": Float(0.0, 1e9),
        "waiting": Bool(),
        "state": Tuple((Int(0, MAX_EPOCH), _digest, ListOf(_digest, max_len=MAX_LINEAGE))),
        "averages": Bool(),
        "target": Int(1, MAX_TARGET),
        "alone": Bool(),
        "outcome": Tuple(
            (
                Int(0, MAX_EPOCH),
                ListOf(Str(MAX_PEER_CHARS), max_len=MAX_OUTCOME),
                ListOf(Str(MAX_PEER_CHARS), max_len=MAX_OUTCOME),
            )
        ),
        "poll": Float(MIN_POLL, MAX_POLL),
    },
    optional=frozenset(
        {"interval", "waiting", "state", "averages", "target", "alone", "outcome", "poll"}
    ),
    newer=NEWER_FIELDS,
)
"""A :class:`~dedloc_jax.progress.PeerProgress` record (``to_record``)."""

MEMBER = Struct(
    {
        "mode": OneOf(MEMBER_MODES),
        "up": Float(1e-9, MAX_BPS),
        "down": Float(1e-9, MAX_BPS),
        "weight": Float(0.0, MAX_SAMPLES),
    },
    newer=NEWER_FIELDS,
)

REGISTRATION = Struct(
    {"member": MEMBER, "addrs": _addrs, "state": Bytes(MAX_STATE_BYTES)},
    optional=frozenset({"state"}),
    newer=NEWER_FIELDS,
)
"""A matchmaking registration under ``RUN.group.E`` (or ``RUN.group.E.x``)."""

STATE_ANNOUNCEMENT = Struct(
    {
        "epoch": Int(0, MAX_EPOCH),
        "digest": _digest,
        "lineage": ListOf(_digest, max_len=MAX_LINEAGE),
        "addrs": _addrs,
        "vouches": ListOf(
            Tuple(
                (
                    Int(0, MAX_EPOCH),
                    _digest,
                    ListOf(Str(64), max_len=MAX_MATES),
                    Bytes(32),  # an Ed25519 public key
                    Bytes(64),  # its signature
                )
            ),
            max_len=MAX_VOUCHES,
        ),
    },
    optional=frozenset({"vouches"}),
    newer=NEWER_FIELDS,
)
"""A state donor's announcement under ``RUN.state`` (``vouches``: :mod:`dedloc_jax.state.
vouching`, each ``[epoch, digest, mates, key, signature]``)."""


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
                    "pieces": ListOf(Bytes(32), max_len=MAX_PIECES),
                    "index": Bytes(32),
                },
                optional=frozenset({"pieces", "index"}),
            ),
            max_len=MAX_BANS,
        )
    }
)
"""An accuser's convictions under ``RUN.bans`` (:mod:`dedloc_jax.bans`)."""

EVIDENCE_PIECE = Bytes(PIECE)
"""One piece of a ban's evidence under ``RUN.evidence.<its sha256>`` (readers check the
hash)."""


def run_validators(run_id: str) -> list[RecordValidator]:
    """The validators every DHT node of run ``run_id`` installs: its keys and the NAT keys."""
    run = re.escape(run_id)
    ttl = MAX_RECORD_TTL + CLOCK_SLACK
    return [
        KeySchema("progress record", rf"{run}\.progress", PROGRESS, max_ttl=ttl),
        KeySchema(
            "group registration",
            rf"{run}\.group\.[0-9]{{1,16}}(\.x)?",
            REGISTRATION,
            max_ttl=ttl,
        ),
        KeySchema("state announcement", rf"{run}\.state", STATE_ANNOUNCEMENT, max_ttl=ttl),
        KeySchema("ban list", rf"{run}\.bans", BAN, max_ttl=ttl),
        KeySchema("ban evidence", rf"{run}\.evidence\.[0-9a-f]{{64}}", EVIDENCE_PIECE, max_ttl=ttl),
        *nat_validators(),
    ]
