"""Known addresses of peers, bounded so that gossip cannot grow it without limit."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from p2p.identity import PeerID
from p2p.multiaddr import Multiaddr


class PeerStore:
    """PeerID -> addresses, latest batch first (in its order); least recently touched peers
    are evicted."""

    def __init__(self, *, max_peers: int = 10_000, max_addrs_per_peer: int = 8) -> None:
        self.max_peers = max_peers
        self.max_addrs_per_peer = max_addrs_per_peer
        self._addrs: OrderedDict[PeerID, list[Multiaddr]] = OrderedDict()

    def add_addrs(self, peer_id: PeerID, addrs: Iterable[Multiaddr | str]) -> None:
        """Remember ``addrs`` (stored without their ``/p2p/`` suffix) for ``peer_id``.

        The new batch goes first *in the order given* (the peer advertises its best address
        first: public, then relayed, then private), then the addresses known before it.
        """
        batch: list[Multiaddr] = []
        for a in addrs:
            addr = Multiaddr.parse(a)
            if addr.peer_id is not None and addr.peer_id != peer_id:
                continue  # an address of somebody else
            if not addr.is_relayed:
                addr = addr.transport_part()
            if addr not in batch:
                batch.append(addr)
        known = batch + [a for a in self._addrs.pop(peer_id, []) if a not in batch]
        del known[self.max_addrs_per_peer :]
        if known:
            self._addrs[peer_id] = known
        while len(self._addrs) > self.max_peers:
            self._addrs.popitem(last=False)

    def addrs_of(self, peer_id: PeerID) -> list[Multiaddr]:
        """Known addresses of ``peer_id``, each ending in ``/p2p/<peer_id>``."""
        addrs = self._addrs.get(peer_id)
        if not addrs:
            return []
        self._addrs.move_to_end(peer_id)
        return [a if a.is_relayed else a.with_peer(peer_id) for a in addrs]

    def peers(self) -> list[PeerID]:
        return list(self._addrs)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._addrs

    def __len__(self) -> int:
        return len(self._addrs)
