"""Vouches: a peer's signed word that it averaged with named peers into a state.

After a step, a peer signs ``(run, epoch, digest, mates)``: the state it stepped to and the
peers it averaged with into it. A mate copies that vouch into its own state announcement (it
keeps the newest few), so that anyone reading it can check, from the signature alone, that
another peer averaged with the announcer: its averaging history. A signature over a
digest alone proves nothing (anyone can sign any digest); one naming the announcer as a mate
is what a fresh identity cannot get without averaging with the run.

The fork choice counts only vouched announcements as votes while any exists
(:func:`dedloc_jax.state.lineage._voters`): Sybil announcers that never averaged with the run
cannot outvote it, however many. A run of one, or a run's first epoch, has no vouch yet: then
every stepped state counts as before.

A signature costs nothing, so Sybils can vouch for each other: five that did outvoted three
honest peers. A vouch therefore counts only when its signer is trusted (:class:`VouchBook`):
we averaged with it ourselves (our anchors), or a trusted signer vouched for it. A peer that
has averaged with nobody yet (a newcomer) traces signers to its *roots* instead: the peers it
joined through (the IDs in its initial peers' addresses, which it chose). Five Sybils minting
vouches for each other led a newcomer that trusted every signer to their forged state. Only a
newcomer with no root either (the run's first peer) trusts every signer. Sybils that first
average with honest peers are not caught by this rule (identities cost nothing in an open run;
a private run's invitations are the cost), nor are roots that lie.

A root that trains nothing (a bootstrap peer, a coordinator) announces no state and averages
with nobody: a newcomer joined through it traced no signer, counted every announcer, and five
Sybils minting vouches led it to their forged state. Such a newcomer asks its roots whom they
trust (:meth:`VouchBook.trusted_peers`, :meth:`VouchBook.adopt`), and loads no state while
none traces to them but where no vouch exists at all (the run's first epochs). A root with
neither roots nor mates (the run's first peer) anchors on the signers of the first vouches it
reads (trust on first use: it follows the run from its start, before any newcomer; Sybils
there before its first read are the limit).

Trust traced to one's own mates is a view of one's own clique: two groups of honest peers that
averaged apart from the run's start (a partition, two pairs of late trainers) each vouch only
for themselves, each counted only its own side in the fork choice and won, and the run trained
two models for good. Signatures cannot tell such a group from Sybils minting vouches for each
other (both cost nothing), so the peers a run's members share decide: their roots. While the
fork choice sees a state it does not count, a peer with roots asks them whom they trust
(:meth:`VouchBook.endorse`); the peers they name, the roots themselves, and the peers those
vouched for are *endorsed*, and while any announcement is, only endorsed ones vote
(:func:`dedloc_jax.state.lineage._voters`). Every peer that joined through the same roots then
counts the same voters: the side with fewer of them (of as many, the one the tie rules leave)
loses, loads the other's state and averages with it. A group the roots trust none of loses to
one they trust, whatever its size. Sybils gain nothing: the roots trust them no more than
before (their trust on first use is still the limit), and an endorsement only ever names peers
that averaged with a trusted one.

Groups whose roots share nothing either: two first peers (no roots), each trusting on first use
its own group, linked only by a peer that joined through both. Each group's roots trusted only
it, so each won in its own view, for good; and no signature tells the other first peer from a
Sybil's. The link is the answer: a peer joined through several roots introduces them to each
other at its start (:func:`~dedloc_jax.state.download.introduce_roots`), and a first peer
introduced while it trusts nobody yet takes the others as *co-founders* (:meth:`VouchBook.cofound`),
whose trust it takes as its own (:meth:`VouchBook.join`): both groups are then endorsed in every
view, and the fork choice's counts pick one side for all. An introduction after our trust on
first use changes nothing, so a Sybil root costs what a Sybil present at that first use does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from p2p.errors import P2PError
from p2p.identity import PeerID, verify_signature

log = logging.getLogger(__name__)

MAX_MATES = 64  # peers one vouch names (a group's members; larger groups are cut)
MAX_VOUCHES = 8  # vouches one announcement carries (its own, then its mates')
MAX_BOOK = 4096  # vouched peers a VouchBook remembers (then forgotten)
MAX_TRUSTED = 1024  # peers a root names when a newcomer asks whom it trusts
MAX_COFOUNDERS = 8  # other roots a root takes as the run's co-founders (see VouchBook.cofound)
_DOMAIN = b"dedloc-jax state vouch v1\0"


def vouch_payload(run_id: str, epoch: int, digest: bytes, mates: Sequence[str]) -> bytes:
    """The bytes a vouch signs: the run, the state, and the sorted mates (length-prefixed)."""
    parts = [run_id.encode(), str(epoch).encode(), digest, *(m.encode() for m in mates)]
    return _DOMAIN + b"".join(len(p).to_bytes(4, "big") + p for p in parts)


@dataclass(frozen=True)
class Vouch:
    """``key``'s signature saying: I averaged with ``mates`` into ``digest`` of ``epoch``."""

    epoch: int
    digest: bytes
    mates: tuple[str, ...]
    key: bytes
    sig: bytes

    @property
    def signer(self) -> str:
        return str(PeerID.from_public_key(self.key))

    def valid(self, run_id: str) -> bool:
        return verify_signature(
            self.key, self.sig, vouch_payload(run_id, self.epoch, self.digest, self.mates)
        )

    def to_wire(self) -> list:
        return [self.epoch, self.digest, list(self.mates), self.key, self.sig]

    @classmethod
    def from_wire(cls, value: Any) -> Vouch | None:
        """The vouch ``value`` encodes, or None when it is malformed (not verified here)."""
        if not isinstance(value, list) or len(value) != 5:
            return None
        epoch, digest, mates, key, sig = value
        if not (
            isinstance(epoch, int)
            and isinstance(digest, bytes)
            and isinstance(mates, list)
            and len(mates) <= MAX_MATES
            and all(isinstance(m, str) and len(m) <= 64 for m in mates)
            and isinstance(key, bytes)
            and isinstance(sig, bytes)
        ):
            return None
        try:
            PeerID.from_public_key(key)
        except P2PError:
            return None
        return cls(epoch, digest, tuple(mates), key, sig)


def sign_vouch(
    identity: Any, run_id: str, epoch: int, digest: bytes, mates: Iterable[str]
) -> Vouch:
    """Our vouch for the state we stepped to, naming the ``mates`` we averaged with."""
    me = str(identity.peer_id)
    named = tuple(sorted({str(m) for m in mates} - {me}))[:MAX_MATES]
    sig = identity.sign(vouch_payload(run_id, epoch, digest, named))
    return Vouch(epoch, digest, named, identity.public_key, sig)


def vouched_by_another(
    run_id: str,
    peer: str,
    vouches: Iterable[Vouch],
    trusted: Callable[[str], bool] | None = None,
) -> bool:
    """Whether one of ``vouches`` is another peer's valid word that ``peer`` averaged with it
    (signed by someone else, naming ``peer``): its averaging history. ``trusted``: whose
    signatures count (None: anyone's)."""
    return any(
        peer in v.mates
        and v.signer != peer
        and (trusted is None or trusted(v.signer))
        and v.valid(run_id)
        for v in vouches
    )


def vouched_names(
    run_id: str, vouches: Iterable[Vouch], trusted: Callable[[str], bool] | None = None
) -> set[str]:
    """The peers ``vouches`` prove averaged with another: each mate a valid vouch names,
    where its signer is ``trusted`` (None: anyone) or named so itself (the chain goes on
    until nothing changes). Each signature is verified once, and only a trusted signer's."""
    pending = {(v.key, v.sig): v for v in vouches}
    named: set[str] = set()
    changed = True
    while changed and pending:
        changed = False
        for k, v in list(pending.items()):
            signer = v.signer
            if not (trusted is None or signer in named or trusted(signer)):
                continue
            del pending[k]
            if v.valid(run_id):
                fresh = set(v.mates) - {signer} - named
                changed = changed or bool(fresh)
                named |= fresh
    return named


class VouchBook:
    """The peers a read announcement proved to have averaged with another (verified once,
    when read); the progress table's states are marked by it (its records carry no
    vouches). Also whose vouches count: the peers we averaged with (:meth:`anchor`) and,
    from them on, the peers they vouched for (see the module's note on Sybils)."""

    def __init__(self, roots: Iterable[str] = ()) -> None:
        self._peers: set[str] = set()
        self._anchors: set[str] = set()
        self._roots = frozenset(roots)
        # Whom our roots trust (their word, our roots once they gave it, and the peers those
        # vouched for): empty until a root answered (see the module's note on groups apart).
        self._endorsed: set[str] = set()
        # Other first peers of the run, introduced before our trust on first use, and whom
        # they trust (see the module's note on groups with different roots).
        self._cofounders: set[str] = set()
        self._cofounded: set[str] = set()
        self.orphan_warned = False  # (find_donors says it once)

    def record(self, peer: str) -> None:
        if len(self._peers) >= MAX_BOOK:
            self._peers.clear()
        self._peers.add(peer)

    def vouched(self, peer: str) -> bool:
        return peer in self._peers

    @property
    def grounded(self) -> bool:
        """Whether our trust starts somewhere (mates or roots): else we trust every signer."""
        return bool(self._anchors or self._roots)

    def ground(self, signers: Iterable[str]) -> None:
        """Trust on first use: a book with neither roots nor mates (the run's first peer)
        takes ``signers`` (of the first valid vouches it read) as its anchors."""
        if self.grounded:
            return
        first = sorted(set(signers))[:MAX_BOOK]
        if first:
            log.info(
                "trusting the %d signers of the first vouches read (trust on first use)", len(first)
            )
            self._peers.clear()
            self._anchors.update(first)
            self._peers.update(first)

    def trusted_peers(self) -> list[str]:
        """Whom we trust, as a newcomer joined through us asks (:meth:`adopt`): our anchors,
        then the peers traced to them (at most :data:`MAX_TRUSTED`); none while we trust every
        signer (our word would be worth no more than the newcomer's)."""
        if not self.grounded:
            return []
        anchors = sorted(self._anchors)
        return (anchors + sorted((self._peers | self._cofounded) - self._anchors))[:MAX_TRUSTED]

    def cofound(self, roots: Iterable[str], me: str) -> int:
        """A peer joined through us and through ``roots`` besides (it named them all): while we
        are a first peer that trusts nobody yet (no roots, no mates, before our trust on first
        use), those roots are our co-founders, whose trust we take as our own (:meth:`join`).
        Later introductions change nothing: a Sybil root is then no co-founder. Returns how
        many were new."""
        if self.grounded:
            return 0
        new = 0
        for root in roots:
            if root != me and root not in self._cofounders:
                if len(self._cofounders) >= MAX_COFOUNDERS:
                    break
                self._cofounders.add(root)
                new += 1
        return new

    @property
    def cofounders(self) -> frozenset[str]:
        return frozenset(self._cofounders)

    def join(self, peers: Iterable[str]) -> int:
        """A co-founder named ``peers`` as those it trusts: we trust them, and their vouches,
        as our own first signers (our newcomers are told them). Returns how many were new."""
        if not self._cofounders:
            return 0
        new = 0
        for peer in peers:
            if peer not in self._cofounded and len(self._cofounded) < MAX_BOOK:
                self._cofounded.add(peer)
                new += 1
        return new

    def adopt(self, peers: Iterable[str]) -> int:
        """A root named ``peers`` as those it trusts: as a newcomer (roots, no mates), we trust
        their vouches as our roots' own. Returns how many were new."""
        if self._anchors or not self._roots:
            return 0
        new = 0
        for peer in peers:
            if peer not in self._peers:
                self.record(peer)
                new += 1
        return new

    def anchor(self, peers: Iterable[str]) -> None:
        """``peers`` averaged with us: their vouches count, and they are vouched."""
        peers = list(peers)
        if peers and not self._anchors and not self._roots:
            self._peers.clear()  # recorded while we trusted every signer: Sybils' among them
        for peer in peers:
            if len(self._anchors) >= MAX_BOOK:
                self._anchors.clear()
            self._anchors.add(peer)
            self.record(peer)

    def endorse(self, peers: Iterable[str]) -> int:
        """Our roots named ``peers`` as those they trust: they (and the roots) are endorsed,
        and so are the peers their vouches name (:meth:`endorses`). Returns how many were
        new. A book without roots, or an empty answer (a root that trusts every signer, or
        none yet), endorses nobody."""
        peers = list(peers)
        if not self._roots or not peers:
            return 0
        new = 0
        for peer in (*sorted(self._roots), *peers):
            if peer not in self._endorsed:
                if len(self._endorsed) >= MAX_BOOK:
                    self._endorsed.clear()
                self._endorsed.add(peer)
                new += 1
        return new

    def endorsed(self, peer: str) -> bool:
        """Whether our roots trust ``peer`` (themselves included, once they answered)."""
        return peer in self._endorsed

    def endorses(self, signer: str) -> bool:
        """Whether ``signer``'s vouches make the peers they name endorsed: an endorsed one's."""
        return signer in self._endorsed

    @property
    def referred(self) -> bool:
        """Whether a root has answered whom it trusts (then endorsed peers outrank our own)."""
        return bool(self._endorsed)

    @property
    def roots(self) -> frozenset[str]:
        return self._roots

    def orphaned(self, announced: Iterable[Any]) -> bool:
        """Whether, as a newcomer, nothing ``announced`` traces to our roots: we averaged with
        nobody, joined through roots, and none of the announcements is a root's own or vouched
        by a signer traced to one. Then :meth:`trusts` names nobody, and the fork choice would
        count every unvouched announcer. Where the roots are gone too (left, or unreachable),
        Sybils minting states for each other led such a newcomer: it waits instead (fail safe,
        :func:`~dedloc_jax.state.download.find_donors`)."""
        if not self._roots or self._anchors:
            return False
        return not any(
            getattr(a, "vouched", False) or str(a.peer) in self._roots for a in announced
        )

    def trusts(self, signer: str) -> bool:
        """Whether ``signer``'s vouches count: our mates' and the peers they (or theirs)
        vouched for; until we averaged with someone, our roots' and the peers traced to them;
        every signer's when we have neither."""
        if self._anchors:
            return signer in self._anchors or signer in self._peers or signer in self._cofounded
        if self._roots:
            return signer in self._roots or signer in self._peers
        return True
