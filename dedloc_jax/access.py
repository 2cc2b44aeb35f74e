"""Private collaborations: the owner's signed invitations and where honest peers check them.

The run's owner holds an Ed25519 key (a :class:`p2p.identity.Identity`). An
:class:`Invitation` names a run, a peer ID, an expiry (DHT time, i.e. unix seconds) and an
optional role, signed by the owner. A peer proves it in two ways, both checked against the
owner's public key only (no trusted third party, nothing to look up):

* **DHT records** (``<run_id>.*``): every record a peer writes under the run's keys lives in
  its owner-marked subkey, to which this module appends ``[invite:<token>]`` (expiry, role and
  signature, base64url). The writer's record signature covers the subkey, and any node — a
  storage node handling STORE, a reader checking a FIND answer — verifies the invitation from
  the record alone with :class:`InvitedWritersValidator`. Records of uninvited writers, and
  records with no owner at all, are refused under a private run's keys. Readers keep using
  :func:`p2p.dht.records.owner_markers` on the subkey unchanged.
* **RPCs** (``collab.join``, ``collab.leader``, the all-reduce streams, ``collab.state.*``):
  the handler knows the caller's authenticated peer ID; :class:`AccessGuard.admit` accepts it
  if an invitation for it was already seen (in any record this node validated), else asks the
  caller back over ``collab.auth`` for its invitation (one round trip, cached; refusals are
  cached briefly).

The owner's own peer ID (the one derived from the owner key) needs no invitation. An expired
invitation stops working everywhere at once: records carrying it are refused and RPCs denied.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from p2p.dht import DHT
from p2p.dht.errors import InvalidRecordError
from p2p.dht.records import Record, owner_marker
from p2p.dht.validation import record_owner
from p2p.errors import IdentityError, P2PError
from p2p.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, PeerID, verify_signature
from p2p.node import Node

log = logging.getLogger(__name__)

AUTH = "collab.auth"
ROLES = ("node", "client", "aux")
MAX_INVITATION_BYTES = 1024
INVITE_MARKER_RE = re.compile(r"\[invite:([A-Za-z0-9_-]{1,400})\]")
_DOMAIN = "dedloc-jax/invitation/1"
REFUSAL_CACHE_SECONDS = 30.0


class AccessDenied(ValueError):
    """A peer may not take part; ``reason`` says why (answered to RPC callers as is)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Invitation:
    """The owner's permission for ``peer_id`` to take part in ``run_id`` until ``expiry``."""

    run_id: str
    peer_id: str  # base58
    expiry: float  # DHT (unix) time
    role: str | None = None  # None: any mode
    signature: bytes = b""

    def __post_init__(self) -> None:
        if self.role is not None and self.role not in ROLES:
            raise AccessDenied(f"unknown role {self.role!r:.40}")
        if not math.isfinite(self.expiry):
            raise AccessDenied("expiry must be finite")

    def payload(self) -> bytes:
        """The bytes the owner signs (domain-separated from every other signature)."""
        return msgpack.packb([_DOMAIN, self.run_id, self.peer_id, float(self.expiry), self.role])

    def sign(self, owner: Identity) -> Invitation:
        return replace(self, signature=owner.sign(self.payload()))

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            [self.run_id, self.peer_id, float(self.expiry), self.role, self.signature],
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> Invitation:
        """Parse (not verify) an invitation; raises :class:`AccessDenied` when malformed."""
        if not isinstance(data, bytes) or len(data) > MAX_INVITATION_BYTES:
            raise AccessDenied(f"an invitation is at most {MAX_INVITATION_BYTES} bytes")
        try:
            fields = msgpack.unpackb(data, raw=False)
        except (ValueError, TypeError, msgpack.ExtraData) as e:
            raise AccessDenied(f"malformed invitation: {e!r:.80}") from None
        if not isinstance(fields, list) or len(fields) != 5:
            raise AccessDenied("malformed invitation: expected 5 fields")
        run_id, peer_id, expiry, role, sig = fields
        if not (
            isinstance(run_id, str)
            and isinstance(peer_id, str)
            and isinstance(expiry, float | int)
            and not isinstance(expiry, bool)
            and (role is None or isinstance(role, str))
            and isinstance(sig, bytes)
        ):
            raise AccessDenied("malformed invitation: wrong field types")
        return cls(run_id, peer_id, float(expiry), role, sig)

    def verify(
        self, owner_public_key: bytes, peer_id: PeerID | str, now: float, run_id: str | None = None
    ) -> None:
        """Raise :class:`AccessDenied` unless this is the owner's valid, unexpired invitation of
        ``peer_id`` (to ``run_id`` when given)."""
        if str(peer_id) != self.peer_id:
            raise AccessDenied(f"invitation is for {self.peer_id:.60}, not {peer_id}")
        if run_id is not None and run_id != self.run_id:
            raise AccessDenied(f"invitation is for run {self.run_id!r:.60}, not {run_id!r}")
        if len(self.signature) != SIGNATURE_BYTES or not verify_signature(
            owner_public_key, self.signature, self.payload()
        ):
            raise AccessDenied("invitation is not signed by the run's owner")
        if now >= self.expiry:
            raise AccessDenied(f"invitation expired at {self.expiry:.0f} (now {now:.0f})")

    def allows(self, mode: str | None) -> bool:
        """Whether the role admits ``mode`` (a ``node`` may also take part as a ``client``)."""
        if self.role is None or mode is None:
            return True
        return mode == self.role or (self.role == "node" and mode == "client")

    # --- compact form inside DHT subkeys (run and peer are implied by key and owner) --------
    def marker(self) -> str:
        token = msgpack.packb([float(self.expiry), self.role, self.signature], use_bin_type=True)
        return f"[invite:{_b64(token)}]"

    @classmethod
    def from_marker(cls, text: str | None, run_id: str, peer_id: str) -> Invitation | None:
        """The invitation in ``text``'s invite marker (None without one); malformed: denied."""
        found = INVITE_MARKER_RE.findall(text) if text else []
        if not found:
            return None
        if len(found) > 1:
            raise AccessDenied("more than one invitation marker")
        try:
            fields = msgpack.unpackb(_unb64(found[0]), raw=False)
        except (ValueError, TypeError, binascii.Error, msgpack.ExtraData) as e:
            raise AccessDenied(f"malformed invitation marker: {e!r:.80}") from None
        if not isinstance(fields, list) or len(fields) != 3:
            raise AccessDenied("malformed invitation marker")
        expiry, role, sig = fields
        if (
            not isinstance(expiry, float | int)
            or isinstance(expiry, bool)
            or not (role is None or isinstance(role, str))
            or not isinstance(sig, bytes)
        ):
            raise AccessDenied("malformed invitation marker: wrong field types")
        return cls(run_id, peer_id, float(expiry), role, sig)


def invite(
    owner: Identity, run_id: str, peer_id: PeerID | str, expiry: float, role: str | None = None
) -> bytes:
    """What the owner hands a peer (e.g. as ``AccessConfig.invitation``)."""
    return Invitation(run_id, str(peer_id), expiry, role).sign(owner).to_bytes()


class AccessPolicy:
    """Who may take part in a private run: invitations seen so far, checked against the owner key.

    ``clock`` gives DHT time (the collaboration passes its DHT clock's ``now``), in which
    invitations expire.
    """

    def __init__(
        self,
        run_id: str,
        owner_public_key: bytes,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if len(owner_public_key) != PUBLIC_KEY_BYTES:
            raise ValueError(f"the owner's public key has {PUBLIC_KEY_BYTES} bytes")
        self.run_id = run_id
        self.owner_public_key = owner_public_key
        self.owner = PeerID.from_public_key(owner_public_key)
        self.clock = clock
        self._invites: dict[str, Invitation] = {}

    def learn(self, invitation: Invitation | bytes, peer_id: PeerID | str) -> Invitation:
        """Verify ``invitation`` for ``peer_id`` now and remember it; raises AccessDenied."""
        inv = Invitation.from_bytes(invitation) if isinstance(invitation, bytes) else invitation
        inv.verify(self.owner_public_key, peer_id, self.clock(), self.run_id)
        known = self._invites.get(inv.peer_id)
        if known is None or known.expiry < inv.expiry:
            self._invites[inv.peer_id] = inv
        return inv

    def check(self, peer_id: PeerID | str, mode: str | None = None) -> None:
        """Raise AccessDenied unless ``peer_id`` holds a known valid invitation (for ``mode``)."""
        if str(peer_id) == str(self.owner):
            return
        inv = self._invites.get(str(peer_id))
        if inv is None:
            raise AccessDenied(f"{peer_id} has shown no invitation to run {self.run_id!r}")
        now = self.clock()
        if now >= inv.expiry:
            raise AccessDenied(f"the invitation of {peer_id} expired at {inv.expiry:.0f}")
        if not inv.allows(mode):
            raise AccessDenied(f"{peer_id} is invited as {inv.role}, not {mode}")

    def is_invited(self, peer_id: PeerID | str, mode: str | None = None) -> bool:
        try:
            self.check(peer_id, mode)
        except AccessDenied:
            return False
        return True

    def is_run_key(self, key: str) -> bool:
        return key == self.run_id or key.startswith(self.run_id + ".")


@dataclass(frozen=True)
class InvitedWritersValidator:
    """DHT validator: under a private run's keys, only invited peers (or the owner) may write.

    Runs after the signature check of the chain, so the owner marker names the real writer and
    the invitation marker in its subkey is the writer's own statement. Valid invitations seen
    here are remembered by the policy (that is how RPC guards usually know peers already).
    """

    policy: AccessPolicy

    def validate(self, record: Record) -> None:
        p = self.policy
        if not p.is_run_key(record.key):
            return
        writer = record_owner(record)
        if writer is None:
            raise InvalidRecordError(f"private run {p.run_id!r}: records must be owned (signed)")
        if writer == p.owner:
            return
        try:
            inv = Invitation.from_marker(record.subkey, p.run_id, str(writer))
            if inv is None:
                inv = Invitation.from_marker(record.key, p.run_id, str(writer))
            if inv is None:
                raise AccessDenied("no invitation in the record")
            p.learn(inv, writer)
        except AccessDenied as e:
            raise InvalidRecordError(f"private run {p.run_id!r}: {writer}: {e.reason}") from None


class InvitingDHT:
    """The DHT as a private run's components see it (a :class:`~dedloc_jax.run_dht.RunDHT`):
    our own owner-marked subkeys under the run's keys get our invitation marker. Reads, the
    clock and the rest are the DHT's own."""

    def __init__(self, dht: DHT, policy: AccessPolicy, invitation: Invitation | None) -> None:
        self._dht = dht
        self._policy = policy
        self._marker = invitation.marker() if invitation is not None else ""
        self.node = dht.node
        self.peer_id = dht.peer_id
        self.config = dht.config
        self.now = dht.now
        self.get = dht.get
        self.follow = dht.follow
        self.locate = dht.locate

    async def store(
        self,
        key: str,
        value: Any,
        expiration: float,
        *,
        subkey: str | None = None,
        replicas: int | None = None,
    ) -> Any:
        if self._marker and subkey is not None and self._policy.is_run_key(key):
            mine = owner_marker(self.peer_id)
            if mine in subkey and "[invite:" not in subkey:
                subkey += self._marker
        return await self._dht.store(key, value, expiration, subkey=subkey, replicas=replicas)


class AccessGuard:
    """Admits RPC callers of a private run; serves this peer's own invitation on ``collab.auth``."""

    def __init__(
        self,
        node: Node,
        policy: AccessPolicy,
        invitation: Invitation | None,
        *,
        timeout: float = 10.0,
    ) -> None:
        self.node = node
        self.policy = policy
        self.invitation = invitation
        self.timeout = timeout
        self._refused: dict[str, tuple[float, str]] = {}  # peer -> (until, reason)

    def register(self) -> None:
        self.node.add_handler(AUTH, self._handle_auth)

    def _own(self) -> bytes | None:
        return self.invitation.to_bytes() if self.invitation is not None else None

    async def _handle_auth(self, ctx: Any, request: Any) -> Any:
        data = request.get("invitation") if isinstance(request, dict) else None
        if isinstance(data, bytes):
            try:
                self.policy.learn(data, ctx.remote_peer)
            except AccessDenied as e:
                log.info("%s presented a bad invitation: %s", ctx.remote_peer, e.reason)
        return {"invitation": self._own()}

    async def admit(self, peer: PeerID, mode: str | None = None) -> None:
        """Return if ``peer`` is invited (asking it over ``collab.auth`` if not yet known)."""
        if self.policy.is_invited(peer):
            self.policy.check(peer, mode)  # the role may still not fit
            return
        key = str(peer)
        now = self.policy.clock()
        refused = self._refused.get(key)
        if refused is not None and refused[0] > now:
            raise AccessDenied(refused[1])
        try:
            answer = await self.node.call(
                peer, AUTH, {"invitation": self._own()}, timeout=self.timeout
            )
            data = answer.get("invitation") if isinstance(answer, dict) else None
            if not isinstance(data, bytes):
                raise AccessDenied(f"{peer} has no invitation to run {self.policy.run_id!r}")
            self.policy.learn(data, peer)
        except (AccessDenied, P2PError, IdentityError) as e:
            if isinstance(e, AccessDenied):
                reason = e.reason
            else:
                reason = f"{peer} has shown no invitation ({AUTH} failed: {e})"
            if len(self._refused) > 4096:
                self._refused.clear()
            self._refused[key] = (now + REFUSAL_CACHE_SECONDS, reason)
            log.info("refusing %s: %s", peer, reason)
            raise AccessDenied(reason) from None
        self.policy.check(peer, mode)


@dataclass
class PrivateRun:
    """Everything a private collaboration adds: policy, DHT validator, RPC guard."""

    policy: AccessPolicy
    guard: AccessGuard
    invitation: Invitation | None

    @classmethod
    def for_config(
        cls,
        node: Node,
        run_id: str,
        owner_public_key: bytes | None,
        invitation: bytes | None,
        clock: Callable[[], float],
    ) -> PrivateRun | None:
        """None for an open run; otherwise checks our own invitation's form (not its expiry:
        the DHT clock has heard no peer yet). ``clock``: DHT time, as for the policy."""
        if owner_public_key is None:
            return None
        policy = AccessPolicy(run_id, owner_public_key, clock)
        inv = Invitation.from_bytes(invitation) if invitation is not None else None
        if inv is not None:
            inv.verify(owner_public_key, node.peer_id, -math.inf, run_id)
        elif node.peer_id != policy.owner:
            log.warning(
                "joining private run %r without an invitation: peers will refuse us", run_id
            )
        return cls(policy, AccessGuard(node, policy, inv), inv)

    @property
    def validators(self) -> list[InvitedWritersValidator]:
        return [InvitedWritersValidator(self.policy)]

    def attach(self, dht: DHT) -> InvitingDHT:
        """Serve ``collab.auth``; the DHT our components should use."""
        self.guard.register()
        return InvitingDHT(dht, self.policy, self.invitation)
