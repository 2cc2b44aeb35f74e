"""Shared helpers: run one all-reduce round on simulated nodes and check the results."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import trio

from dedloc_jax.averaging import AllReduceConfig, AveragingService, GroupSpec, Member, all_reduce
from dedloc_jax.averaging.errors import AveragingError
from p2p.sim import SimNetwork
from p2p.testing import host_of, open_sim_nodes, run_sim


def make_tree(rng: np.random.Generator, shapes: Sequence[tuple[int, ...]]) -> dict:
    return {f"leaf{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}


def run_round(
    modes: Sequence[str],
    trees: Sequence[Any],
    weights: Sequence[float],
    *,
    codec: str = "none",
    timeout: float = 60.0,
    config: AllReduceConfig | None = None,
    bandwidth: Sequence[tuple[float, float]] | None = None,
    fault: Callable[[SimNetwork, list, list], Any] | None = None,
    seed: int = 0,
    parts: tuple[int, ...] | None = None,
    codecs: Sequence[Any] | None = None,
    member_weights: Sequence[float] | None = None,
    latency: float = 0.0,
) -> tuple[list, float, list[str]]:
    """Run one round; returns (per-member result, exception or None if killed; virtual duration;
    member peer IDs). ``member_weights``: the spec's bounds on the weights (default none);
    ``latency``: each host's one-way access latency (seconds)."""
    cfg = config or AllReduceConfig.testing()
    outcome: list = [None] * len(modes)
    duration = [0.0]
    names: list[str] = []

    async def main() -> None:
        net = SimNetwork(seed=seed)
        async with open_sim_nodes(net, len(modes), latency=latency) as nodes:
            services = [AveragingService(node, cfg) for node in nodes]
            for i, node in enumerate(nodes):
                if modes[i] == "client":  # behind NAT: it can only dial out
                    host_of(net, node).reachable = False
                if bandwidth is not None:
                    net.set_bandwidth(host_of(net, node), *bandwidth[i])
            members = tuple(
                Member(
                    str(node.peer_id),
                    mode,
                    *(bandwidth[i] if bandwidth is not None else (float("inf"),) * 2),
                    *((member_weights[i],) if member_weights is not None else ()),
                )
                for i, (node, mode) in enumerate(zip(nodes, modes, strict=True))
            )
            names.extend(m.peer_id for m in members)
            spec = GroupSpec(members, b"test-round", parts)
            for a in nodes:
                for b in nodes:
                    if a is not b:
                        a.peerstore.add_addrs(b.peer_id, b.addrs)
            # matchmaking leaves the members connected; clients are only ever dialed out of
            for i, a in enumerate(nodes):
                for j, b in enumerate(nodes):
                    dial = (i < j or modes[i] == "client") and modes[j] != "client"
                    if dial and a is not b:
                        await a.connect(b.peer_id)
            scopes = [trio.CancelScope() for _ in nodes]
            t0 = trio.current_time()

            async def one(i: int) -> None:
                with scopes[i]:
                    try:
                        outcome[i] = await all_reduce(
                            services[i],
                            spec,
                            trees[i],
                            weights[i],
                            codec=codecs[i] if codecs else codec,
                            timeout=timeout,
                            config=cfg,
                        )
                    except AveragingError as e:
                        outcome[i] = e
                    except BaseExceptionGroup as group:  # failures of several tasks at once
                        if not group.subgroup(AveragingError):
                            raise
                        outcome[i] = group

            async with trio.open_nursery() as nursery:
                for i in range(len(nodes)):
                    nursery.start_soon(one, i)
                if fault is not None:
                    nursery.start_soon(fault, net, nodes, scopes)
            duration[0] = trio.current_time() - t0

    run_sim(main, seed=seed)
    return outcome, duration[0], names


def expected_mean(trees: Sequence[Any], weights: Sequence[float], include: Sequence[int]) -> Any:
    import jax

    total = sum(weights[i] for i in include)
    return jax.tree_util.tree_map(
        lambda *xs: (
            sum(np.asarray(xs[i], np.float64) * weights[i] for i in range(len(xs)) if i in include)
            / total
        ),
        *trees,
    )


def check_survivors(
    outcome: Sequence[Any],
    trees: Sequence[Any],
    weights: Sequence[float],
    names: Sequence[str],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> list:
    """Every survivor's result is bit-identical, and each segment is the weighted mean of exactly
    the members its contributor set names. Returns the successful results."""
    from dedloc_jax.averaging import flatten

    results = [
        o
        for o in outcome
        if o is not None and not isinstance(o, Exception) and o.vector is not None
    ]
    assert results, outcome
    first = results[0]
    for r in results[1:]:
        assert r.vector.tobytes() == first.vector.tobytes()
        assert r.shares == first.shares
    vecs = [flatten(t)[0].astype(np.float64) for t in trees]
    index = {n: i for i, n in enumerate(names)}
    for share in first.shares:
        for a, b, who in share.segments:
            members = [index[n] for n in who]
            total = sum(weights[i] for i in members)
            want = sum(vecs[i][a:b] * weights[i] for i in members) / total
            np.testing.assert_allclose(first.vector[a:b], want, rtol=rtol, atol=atol)
    return results


def equivocate(monkeypatch: Any) -> Any:
    """Make the reducer named ``name`` on the returned class send member ``victim`` -1000 x
    its result, each chunk signed as it signs the one it sends every other member (so both
    pass every check on receipt)."""
    from dedloc_jax.averaging.reducer import Reducer
    from dedloc_jax.averaging.verify import chunk_terms, result_claim, result_digest

    class Equivocator:
        name: str | None = None
        victim: int = 3

    class Twisted:
        def __init__(self, ms, red):
            self.ms, self.red = ms, red

        async def send(self, msg):
            if isinstance(msg, dict) and msg.get("t") == "res":
                r, k = self.red.plan, msg["k"]
                a, b = self.red.chunks[k]
                cfg = r.config
                start, stop = self.red.start + a, self.red.start + b
                codec = r.codec.at(start, stop)
                x = codec.decode(msg["d"], stop - start)
                data = bytes(codec.encode(np.float32(-1000.0) * x))
                terms = chunk_terms(start, stop, codec.name, cfg.robust_mode, cfg.robust_tau)
                mask, tau = frozenset(msg["m"]), msg.get("u")
                rd = result_digest(r.round_id, r.spec.digest, r.me, k, data, mask, tau, terms)
                claim = result_claim(r.round_id, r.spec.digest, r.me, k, rd)
                msg = dict(msg, d=data, sg=self.red.identity.sign(claim))
            await self.ms.send(msg)

        def __getattr__(self, name):
            return getattr(self.ms, name)

    original = Reducer._send_results_to

    async def send_results_to(self, s, ms, gauge):
        if self.plan.name(self.plan.me) == Equivocator.name and s == Equivocator.victim:
            ms = Twisted(ms, self)
        await original(self, s, ms, gauge)

    monkeypatch.setattr(Reducer, "_send_results_to", send_results_to)
    return Equivocator
