"""Peers caught lying in a verified round (:mod:`dedloc_jax.averaging.audit`), banned with
evidence that others check.

A peer bans whom it convicted itself, at once, and publishes the conviction under
``RUN.bans`` (one signed subkey per accuser: ``{"bans": [record, ...]}``, at most
:data:`MAX_RECORDS`, newest kept). A record carries the accusation's evidence (the signed
statements, the revealed parts, the reducer's signed result chunk) when it fits the record;
larger evidence (a chunk of 65,536 values from four members is ~660 KB, the DHT's values at
most 256 KiB) goes out in pieces of :data:`PIECE` bytes, each under its own content-addressed
key ``RUN.evidence.<sha256 of the piece>``, and the record lists the pieces' hashes; over
:data:`MAX_PIECES` pieces, the record names one *index* piece instead (the pieces' hashes, in
order, itself content-addressed), and a reader fetches at most :data:`MAX_PIECES` pieces per
read, going on at the next read. A peer reading it bans the accused only if
:func:`~dedloc_jax.averaging.audit.check_evidence` convicts them from the whole evidence (its
digest checked), so an accuser cannot ban an honest peer with a record alone. A record whose
evidence is missing (over :data:`MAX_INDEXED` pieces, or its pieces lost) is listed
(``verified: False``) and bans nobody but its writer's own rounds.
Banned peers are left out of groups (:class:`~dedloc_jax.rounds.context.PeerSide.banned`).
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
PIECE = 128 << 10
"""Bytes of evidence under one ``RUN.evidence`` key (well inside the DHT's value limit)."""
MAX_PIECES = 64
"""Pieces a record lists itself (8 MiB: a chunk of 262,144 values in fp32 from seven members),
and pieces a reader fetches per read."""
MAX_INDEXED = 1024
"""Pieces one ban's evidence may take through an index (128 MiB); larger evidence is not
published. The bound the defaults keep: a conviction's evidence is one chunk from each of at
most ``max_group_size`` (64) members, at most 4 bytes a value (no compression) and 262,144
values a chunk (the loopback preset's, the largest default): 64 MiB of parts and 1 MiB of
result, plus each member's signed statement (16 bytes per chunk of the whole vector, and a
reducer's 64 listed hellos) and its revealed hashes (32 bytes per chunk of the share, at most
the whole vector): within 128 MiB for vectors of up to ~5.6e9 values at that chunk (~1.4e9 at
the internet preset's). Pinned by
``test_byzantine.py::test_evidence_of_the_largest_default_group_and_chunk_is_published_and_verified``."""
MAX_REASON = 300
MAX_CHECKED = 1024
BAN_TTL = MAX_RECORD_TTL
"""A ban record's lifetime: the run's record limit; its accuser republishes it at half of it."""
REFRESH = 60.0
"""Seconds between reads of others' records."""
ROLES = ("reducer", "sender")


def bans_key(run_id: str) -> str:
    return f"{run_id}.bans"


def evidence_key(run_id: str, piece_hash: bytes) -> str:
    """Where one piece of a ban's evidence is stored: named by its own hash, so a reader
    checks it whoever wrote it."""
    return f"{run_id}.evidence.{piece_hash.hex()}"


def split_evidence(evidence: bytes) -> list[bytes]:
    """``evidence`` in pieces of at most :data:`PIECE` bytes."""
    return [evidence[i : i + PIECE] for i in range(0, len(evidence), PIECE)]


def index_piece(pieces: list[bytes]) -> bytes:
    """The index of evidence over :data:`MAX_PIECES` pieces: their hashes, in order (32 KiB
    for :data:`MAX_INDEXED`, one piece)."""
    return b"".join(hashlib.sha256(p).digest() for p in pieces)


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

    def to_record(self, inline: bool = True) -> dict:
        """The published record: the evidence in it when ``inline`` and it fits, else the
        hashes of its pieces (:func:`split_evidence`) when there are few enough."""
        rec = {
            "peer": self.peer,
            "role": self.role,
            "reason": self.reason[:MAX_REASON],
            "round": self.round_id[:64],
            "evidence": b"",
            "digest": hashlib.sha256(self.evidence).digest(),
        }
        pieces = split_evidence(self.evidence)
        if inline and len(self.evidence) <= MAX_EVIDENCE:
            rec["evidence"] = self.evidence
        elif len(pieces) <= MAX_PIECES:
            rec["pieces"] = [hashlib.sha256(p).digest() for p in pieces]
        elif len(pieces) <= MAX_INDEXED:
            rec["index"] = hashlib.sha256(index_piece(pieces)).digest()
        return rec

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
        # (accuser, accused, evidence digest) whose evidence convicted nobody: not fetched again
        self._checked: set[tuple[str, str, Any]] = set()
        self._budget = MAX_PIECES
        self._pieces_out: set[bytes] = set()  # digests whose pieces we stored (renewed when stale)
        # Indexed evidence being fetched across reads (one at a time): (accuser, accused,
        # digest) -> (the pieces' hashes, the pieces fetched so far).
        self._partial: dict[tuple[str, str, bytes], tuple[list[bytes], list[bytes]]] = {}
        self._seen: set[tuple[str, str, bytes]] = set()

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
            size += len(ban.evidence)
            rec = ban.to_record(inline=size <= MAX_EVIDENCE)
            split = rec.get("pieces") or rec.get("index")
            if split and (stale or rec["digest"] not in self._pieces_out):
                await self._store_pieces(ban.evidence, indexed="index" in rec)
                self._pieces_out.add(rec["digest"])
            elif not rec["evidence"] and not split and ban.peer not in self._bare:
                self._bare.add(ban.peer)
                log.warning(
                    "the evidence against %s is %d bytes, over the %d pieces of %d bytes a "
                    "ban may take: published without it, so only peers that catch %s "
                    "themselves will ban it",
                    ban.peer,
                    len(ban.evidence),
                    MAX_INDEXED,
                    PIECE,
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

    async def _store_pieces(self, evidence: bytes, indexed: bool = False) -> None:
        pieces = split_evidence(evidence)
        for piece in [*pieces, index_piece(pieces)] if indexed else pieces:
            try:
                await self.dht.store(
                    evidence_key(self.run_id, hashlib.sha256(piece).digest()),
                    piece,
                    self.dht.now() + BAN_TTL,
                    subkey=owner_marker(self.node.peer_id),
                )
            except (P2PError, InvalidRecordError) as e:
                log.warning("could not publish a piece of ban evidence: %s", e)

    async def _piece(self, h: bytes) -> bytes | None:
        """The piece of evidence hashing to ``h``, whoever stored it (None: none found)."""
        try:
            value = await self.dht.get(evidence_key(self.run_id, h))
        except P2PError as e:
            log.info("could not read a piece of ban evidence: %s", e)
            return None
        items = value.values() if isinstance(value, dict) else ()
        for i in items:
            if isinstance(i.value, bytes) and hashlib.sha256(i.value).digest() == h:
                return i.value
        return None

    async def _fetch(self, pieces: list[bytes], digest: bytes) -> bytes:
        """A ban's evidence from its pieces (b"" when one is missing or the whole does not
        hash to ``digest``); each piece is checked against its hash, whoever stored it."""
        out = []
        for h in pieces:
            piece = await self._piece(h)
            if piece is None:
                return b""
            out.append(piece)
        whole = b"".join(out)
        return whole if hashlib.sha256(whole).digest() == digest else b""

    async def _fetch_indexed(self, key: tuple[str, str, bytes], index: bytes) -> bytes:
        """Evidence through its index piece, at most the read's budget of pieces at a time
        (b"" until it is whole, or when a piece is missing or the whole does not hash to the
        record's digest). One such download at a time: a reader holds at most
        :data:`MAX_INDEXED` pieces, and fetches :data:`MAX_PIECES` a read, whoever floods."""
        self._seen.add(key)
        job = self._partial.get(key)
        if job is None:
            if self._partial or self._budget < 1:
                return b""  # another is under way, or this read's budget is spent
            self._budget -= 1
            raw = await self._piece(index)
            n = len(raw) // 32 if raw is not None else 0
            if raw is None or len(raw) % 32 or not MAX_PIECES < n <= MAX_INDEXED:
                return b""
            job = self._partial[key] = ([raw[32 * i : 32 * i + 32] for i in range(n)], [])
        hashes, got = job
        while len(got) < len(hashes) and self._budget > 0:
            self._budget -= 1
            piece = await self._piece(hashes[len(got)])
            if piece is None:
                del self._partial[key]
                return b""
            got.append(piece)
        if len(got) < len(hashes):
            log.info(
                "fetched %d of %d pieces of the evidence against %s", len(got), len(hashes), key[1]
            )
            return b""
        del self._partial[key]
        whole = b"".join(got)
        return whole if hashlib.sha256(whole).digest() == key[2] else b""

    async def refresh(self, *, force: bool = False) -> None:
        """Read others' records (at most every :data:`REFRESH` s) and adopt proven bans."""
        now = trio.current_time()
        if not force and now < self._read_at + REFRESH:
            return
        self._read_at = now
        # Pieces fetched per read, at most (accusers minting fresh evidence each minute cost a
        # reader this much, not a download per record).
        self._budget = MAX_PIECES
        self._seen = set()
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
                await self._consider(names[0], rec)
        for key in set(self._partial) - self._seen:  # its record is gone: so is the download
            del self._partial[key]

    async def _consider(self, accuser: str, rec: Any) -> None:
        if not isinstance(rec, dict):
            return
        peer, role, reason = rec.get("peer"), rec.get("role"), rec.get("reason")
        round_id, evidence = rec.get("round"), rec.get("evidence")
        pieces, digest, index = rec.get("pieces"), rec.get("digest"), rec.get("index")
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
        if (accuser, peer, digest) in self._checked:
            return  # its evidence was fetched and checked already: it did not convict
        if (
            not evidence
            and isinstance(pieces, list)
            and 0 < len(pieces) <= min(MAX_PIECES, self._budget)
            and all(isinstance(h, bytes) and len(h) == 32 for h in pieces)
            and isinstance(digest, bytes)
        ):
            self._budget -= len(pieces)
            evidence = await self._fetch(pieces, digest)
        elif (
            not evidence
            and isinstance(index, bytes)
            and len(index) == 32
            and isinstance(digest, bytes)
        ):
            evidence = await self._fetch_indexed((accuser, peer, digest), index)
        proven = False
        if evidence:
            try:
                proven = check_evidence(
                    msgpack.unpackb(evidence, raw=False, strict_map_key=False), peer
                )
            except (ValueError, TypeError, msgpack.UnpackException):
                proven = False
        ban = Ban(peer, role, reason, round_id, accuser, proven)
        if evidence and not proven:
            if len(self._checked) >= MAX_CHECKED:
                self._checked.clear()
            self._checked.add((accuser, peer, digest))
        if proven:
            log.warning("banning %s on %s's evidence: %s", peer, accuser, reason)
            self._banned[peer] = ban
        else:
            self._reported[(accuser, peer)] = ban
