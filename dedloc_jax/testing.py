"""Helpers to start many collaboration peers (and a hostile DHT node) on the simulated network
(:mod:`p2p.testing`), for the tests and the benchmarks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import trio

from dedloc_jax.config import CollaborationConfig
from p2p.dht import DHT, DHTClock, DHTConfig, open_dht
from p2p.node import Node, NodeConfig
from p2p.testing import SimNetwork, open_sim_nodes


@asynccontextmanager
async def open_sim_dhts(
    net: SimNetwork, n: int, **host_kwargs: Any
) -> AsyncIterator[list[tuple[Node, DHT]]]:
    """``n`` nodes with a DHT each; node 0 is the bootstrap node."""
    async with (
        open_sim_nodes(net, n, config=NodeConfig.testing(), **host_kwargs) as nodes,
        AsyncExitStack() as stack,
    ):
        out = []
        first = [str(nodes[0].addrs[0])]
        for i, node in enumerate(nodes):
            dht = await stack.enter_async_context(
                open_dht(
                    node,
                    initial_peers=[] if i == 0 else first,
                    config=DHTConfig.fast(),
                    clock=DHTClock(trio.current_time),
                )
            )
            out.append((node, dht))
        yield out


def matchmakers(
    peers: Sequence[tuple[Node, DHT]],
    *,
    max_group_size: int,
    window: float = 1.0,
    contexts: Sequence[Any] | None = None,
    eager: bool = False,
) -> list[Any]:
    """A registered :class:`Matchmaker` with a fixed window for each of ``peers``, each with
    its ``contexts`` entry (a :class:`PeerSide`; default: a peer that knows nothing);
    ``eager``: as :class:`Matchmaker`'s."""
    from dedloc_jax.rounds.context import PeerSide
    from dedloc_jax.rounds.deadlines import Deadlines
    from dedloc_jax.rounds.matchmaking import Matchmaker

    makers = []
    for i, (node, dht) in enumerate(peers):
        context = contexts[i] if contexts is not None else PeerSide()
        mm = Matchmaker(
            node,
            dht,
            "run",
            max_group_size=max_group_size,
            context=context,
            deadlines=Deadlines(window=window),
            eager=eager,
        )
        mm.register()
        makers.append(mm)
    return makers


@asynccontextmanager
async def open_sim_collaboration(
    net: SimNetwork,
    n: int,
    *,
    config: CollaborationConfig,
    configs: Sequence[CollaborationConfig] | None = None,
    nat: bool = False,
    nat_config: Any = None,
    modes: Sequence[str | None] | None = None,
    run_id: str = "run",
    dht_config: DHTConfig | None = None,
    **host_kwargs: Any,
) -> AsyncIterator[list[Any]]:
    """``n`` peers of one collaboration (CollaborationPeer); peer 0 is the first peer.

    NAT detection is off unless ``nat`` asks for it (with ``nat_config``): every simulated
    host is reachable and most tests are about the collaboration, not about reachability.
    A mode of None in ``modes`` lets that peer's mode follow its reachability. ``configs``:
    one config per peer (a hostile one's, say), instead of ``config`` for all.
    """
    from dedloc_jax.opening import open_collaboration

    async with (
        open_sim_nodes(net, n, config=NodeConfig.testing(), **host_kwargs) as nodes,
        AsyncExitStack() as stack,
    ):
        cores = []
        first = [str(nodes[0].addrs[0])]
        for i, node in enumerate(nodes):
            core = await stack.enter_async_context(
                open_collaboration(
                    node,
                    run_id,
                    initial_peers=[] if i == 0 else first,
                    config=_detecting(configs[i] if configs else config, nat).replace(
                        mode=modes[i] if modes else "node"
                    ),
                    dht_config=dht_config or DHTConfig.fast(),
                    dht_clock=DHTClock(trio.current_time),  # virtual time, like everything
                    nat_config=nat_config,
                )
            )
            cores.append(core)
        yield cores


@asynccontextmanager
async def open_sim_attacker(net: SimNetwork, bootstrap: Any) -> AsyncIterator[DHT]:
    """A hostile peer's DHT on a new host, joined through ``bootstrap`` (a node), without the
    run's schemas: what it stores is refused, if at all, by the honest nodes."""
    async with (
        open_sim_nodes(net, 1, config=NodeConfig.testing(), names=["attacker"]) as (node,),
        open_dht(
            node,
            initial_peers=[str(bootstrap.addrs[0])],
            config=DHTConfig.fast(),
            clock=DHTClock(trio.current_time),
        ) as dht,
    ):
        yield dht


def _detecting(config: CollaborationConfig, nat: bool) -> CollaborationConfig:
    """``config`` with reachability detection on (``nat``) or off."""
    return config.replace(reachability=config.reachability.replace(detect=nat))
