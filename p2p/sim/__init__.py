"""In-memory simulated network for running the real p2p stack under trio's MockClock.

Everything above the transport (secure channel, mux, RPC, node, DHT, averaging) runs unchanged
on ``host.transport``; time is virtual, so a 200-node test takes seconds::

    from p2p.testing import SimNetwork, run_sim

    async def main():
        net = SimNetwork(seed=0)
        slow = net.add_host("home", upload_bps=1e6, download_bps=10e6, latency=0.02)
        async with open_node(ident, transport=slow.transport, listen=[slow.listen_addr]) as node:
            ...
        net.kill(slow)  # or net.partition([...], [...]); net.heal(); net.revive(slow)

    run_sim(main)  # trio.run with MockClock(autojump_threshold=0), scheduler seeded

Layout: :mod:`.engine` (event queue in virtual time), :mod:`.fluid` (max-min fair sharing of
links), :mod:`.pipe` (one direction of a connection: latency, buffer, EOF, reset),
:mod:`.stream` (the ``trio.abc.HalfCloseableStream`` endpoints), :mod:`.transport` (listen and
dial) and :mod:`.network` (hosts, faults, and how waiting tasks are woken).
"""

from p2p.sim.network import SimHost, SimNetwork, SimStats
from p2p.sim.stream import Connection, SimStream
from p2p.sim.transport import SimListener, SimTransport

__all__ = [
    "Connection",
    "SimHost",
    "SimListener",
    "SimNetwork",
    "SimStats",
    "SimStream",
    "SimTransport",
]
