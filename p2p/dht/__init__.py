"""A Kademlia DHT on the p2p node, usable standalone (``python -m p2p.dht``; no JAX needed).

Typical use::

    async with open_node(identity) as node:
        async with open_dht(node, initial_peers=[...]) as dht:
            await dht.store("key", {"any": "msgpack value"}, expiration=dht.now() + 60)
            print(await dht.get("key"))
"""

from p2p.dht.clock import DHTClock
from p2p.dht.config import DHTConfig
from p2p.dht.errors import BootstrapError, DHTError, InvalidRecordError
from p2p.dht.follow import KeyFollower, follower_replicas
from p2p.dht.node import DHT, DHTValue, StoreResult, open_dht
from p2p.dht.records import Record, ValueWithExpiration, owner_marker
from p2p.dht.validation import (
    AnyValue,
    Bool,
    Bytes,
    Float,
    Int,
    KeySchema,
    ListOf,
    OneOf,
    Optional,
    RecordValidator,
    SchemaValidator,
    SignatureValidator,
    Str,
    Struct,
    Tuple,
    sign_record,
)

__all__ = [
    "KeyFollower",
    "follower_replicas",
    "DHT",
    "AnyValue",
    "BootstrapError",
    "Bool",
    "Bytes",
    "DHTClock",
    "DHTConfig",
    "DHTError",
    "DHTValue",
    "Float",
    "Int",
    "InvalidRecordError",
    "KeySchema",
    "ListOf",
    "OneOf",
    "Optional",
    "Record",
    "RecordValidator",
    "SchemaValidator",
    "SignatureValidator",
    "StoreResult",
    "Str",
    "Struct",
    "Tuple",
    "ValueWithExpiration",
    "open_dht",
    "owner_marker",
    "sign_record",
]
