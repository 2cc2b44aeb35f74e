"""256-bit DHT identifiers and the XOR metric.

A node's DHT ID is its peer ID read as a big-endian integer (peer IDs are already SHA-256
digests, so they are uniform). A key's ID is the SHA-256 of its UTF-8 text under a domain tag,
so keys and nodes share one space and a key lives on the nodes nearest to its ID.
"""

from __future__ import annotations

import hashlib
import random

from p2p.identity import PeerID

ID_BITS = 256
ID_BYTES = ID_BITS // 8
MAX_ID = (1 << ID_BITS) - 1
_KEY_TAG = b"p2p-dht-key/v1:"


def node_id(peer: PeerID) -> int:
    """The DHT ID of a peer."""
    return int.from_bytes(peer.to_bytes(), "big")


def key_id(key: str) -> int:
    """The DHT ID of a key."""
    return int.from_bytes(hashlib.sha256(_KEY_TAG + key.encode("utf-8")).digest(), "big")


def distance(a: int, b: int) -> int:
    """Kademlia's XOR distance."""
    return a ^ b


def random_id(lo: int = 0, hi: int = MAX_ID + 1, rng: random.Random | None = None) -> int:
    """A uniform ID in ``[lo, hi)`` (used to refresh a bucket covering that range)."""
    return (rng or random).randrange(lo, hi)


def common_prefix_len(a: int, b: int) -> int:
    """How many leading bits two IDs share (256 when equal)."""
    return ID_BITS - (a ^ b).bit_length()
