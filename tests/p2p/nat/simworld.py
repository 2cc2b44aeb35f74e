"""A shared helper of the NAT simulator tests: nodes on hosts of one simulated network."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

from p2p.node import NodeConfig, open_node
from p2p.testing import SimNetwork, sim_identity


class SimWorld:
    """Starts nodes (reachable or behind NAT) that answer ``echo`` with :attr:`echo`."""

    echo: Callable[[Any, Any], Awaitable[Any]]

    def __init__(self, stack: AsyncExitStack, net: SimNetwork) -> None:
        self.stack = stack
        self.net = net
        self.count = 0

    async def node(self, *, reachable: bool):
        host = self.net.add_host(f"h{self.count}", reachable=reachable)
        ident = sim_identity(self.net, self.count)
        self.count += 1
        node = await self.stack.enter_async_context(
            open_node(
                ident,
                transport=host.transport,
                listen=[host.listen_addr],
                config=NodeConfig.testing(),
            )
        )
        node.add_handler("echo", type(self).echo)
        return node
