"""AEAD cipher choice for the secure channel: ChaCha20-Poly1305 or AES-256-GCM.

ChaCha20-Poly1305 is the default because it is fast everywhere; AES-256-GCM is several times
faster on CPUs with AES instructions, so it is chosen when both peers announce them. Each side
announces a bit mask of the ciphers it is willing to use; both compute the same choice from the
two masks, and the handshake signatures cover the masks, so a man in the middle cannot downgrade.
"""

from __future__ import annotations

import functools
import struct
import sys

from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from p2p.errors import HandshakeError

CHACHA20_POLY1305 = "chacha20-poly1305"
AES_256_GCM = "aes-256-gcm"
CIPHERS = (CHACHA20_POLY1305, AES_256_GCM)

OFFER_CHACHA = 0x01
OFFER_AES = 0x02

KEY_BYTES = 32
TAG_BYTES = 16
NONCE_BYTES = 12
MAX_COUNTER = 2**64 - 1

# 4 zero bytes then a 64-bit big-endian frame counter: never repeats for one key.
_NONCE = struct.Struct(">4xQ")
nonce_for = _NONCE.pack

Aead = ChaCha20Poly1305 | AESGCM


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


def local_offers(cipher: str | None = None) -> int:
    """The cipher mask this side announces.

    ``None`` offers ChaCha20 and, when the CPU has AES instructions, AES-GCM. Naming a cipher
    overrides detection: ``"aes-256-gcm"`` offers AES-GCM as if the hardware had it (ChaCha20 stays
    offered as a fallback), ``"chacha20-poly1305"`` offers ChaCha20 only.
    """
    if cipher is None:
        return OFFER_CHACHA | (OFFER_AES if has_aes_hardware() else 0)
    if cipher == AES_256_GCM:
        return OFFER_CHACHA | OFFER_AES
    if cipher == CHACHA20_POLY1305:
        return OFFER_CHACHA
    raise ValueError(f"unknown cipher {cipher!r}; expected one of {CIPHERS}")


def choose_cipher(initiator_offers: int, responder_offers: int) -> str:
    """AES-GCM when both offer it, else ChaCha20 when both offer it; unknown bits are ignored."""
    common = initiator_offers & responder_offers
    if common & OFFER_AES:
        return AES_256_GCM
    if common & OFFER_CHACHA:
        return CHACHA20_POLY1305
    raise HandshakeError(
        f"no common cipher (offers {initiator_offers:#04x} and {responder_offers:#04x})"
    )


def make_aead(cipher: str, key: bytes) -> Aead:
    if cipher == AES_256_GCM:
        return AESGCM(key)
    if cipher == CHACHA20_POLY1305:
        return ChaCha20Poly1305(key)
    raise ValueError(f"unknown cipher {cipher!r}")
