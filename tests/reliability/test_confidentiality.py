"""Known tensors never cross the wire in plain form.

Two collaboration peers on loopback talk only through a capturing TCP proxy; one stores a
known 4 KB float32 pattern in the DHT, serves another as its state (downloaded by the other),
and both average a third. Every transfer must succeed, enough bytes must have crossed the proxy
to carry them, and neither any pattern nor any 64-byte window of one appears in the capture.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import numpy as np
import trio

from dedloc_jax.config import CollaborationConfig
from dedloc_jax.opening import open_collaboration
from dedloc_jax.state.download import download_state
from p2p.dht import DHTConfig
from p2p.identity import Identity
from p2p.node import NodeConfig, open_node
from tests.reliability.proxy import capturing_proxy

N = 1024  # 4 KB of float32


def _pattern(tag: float) -> np.ndarray:
    """A distinctive, non-repeating float32 pattern."""
    i = np.arange(N, dtype=np.float64)
    return (np.sin(i * 0.37 + tag) * 1000.0 + i * 0.001 + tag).astype(np.float32)


def _leaks(wire: bytes, secret: np.ndarray) -> list[int]:
    """Offsets of the windows of ``secret`` (whole, and every 64-byte window) found on the wire."""
    raw = secret.tobytes()
    found = [0] if raw in wire else []
    found += [o for o in range(0, len(raw) - 64 + 1, 64) if raw[o : o + 64] in wire]
    return found


def test_tensors_are_encrypted_on_the_wire() -> None:
    config = CollaborationConfig.local_demo(64)
    config = config.replace(progress=config.progress.replace(max_refresh=0.5))
    dht_value, state, grad_a, grad_b = (_pattern(t) for t in (1.0, 2.0, 3.0, 4.0))

    async def main() -> tuple[bytes, dict]:
        out: dict = {}
        async with AsyncExitStack() as stack:
            node_a = await stack.enter_async_context(
                open_node(Identity.from_seed(b"conf-a"), config=NodeConfig.testing())
            )
            core_a = await stack.enter_async_context(
                open_collaboration(node_a, "secret-run", config=config, dht_config=DHTConfig.fast())
            )
            capture = await stack.enter_async_context(capturing_proxy(node_a.addrs[0].port))
            via_proxy = f"/ip4/127.0.0.1/tcp/{capture.port}/p2p/{node_a.peer_id}"
            node_b = await stack.enter_async_context(
                open_node(Identity.from_seed(b"conf-b"), config=NodeConfig.testing())
            )
            core_b = await stack.enter_async_context(
                open_collaboration(
                    node_b,
                    "secret-run",
                    initial_peers=[via_proxy],
                    config=config,
                    dht_config=DHTConfig.fast(),
                )
            )
            with trio.fail_after(60):
                # 1. a DHT value stored by B, read back by A
                await core_b.dht.store("secret-key", dht_value.tobytes(), core_b.dht.now() + 60)
                got = await core_a.dht.get("secret-key")
                out["dht"] = None if got is None else got.value
                # 2. A's state downloaded by B
                core_a.state_server.set_state([state], 7)
                await core_a.state_server.announce()
                epoch, arrays, _ = await download_state(node_b, core_b.dht, "secret-run")
                out["state"] = (epoch, arrays)

                # 3. an all-reduce of two known vectors
                async def train(core, grad: np.ndarray, key: str) -> None:
                    while not core.report(0, 32, 32):
                        await trio.sleep(0.05)
                    outcome = await core.average(0, [grad], 32)
                    out[key] = outcome

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(train, core_a, grad_a, "avg_a")
                    nursery.start_soon(train, core_b, grad_b, "avg_b")
            # The nodes keep connections open; only what crossed the proxy is inspected.
            return capture.all_bytes(), out

    wire, out = trio.run(main)
    # Every transfer happened, and through the proxy (enough bytes to carry the four tensors).
    assert out["dht"] == dht_value.tobytes()
    epoch, arrays = out["state"]
    assert epoch == 7 and arrays[0].tobytes() == state.tobytes()
    assert out["avg_a"].group_size == out["avg_b"].group_size == 2
    mean = out["avg_a"].gradients[0]
    assert mean.tobytes() == out["avg_b"].gradients[0].tobytes()
    np.testing.assert_allclose(mean, (grad_a + grad_b) / 2, rtol=1e-6)
    assert len(wire) > 4 * N * 4
    # ... but none of them in plain form.
    for name, secret in (("dht", dht_value), ("state", state), ("a", grad_a), ("b", grad_b)):
        assert _leaks(wire, secret) == [], f"{name} pattern visible on the wire"
    assert _leaks(wire, mean) == []
    # The check itself works: a capture holding the plain bytes would be caught.
    assert _leaks(wire + state.tobytes()[100:300], state) != []
