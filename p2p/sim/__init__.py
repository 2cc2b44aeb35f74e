"""In-memory simulated network for running the real p2p stack under trio's MockClock.

See :class:`SimNetwork`. Everything above the transport (secure channel, mux, RPC, node, DHT,
averaging) runs unchanged on ``host.transport``.
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
