"""The secure channel's handshake as pure functions over bytes (no I/O, easy to fuzz).

Three messages (I = initiator/dialer, R = responder/listener; ``e`` ephemeral X25519 keys,
``s`` static Ed25519 public keys):

1. I -> R  ``hello``:  LABEL | offers_I | e_I | s_I
2. R -> I  ``reply``:  offers_R | cipher | e_R | seal_R(s_R | sig_R)
3. I -> R  ``finish``: seal_I(sig_I)

``shared = X25519(e, e')``. The transcript hash ``T`` covers the label, both cipher offers, the
chosen cipher, both ephemerals and both static keys; each side signs ``T`` with its static key
under a role-specific prefix, so a signature cannot be replayed in the other role or another
session. The signatures travel sealed (ChaCha20-Poly1305) under handshake keys derived from
``shared``: opening a seal proves the sender knows the ephemeral secret, which binds the signing
identity to this key exchange. Data keys come from HKDF-SHA256(shared, salt=T), one per direction.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from p2p.aead import (
    AES_256_GCM,
    AES_256_OCB,
    CHACHA20_POLY1305,
    KEY_BYTES,
    TAG_BYTES,
    choose_cipher,
)
from p2p.errors import HandshakeError, PeerIDMismatch
from p2p.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, PeerID, verify_signature

LABEL = b"/dedloc-jax/secure/1.0.0"
MAX_HANDSHAKE_MESSAGE = 512  # every message is far smaller; larger length prefixes are rejected

_DH_BYTES = 32
_CIPHER_CODES = {CHACHA20_POLY1305: 1, AES_256_GCM: 2, AES_256_OCB: 3}
_ZERO_NONCE = bytes(12)

HELLO_SIZE = len(LABEL) + 1 + _DH_BYTES + PUBLIC_KEY_BYTES
REPLY_SIZE = 1 + 1 + _DH_BYTES + PUBLIC_KEY_BYTES + SIGNATURE_BYTES + TAG_BYTES
FINISH_SIZE = SIGNATURE_BYTES + TAG_BYTES


@dataclass(frozen=True, slots=True)
class SessionKeys:
    """What a completed handshake yields: keys for each direction and the proven remote peer."""

    cipher: str
    send_key: bytes
    recv_key: bytes
    remote_public_key: bytes
    remote_peer: PeerID


def _hkdf(shared: bytes, salt: bytes, info: bytes) -> tuple[bytes, bytes]:
    okm = HKDF(algorithm=hashes.SHA256(), length=2 * KEY_BYTES, salt=salt, info=info).derive(shared)
    return okm[:KEY_BYTES], okm[KEY_BYTES:]


def _raw_public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _exchange(private: X25519PrivateKey, remote_ephemeral: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(remote_ephemeral))
    except ValueError:
        # Low-order points give an all-zero secret; cryptography refuses them.
        raise HandshakeError("invalid ephemeral key from the remote peer") from None


def _signed_data(role: bytes, transcript: bytes) -> bytes:
    return LABEL + b"\x00" + role + b"\x00" + transcript


class _Transcript:
    """Both sides feed the same fields in the same order and get the same hashes."""

    def __init__(self, hello: bytes, offers_r: int, cipher_code: int, e_r: bytes) -> None:
        self._prefix = hello + bytes([offers_r, cipher_code]) + e_r

    def handshake_hash(self) -> bytes:
        return hashlib.sha256(b"hs" + self._prefix).digest()

    def full_hash(self, s_r: bytes) -> bytes:
        return hashlib.sha256(b"full" + self._prefix + s_r).digest()


class InitiatorHandshake:
    """The dialing side. ``hello()`` then ``process_reply(reply)`` -> (finish, keys)."""

    def __init__(self, identity: Identity, offers: int, expected: PeerID | None = None) -> None:
        self._identity = identity
        self._offers = offers & 0xFF
        self._expected = expected
        self._ephemeral = X25519PrivateKey.generate()
        self._hello: bytes | None = None
        self._done = False

    def hello(self) -> bytes:
        if self._hello is None:
            self._hello = (
                LABEL
                + bytes([self._offers])
                + _raw_public(self._ephemeral)
                + self._identity.public_key
            )
        return self._hello

    def process_reply(self, reply: bytes | bytearray | memoryview) -> tuple[bytes, SessionKeys]:
        if self._hello is None or self._done:
            raise HandshakeError("handshake reply out of order")
        self._done = True
        reply = bytes(reply)
        if len(reply) != REPLY_SIZE:
            raise HandshakeError(f"handshake reply has {len(reply)} bytes, expected {REPLY_SIZE}")
        offers_r, cipher_code = reply[0], reply[1]
        e_r = reply[2 : 2 + _DH_BYTES]
        sealed = reply[2 + _DH_BYTES :]
        cipher = choose_cipher(self._offers, offers_r)
        if _CIPHER_CODES[cipher] != cipher_code:
            raise HandshakeError(
                f"responder chose cipher code {cipher_code}, but the offers give {cipher}"
            )
        shared = _exchange(self._ephemeral, e_r)
        transcript = _Transcript(self._hello, offers_r, cipher_code, e_r)
        hs_salt = transcript.handshake_hash()
        k_r2i, k_i2r = _hkdf(shared, hs_salt, LABEL + b" handshake")
        try:
            opened = ChaCha20Poly1305(k_r2i).decrypt(_ZERO_NONCE, sealed, hs_salt)
        except InvalidTag:
            raise HandshakeError("handshake reply failed authentication") from None
        s_r, sig_r = opened[:PUBLIC_KEY_BYTES], opened[PUBLIC_KEY_BYTES:]
        full = transcript.full_hash(s_r)
        if not verify_signature(s_r, sig_r, _signed_data(b"responder", full)):
            raise HandshakeError("responder's signature over the handshake is invalid")
        remote = PeerID.from_public_key(s_r)
        if self._expected is not None and remote != self._expected:
            raise PeerIDMismatch(
                f"dialed peer {self._expected} but the key that answered belongs to {remote}"
            )
        sig_i = self._identity.sign(_signed_data(b"initiator", full))
        finish = ChaCha20Poly1305(k_i2r).encrypt(_ZERO_NONCE, sig_i, full)
        send_key, recv_key = _hkdf(shared, full, LABEL + b" data")
        return finish, SessionKeys(cipher, send_key, recv_key, s_r, remote)


class ResponderHandshake:
    """The listening side. ``process_hello(hello)`` -> reply, ``process_finish(finish)`` -> keys."""

    def __init__(self, identity: Identity, offers: int) -> None:
        self._identity = identity
        self._offers = offers & 0xFF
        self._state: tuple[bytes, bytes, bytes, bytes, str] | None = None
        self._stage = 0

    def process_hello(self, hello: bytes | bytearray | memoryview) -> bytes:
        if self._stage != 0:
            raise HandshakeError("handshake hello out of order")
        self._stage = 1
        hello = bytes(hello)
        if len(hello) != HELLO_SIZE or not hello.startswith(LABEL):
            label = hello[: len(LABEL)]
            raise HandshakeError(f"not a {LABEL.decode()} hello (starts {label!r:.60})")
        offers_i = hello[len(LABEL)]
        e_i = hello[len(LABEL) + 1 : len(LABEL) + 1 + _DH_BYTES]
        s_i = hello[len(LABEL) + 1 + _DH_BYTES :]
        cipher = choose_cipher(offers_i, self._offers)
        cipher_code = _CIPHER_CODES[cipher]
        ephemeral = X25519PrivateKey.generate()
        e_r = _raw_public(ephemeral)
        shared = _exchange(ephemeral, e_i)
        transcript = _Transcript(hello, self._offers, cipher_code, e_r)
        hs_salt = transcript.handshake_hash()
        k_r2i, k_i2r = _hkdf(shared, hs_salt, LABEL + b" handshake")
        s_r = self._identity.public_key
        full = transcript.full_hash(s_r)
        sig_r = self._identity.sign(_signed_data(b"responder", full))
        sealed = ChaCha20Poly1305(k_r2i).encrypt(_ZERO_NONCE, s_r + sig_r, hs_salt)
        self._state = (shared, full, k_i2r, s_i, cipher)
        return bytes([self._offers, cipher_code]) + e_r + sealed

    def process_finish(self, finish: bytes | bytearray | memoryview) -> SessionKeys:
        if self._stage != 1 or self._state is None:
            raise HandshakeError("handshake finish out of order")
        self._stage = 2
        shared, full, k_i2r, s_i, cipher = self._state
        self._state = None
        finish = bytes(finish)
        if len(finish) != FINISH_SIZE:
            raise HandshakeError(f"handshake finish has {len(finish)} bytes, not {FINISH_SIZE}")
        try:
            sig_i = ChaCha20Poly1305(k_i2r).decrypt(_ZERO_NONCE, finish, full)
        except InvalidTag:
            raise HandshakeError("handshake finish failed authentication") from None
        if not verify_signature(s_i, sig_i, _signed_data(b"initiator", full)):
            raise HandshakeError("initiator's signature over the handshake is invalid")
        recv_key, send_key = _hkdf(shared, full, LABEL + b" data")
        return SessionKeys(cipher, send_key, recv_key, s_i, PeerID.from_public_key(s_i))
