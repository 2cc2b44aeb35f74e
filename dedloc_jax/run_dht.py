"""What a collaboration's parts use of the DHT (:class:`RunDHT`): a :class:`p2p.dht.DHT`, or a
private run's :class:`~dedloc_jax.access.InvitingDHT` in front of one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from p2p.dht import DHTConfig, DHTValue, KeyFollower
    from p2p.identity import PeerID
    from p2p.node import Node


class RunDHT(Protocol):
    """The DHT's reads, writes and clock, as the tracker, matchmaking, state and bans use them."""

    @property
    def node(self) -> Node: ...

    @property
    def peer_id(self) -> PeerID: ...

    @property
    def config(self) -> DHTConfig: ...

    def now(self) -> float: ...

    async def get(
        self, key: str, *, latest: bool = True, quorum: int | None = None, repair: bool = True
    ) -> DHTValue | None: ...

    async def store(
        self,
        key: str,
        value: Any,
        expiration: float,
        *,
        subkey: str | None = None,
        replicas: int | None = None,
    ) -> Any: ...

    async def locate(self, key: str, *, replicas: int | None = None) -> None: ...

    def follow(
        self,
        key: str,
        *,
        holders: int | None = None,
        relocate_interval: float = 30.0,
        sweep_every: int = 8,
        lapse_grace: float = 30.0,
    ) -> KeyFollower: ...
