"""DHT settings: one frozen dataclass with named presets."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from p2p.dht.storage import WriterQuotas


@dataclass(frozen=True)
class DHTConfig:
    """Tunables of a DHT node. Defaults follow Kademlia (k=20, alpha=3)."""

    k: int = 20  # bucket size and lookup beam width
    alpha: int = 3  # parallel requests per lookup
    replication: int = 20  # how many of the nearest nodes a store goes to (<= k)
    request_timeout: float = 5.0  # seconds per RPC
    bootstrap_timeout: float = 10.0  # seconds to wait for initial peers
    replacement_cache_size: int = 20  # per bucket
    # A bucket no lookup or answer went through for this long is refreshed (Kademlia: an
    # hour; a busy node's traffic keeps most buckets fresh, and a dead member a lookup meets
    # is dropped then).
    refresh_interval: float = 3600.0
    # A record no STORE brought for this long is re-sent to the key's nearest nodes (a
    # lookup and a store per key: at 5 minutes, 4x an idle node's other upkeep)
    republish_interval: float = 3600.0
    maintenance_interval: float = 60.0  # how often refresh/republish/purge checks run
    blacklist_base: float = 5.0  # first ban after a failed request, doubled per further failure
    blacklist_max: float = 600.0
    get_quorum: int = 3  # a get stops once this many nodes returned valid records (0: never)
    cache_on_path: bool = True  # cache found values at the closest node on the path lacking them
    cache_size: int = 10_000  # cached records kept (LRU)
    max_keys: int = 100_000  # stored keys (new keys refused beyond)
    max_storage_bytes: int = 256 << 20  # bytes of records stored (new ones refused beyond)
    cache_bytes: int = 64 << 20
    max_subkeys: int = 10_000  # subkeys per dictionary value
    # what one signing writer may hold per key and per node; unsigned subkeys' share of a key
    writer_quotas: WriterQuotas = field(default_factory=WriterQuotas)
    max_value_bytes: int = 256 * 1024  # serialized value size
    max_key_chars: int = 512
    max_ttl: float = 7 * 24 * 3600.0  # expirations further ahead than this are refused
    max_records_per_store: int = 64  # records in one STORE request
    max_queries_per_find: int = 64  # targets in one FIND request
    max_addrs_per_peer: int = 8
    max_clock_skew: float = 3600.0  # peer clock offsets beyond this are ignored
    clock_samples: int = 64  # recent peer offsets kept for the median
    stale_failures: int = 5  # consecutive failures after which a peer leaves its bucket
    handoff_concurrency: int = 4
    # A store reuses the nearest nodes its last lookup of the same key found for this many
    # seconds (0: every store looks them up), until a store to one of them fails. Frequent
    # writers of one key (progress reports, relay adverts) then skip the lookup; newcomers
    # nearer to the key get the records by handoff. Half an hour: a key's nearest nodes
    # change only by churn, which a failed store or a nearer node heard from shows at once
    # (at 10 minutes, a DiLoCo peer's progress renewal, due every 10, looked up every time).
    locate_ttl: float = 1800.0
    max_pending_evictions: int = 64

    def __post_init__(self) -> None:
        if self.k < 1 or self.alpha < 1:
            raise ValueError("k and alpha must be positive")
        if not 1 <= self.replication <= self.k:
            raise ValueError("replication must be between 1 and k")
        if not self.locate_ttl >= 0:
            raise ValueError("locate_ttl must be non-negative")

    @classmethod
    def default(cls) -> DHTConfig:
        return cls()

    @classmethod
    def fast(cls) -> DHTConfig:
        """Short timeouts and intervals: loopback, simulations and tests."""
        return cls(
            request_timeout=2.0,
            bootstrap_timeout=5.0,
            refresh_interval=600.0,
            republish_interval=3600.0,
            maintenance_interval=10.0,
            blacklist_base=1.0,
            blacklist_max=60.0,
        )

    @classmethod
    def small(cls) -> DHTConfig:
        """A small network (a handful to a few dozen nodes): smaller buckets, fewer replicas."""
        return cls(k=8, replication=5)

    def replace(self, **changes: object) -> DHTConfig:
        return replace(self, **changes)  # type: ignore[arg-type]


PRESETS = {"default": DHTConfig.default, "fast": DHTConfig.fast, "small": DHTConfig.small}
