"""Peers caught lying in a verified round (:mod:`dedloc_jax.averaging.audit`), banned with
evidence that others check.

A peer bans whom it convicted itself, at once, and publishes the conviction under
``RUN.bans`` (one signed subkey per accuser: ``{"bans": [record, ...]}``, at most
:data:`MAX_RECORDS`, newest kept). A record carries the accusation's evidence (the signed
statements, the revealed parts, the reducer's signed result chunk) when it fits the DHT's value
limit: a peer reading it bans the accused only if :func:`~dedloc_jax.averaging.audit.
check_evidence` convicts them from it, so an accuser cannot ban an honest peer with a record
alone. A record too large to carry its evidence is listed (``verified: False``) and bans
nobody but its writer's own rounds. Banned peers are left out of groups
(:class:`~dedloc_jax.rounds.context.RoundContext.banned`).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import msgpack
import trio

from dedloc_jax.averaging.audit import Accusation, check_evidence
from dedloc_jax.config import MAX_RECORD_TTL
from dedloc_jax.run_dht import RunDHT
from p2p.dht.errors import InvalidRecordError
from p2p.dht.records import owner_marker, owner_markers
from p2p.errors import P2PError
from p2p.node import Node

log = logging.getLogger(__name__)

MAX_RECORDS = 8
MAX_EVIDENCE = 160 << 10
"""Evidence bytes one record may carry (the DHT refuses values over 256 KiB)."""
MAX_REASON = 300
BAN_TTL = MAX_RECORD_TTL
"""A ban record's lifetime: the run's record limit; its accuser republishes it at half of it."""
REFRESH = 60.0
"""Seconds between reads of others' records."""
ROLES = ("reducer", "sender")


def bans_key(run_id: str) -> str:
    return f"{run_id}.bans"


@dataclass(frozen=True)
class Ban:
    """One peer banned: who, why, in which round, by whom, and whether we checked it."""

    peer: str
    role: str
    reason: str
    round_id: bytes
    accuser: str
    verified: bool
    evidence: bytes = b""

    def to_record(self) -> dict:
        return {
            "peer": self.peer,
            "role": self.role,
            "reason": self.reason[:MAX_REASON],
            "round": self.round_id[:64],
            "evidence": self.evidence if len(self.evidence) <= MAX_EVIDENCE else b"",
            "digest": hashlib.sha256(self.evidence).digest(),
        }

    def to_json(self) -> dict:
        """For status.json and the dashboard."""
        return {
            "peer": self.peer,
            "role": self.role,
            "reason": self.reason,
            "round": self.round_id.hex()[:16],
            "by": self.accuser,
            "verified": self.verified,
        }


def _pack_evidence(evidence: dict) -> bytes:
    return msgpack.packb(evidence, use_bin_type=True)


class Bans:
    """This peer's ban list: its own convictions and others' that their evidence proves."""

    def __init__(self, node: Node, dht: RunDHT, run_id: str) -> None:
        self.node = node
        self.dht = dht
        self.run_id = run_id
        self.me = str(node.peer_id)
        self._banned: dict[str, Ban] = {}
        self._reported: dict[tuple[str, str], Ban] = {}  # (accuser, peer): unproven records
        self._mine: list[Ban] = []
        self._dirty = False
        self._published_at = -float("inf")
        self._read_at = -float("inf")
        self._bare: set[str] = set()  # peers whose evidence we published without, once logged

    def is_banned(self, peer: str) -> bool:
        return peer in self._banned

    def convict(self, accusation: Accusation) -> None:
        """Ban the peer we caught ourselves (our own check needs nobody's word)."""
        if accusation.peer == self.me or accusation.peer in self._banned:
            return
        ban = Ban(
            accusation.peer,
            accusation.role,
            accusation.reason,
            accusation.round_id,
            self.me,
            True,
            _pack_evidence(accusation.evidence),
        )
        log.warning("banning %s (%s): %s", ban.peer, ban.role, ban.reason)
        self._banned[ban.peer] = ban
        self._mine = [*self._mine, ban][-MAX_RECORDS:]
        self._dirty = True

    def listing(self) -> list[dict]:
        """Banned peers (verified) and unproven reports, for status displays."""
        out = [b.to_json() for b in self._banned.values()]
        out += [b.to_json() for b in self._reported.values() if b.peer not in self._banned]
        return out

    async def publish(self) -> None:
        """Store our convictions (with what evidence fits) if they changed or their record is
        past half its lifetime."""
        stale = self._mine and trio.current_time() > self._published_at + BAN_TTL / 2
        if not (self._dirty or stale):
            return
        records, size = [], 0
        for ban in reversed(self._mine):
            rec = ban.to_record()
            size += len(ban.evidence)
            if size > MAX_EVIDENCE:
                rec["evidence"] = b""
                if ban.peer not in self._bare:
                    self._bare.add(ban.peer)
                    log.warning(
                        "the evidence against %s is %d bytes, over the %d bytes our ban record "
                        "may carry with the others': published without it, so only peers that "
                        "catch %s themselves will ban it",
                        ban.peer,
                        len(ban.evidence),
                        MAX_EVIDENCE,
                        ban.peer,
                    )
            records.append(rec)
        try:
            await self.dht.store(
                bans_key(self.run_id),
                {"bans": records},
                self.dht.now() + BAN_TTL,
                subkey=owner_marker(self.node.peer_id),
            )
            self._dirty = False
            self._published_at = trio.current_time()
        except (P2PError, InvalidRecordError) as e:
            log.warning("could not publish bans: %s", e)

    async def refresh(self, *, force: bool = False) -> None:
        """Read others' records (at most every :data:`REFRESH` s) and adopt proven bans."""
        now = trio.current_time()
        if not force and now < self._read_at + REFRESH:
            return
        self._read_at = now
        try:
            value = await self.dht.get(bans_key(self.run_id))
        except P2PError as e:
            log.info("could not read bans: %s", e)
            return
        if not isinstance(value, dict):
            return
        for subkey, item in value.items():
            names = owner_markers(subkey)
            v = item.value
            if len(names) != 1 or names[0] == self.me or not isinstance(v, dict):
                continue
            for rec in v.get("bans", [])[:MAX_RECORDS] if isinstance(v.get("bans"), list) else []:
                self._consider(names[0], rec)

    def _consider(self, accuser: str, rec: Any) -> None:
        if not isinstance(rec, dict):
            return
        peer, role, reason = rec.get("peer"), rec.get("role"), rec.get("reason")
        round_id, evidence = rec.get("round"), rec.get("evidence")
        if not (
            isinstance(peer, str)
            and role in ROLES
            and isinstance(reason, str)
            and isinstance(round_id, bytes)
            and isinstance(evidence, bytes)
        ):
            return
        if peer in self._banned or peer == self.me:
            return
        proven = False
        if evidence:
            try:
                proven = check_evidence(
                    msgpack.unpackb(evidence, raw=False, strict_map_key=False), peer
                )
            except (ValueError, TypeError, msgpack.UnpackException):
                proven = False
        ban = Ban(peer, role, reason, round_id, accuser, proven)
        if proven:
            log.warning("banning %s on %s's evidence: %s", peer, accuser, reason)
            self._banned[peer] = ban
        else:
            self._reported[(accuser, peer)] = ban
