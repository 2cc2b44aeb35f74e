"""Private runs from the command line: the ``invite`` role and the checks a peer makes at start.

The organiser holds the owner key (an Ed25519 key file, created by the first ``invite``).
``invite --owner-key FILE --peer PEER_ID --expires 7d [--role node|client|aux]`` writes that
peer's invitation (signed, for one run) and prints the owner's public key, which every peer
passes as ``--owner PUBKEY`` (hex). The coordinator runs with ``--owner-key FILE``: it is the
owner's own peer and needs no invitation. Peers refuse the records and RPCs of anyone not
invited (``dedloc_jax.access``); this module refuses, before anything is built, to start a
peer that would be refused, and says what to do instead.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from dataclasses import dataclass
from pathlib import Path

from dedloc_jax.access import AccessDenied, Invitation, invite
from p2p.errors import IdentityError
from p2p.identity import PUBLIC_KEY_BYTES, Identity

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class PrivateRunError(ValueError):
    """A peer cannot take part in the private run as started; the message says why and how."""


def parse_expiry(text: str, now: float | None = None) -> float:
    """Unix time from ``7d`` / ``12h`` / ``30m`` / ``90s`` (from now), an ISO date or time
    (``2026-12-31``, ``2026-12-31T18:00``; UTC unless it names a zone), or unix seconds."""
    now = time.time() if now is None else now
    m = _DURATION.fullmatch(text.strip())
    if m:
        return now + float(m.group(1)) * _UNITS[m.group(2)]
    try:
        seconds = float(text)
    except ValueError:
        seconds = None
    if seconds is not None:
        return seconds if seconds > 1e9 else _bad_expiry(text)
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        return _bad_expiry(text)
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def _bad_expiry(text: str) -> float:
    raise PrivateRunError(
        f"--expires {text!r:.40}: give a duration (7d, 12h, 30m), an ISO date or time "
        "(2026-12-31, 2026-12-31T18:00, UTC), or unix seconds"
    )


def parse_owner(text: str) -> bytes:
    """The owner's raw public key from its hex form (as ``invite`` prints it)."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != PUBLIC_KEY_BYTES:
        raise PrivateRunError(
            f"--owner must be the owner's public key in hex ({2 * PUBLIC_KEY_BYTES} digits, as "
            "`invite` prints it)"
        )
    return key


def write_invitation(
    owner_key: Path,
    run_id: str,
    peer: str,
    expires: str,
    role: str | None,
    out: Path | None,
) -> tuple[Path, Invitation]:
    """Sign ``peer``'s invitation with the owner key (created if missing) and write it."""
    owner = Identity.load_or_create(owner_key)
    expiry = parse_expiry(expires)
    if expiry <= time.time():
        raise PrivateRunError(f"--expires {expires!r}: that time has passed")
    if not re.fullmatch(r"[1-9A-HJ-NP-Za-km-z]{20,100}", peer):
        raise PrivateRunError(f"--peer {peer!r:.60} is not a peer ID (base58, as peers print it)")
    data = invite(owner, run_id, peer, expiry, role)
    path = out if out is not None else Path(f"{peer}.invitation")
    path.write_bytes(data)
    return path, Invitation.from_bytes(data)


def invitation_run_id(invitation: Path) -> str | None:
    """The run an invitation file admits to (None when it is unreadable: ``peer_access``
    then says why)."""
    try:
        return Invitation.from_bytes(invitation.read_bytes()).run_id
    except (OSError, AccessDenied, ValueError, TypeError):
        return None


def describe_key(key_file: Path, *, create: bool) -> tuple[str, bool]:
    """The lines that name a key file's peer ID and public key (``--owner`` takes the hex
    key), and whether the file was created now."""
    existed = key_file.exists()
    try:
        me = Identity.load_or_create(key_file) if create else Identity.load(key_file)
    except IdentityError as e:
        raise PrivateRunError(str(e)) from None
    text = (
        f"peer ID: {me.peer_id}\n"
        f"public key: {me.public_key.hex()} (for a run's owner key: what peers pass as --owner)"
    )
    return text, not existed


@dataclass(frozen=True)
class Access:
    """What a peer passes to its collaboration: the owner key, its invitation, its identity."""

    owner_public_key: bytes | None = None
    invitation: bytes | None = None
    identity: Path | None = None


def peer_access(
    *,
    run_id: str,
    mode: str,
    owner: str | None,
    invitation: Path | None,
    identity: Path | None,
    now: float | None = None,
) -> Access:
    """Check a trainer's or aux peer's ``--owner/--invitation/--identity`` before it starts;
    :class:`PrivateRunError` (saying what to do) when peers would refuse it."""
    if owner is None:
        if invitation is not None:
            raise PrivateRunError("--invitation needs --owner PUBKEY (the run's owner key)")
        return Access(identity=identity)
    key = parse_owner(owner)
    if identity is None:
        raise PrivateRunError(
            "a private run needs --identity FILE: the invitation names a peer ID, which only "
            "a key file keeps the same from one start to the next"
        )
    try:
        me = Identity.load_or_create(identity)
    except IdentityError as e:
        raise PrivateRunError(str(e)) from None
    if invitation is None:
        raise PrivateRunError(
            f"run {run_id!r} is private and this peer ({me.peer_id}) has no invitation: send "
            f"that peer ID to the organiser, who runs `python -m examples.sahajbert invite "
            f"--peer {me.peer_id} ...`, then start again with --invitation FILE"
        )
    try:
        data = invitation.read_bytes()
        inv = Invitation.from_bytes(data)
        inv.verify(key, me.peer_id, time.time() if now is None else now, run_id)
    except OSError as e:
        raise PrivateRunError(f"cannot read the invitation {invitation}: {e}") from None
    except AccessDenied as e:
        raise PrivateRunError(
            f"the invitation {invitation} does not admit this peer: {e}"
        ) from None
    if not inv.allows(mode):
        raise PrivateRunError(f"the invitation {invitation} is for role {inv.role!r}, not {mode!r}")
    return Access(key, data, identity)


def owner_access(owner_key: Path, identity: Path | None) -> Access:
    """The coordinator's: it runs as the owner (its peer ID is the owner key's)."""
    if identity is not None:
        raise PrivateRunError("--owner-key is the coordinator's identity: drop --identity")
    try:
        owner = Identity.load(owner_key)
    except IdentityError as e:
        raise PrivateRunError(f"{e} (the first `invite` creates the owner key)") from None
    return Access(owner.public_key, None, owner_key)
