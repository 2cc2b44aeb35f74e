"""Peer identities: Ed25519 key pairs and the peer IDs derived from them.

A peer ID is the SHA-256 digest of the raw 32-byte Ed25519 public key, shown as base58 text.
Holding the private key is the only way to prove a peer ID: the secure channel and signed DHT
records both check a signature made with it against a public key that hashes to the ID.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2p.base58 import b58decode, b58encode
from p2p.errors import IdentityError

PEER_ID_BYTES = 32
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
_MAX_PEER_ID_TEXT = 64


@functools.lru_cache(maxsize=4096)
def _peer_text(digest: bytes) -> str:
    """A peer ID's base58 text, kept: a round names the same few peers in every table key and
    log line, and each encoding is a big-integer loop (~27 us). Bounded: IDs made up by the
    thousand only evict each other."""
    return b58encode(digest)


@dataclass(frozen=True, order=True, slots=True)
class PeerID:
    """The 32-byte identifier of a peer (SHA-256 of its Ed25519 public key)."""

    digest: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != PEER_ID_BYTES:
            raise IdentityError(f"a peer ID is {PEER_ID_BYTES} bytes, got {self.digest!r:.80}")

    @classmethod
    def from_public_key(cls, public_key: bytes) -> PeerID:
        if len(public_key) != PUBLIC_KEY_BYTES:
            raise IdentityError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes")
        return cls(hashlib.sha256(public_key).digest())

    @classmethod
    def from_base58(cls, text: str) -> PeerID:
        # 32 bytes take at most 44 base58 characters; refusing long text early keeps a hostile
        # input from costing quadratic big-integer work in b58decode.
        if not isinstance(text, str) or len(text) > _MAX_PEER_ID_TEXT:
            raise IdentityError(f"malformed peer ID {text!r:.80}: not text of a sane length")
        try:
            raw = b58decode(text)
        except ValueError as e:
            raise IdentityError(f"malformed peer ID {text!r:.80}: {e}") from None
        if len(raw) != PEER_ID_BYTES:
            raise IdentityError(f"malformed peer ID {text!r:.80}: wrong length")
        return cls(raw)

    def to_base58(self) -> str:
        return _peer_text(self.digest)

    def to_bytes(self) -> bytes:
        return self.digest

    def matches(self, public_key: bytes) -> bool:
        """True when ``public_key`` is the key this ID was derived from."""
        return hashlib.sha256(public_key).digest() == self.digest

    def __str__(self) -> str:
        return self.to_base58()

    def __repr__(self) -> str:
        return f"PeerID({self.to_base58()})"


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """Check an Ed25519 signature; malformed keys or signatures simply fail."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


class Identity:
    """A peer's Ed25519 key pair."""

    __slots__ = ("_private", "public_key", "peer_id")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: PeerID = PeerID.from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """A deterministic identity from a 32-byte seed (tests and simulations)."""
        if len(seed) != 32:
            seed = hashlib.sha256(seed).digest()
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)

    def private_bytes(self) -> bytes:
        return self._private.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the private key as PEM to a file only its owner can read (0600)."""
        pem = self._private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, pem)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Read a key written by :meth:`save`; refuses files others can read."""
        path = Path(path)
        try:
            mode = path.stat().st_mode & 0o777
            data = path.read_bytes()
        except OSError as e:
            raise IdentityError(f"cannot read identity file {path}: {e}") from None
        if mode & 0o077:
            raise IdentityError(f"identity file {path} is readable by others (mode {mode:o})")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise IdentityError(f"identity file {path} holds no valid key: {e}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(f"identity file {path} is not an Ed25519 key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        if Path(path).exists():
            return cls.load(path)
        identity = cls.generate()
        identity.save(path)
        return identity

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"
