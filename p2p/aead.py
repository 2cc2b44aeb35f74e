"""AEAD cipher choice for the secure channel: AES-256-OCB3, AES-256-GCM or ChaCha20-Poly1305.

ChaCha20-Poly1305 is fast everywhere and always offered; with AES instructions the AES modes
are several times faster, so they are chosen when both peers announce them: OCB3 (RFC 7253)
first, since it costs one AES pass per block and no separate GHASH (about 1.5-1.8x the speed of
AES-GCM on this project's x86 machines, ``bench.transport``), then GCM (peers that do not offer
OCB3). Each side announces a bit mask of the ciphers it is willing to use; both compute the same
choice from the two masks, and the handshake signatures cover the masks, so a man in the middle
cannot downgrade. Nonces are 96-bit frame counters in every mode (never repeated for a key).
"""

from __future__ import annotations

import functools
import struct
import sys

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, AESOCB3, ChaCha20Poly1305

from p2p.errors import HandshakeError

CHACHA20_POLY1305 = "chacha20-poly1305"
AES_256_GCM = "aes-256-gcm"
AES_256_OCB = "aes-256-ocb"
CIPHERS = (CHACHA20_POLY1305, AES_256_GCM, AES_256_OCB)

OFFER_CHACHA = 0x01
OFFER_AES = 0x02  # AES-256-GCM
OFFER_AES_OCB = 0x04

KEY_BYTES = 32
TAG_BYTES = 16
NONCE_BYTES = 12
MAX_COUNTER = 2**64 - 1

# 4 zero bytes then a 64-bit big-endian frame counter: never repeats for one key.
_NONCE = struct.Struct(">4xQ")
nonce_for = _NONCE.pack

Aead = ChaCha20Poly1305 | AESGCM | AESOCB3


def cpuinfo_has_aes(cpuinfo: str) -> bool:
    """True when /proc/cpuinfo text lists the 'aes' flag (x86 "flags", arm "Features")."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features") and "aes" in value.split():
            return True
    return False


@functools.cache
def has_aes_hardware() -> bool:
    """True when the CPU advertises AES instructions."""
    if sys.platform == "darwin":
        # Every Apple silicon and every x86 Mac since 2010 has AES instructions.
        return True
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return cpuinfo_has_aes(f.read())
    except OSError:
        return False


@functools.cache
def has_ocb() -> bool:
    """True when this build of cryptography (its OpenSSL) has AES-OCB3."""
    try:
        AESOCB3(bytes(KEY_BYTES)).encrypt(bytes(NONCE_BYTES), b"", None)
    except UnsupportedAlgorithm:
        return False
    return True


def local_offers(cipher: str | None = None) -> int:
    """The cipher mask this side announces.

    ``None`` offers ChaCha20 and, when the CPU has AES instructions, AES-OCB3 (if the library
    has it) and AES-GCM. Naming a cipher overrides detection: an AES mode is offered as if the
    hardware had it (``"aes-256-gcm"`` without OCB3, so that GCM is what gets chosen), with
    ChaCha20 as a fallback; ``"chacha20-poly1305"`` offers ChaCha20 only.
    """
    if cipher is None:
        if not has_aes_hardware():
            return OFFER_CHACHA
        return OFFER_CHACHA | OFFER_AES | (OFFER_AES_OCB if has_ocb() else 0)
    if cipher == AES_256_OCB:
        return OFFER_CHACHA | OFFER_AES | OFFER_AES_OCB
    if cipher == AES_256_GCM:
        return OFFER_CHACHA | OFFER_AES
    if cipher == CHACHA20_POLY1305:
        return OFFER_CHACHA
    raise ValueError(f"unknown cipher {cipher!r}; expected one of {CIPHERS}")


def choose_cipher(initiator_offers: int, responder_offers: int) -> str:
    """The first both offer of AES-OCB3, AES-GCM, ChaCha20; unknown bits are ignored."""
    common = initiator_offers & responder_offers
    if common & OFFER_AES_OCB:
        return AES_256_OCB
    if common & OFFER_AES:
        return AES_256_GCM
    if common & OFFER_CHACHA:
        return CHACHA20_POLY1305
    raise HandshakeError(
        f"no common cipher (offers {initiator_offers:#04x} and {responder_offers:#04x})"
    )


def make_aead(cipher: str, key: bytes) -> Aead:
    if cipher == AES_256_OCB:
        return AESOCB3(key)
    if cipher == AES_256_GCM:
        return AESGCM(key)
    if cipher == CHACHA20_POLY1305:
        return ChaCha20Poly1305(key)
    raise ValueError(f"unknown cipher {cipher!r}")
