"""The butterfly all-reduce on the simulated network (virtual time)."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import trio

from dedloc_jax.averaging import AllReduceConfig, Member, solve_shares, wire
from dedloc_jax.averaging.chunk_codecs import NoCompression
from dedloc_jax.averaging.errors import ShareLostError
from dedloc_jax.averaging.load_balancing import equal_split
from dedloc_jax.averaging.partition import fractions_to_parts
from p2p.rpc import MessageStream
from p2p.testing import host_of

from .helpers import check_survivors, make_tree, run_round

ODD_SHAPES = [(3, 5), (7,), (), (2, 1, 3), (37,)]


def _mixed_tree(rng):
    return {
        "w": rng.standard_normal((3, 5)).astype(np.float32),
        "h": [rng.standard_normal(7).astype(np.float16), np.full((), 0.5, np.float32)],
        "b": jnp.asarray(rng.standard_normal((2, 1, 3)), dtype=jnp.bfloat16),
        "big": rng.standard_normal(41).astype(np.float32),
    }


@pytest.mark.parametrize(
    "modes",
    [
        ["node"],
        ["node", "client"],
        ["aux", "client"],
        ["node", "node", "aux"],
        ["node", "client", "client", "aux", "node"],
        ["node"] * 6 + ["client"] * 5 + ["aux"] * 5,
    ],
)
def test_exact_weighted_mean_with_clients_aux_and_mixed_dtypes(modes):
    rng = np.random.default_rng(len(modes))
    trees = [_mixed_tree(rng) for _ in modes]
    weights = [float(rng.integers(1, 9)) for _ in modes]
    outcome, _, names = run_round(modes, trees, weights)
    senders = [i for i, m in enumerate(modes) if m != "aux"]
    for i, m in enumerate(modes):
        if m == "aux":
            assert outcome[i].average is None
    results = check_survivors(outcome, trees, weights, names)
    assert len(results) == len(senders)
    for share in results[0].shares:  # nothing went wrong: every chunk includes every sender
        assert share.contributors == frozenset(names[i] for i in senders)
        assert not share.repaired
    # same structure, shapes and dtypes back
    avg = results[0].average
    assert avg["h"][0].dtype == np.float16 and avg["b"].dtype == ml_dtypes.bfloat16
    assert avg["w"].shape == (3, 5) and avg["h"][1].shape == ()
    total = sum(weights[i] for i in senders)
    want = sum(np.asarray(trees[i]["w"], np.float64) * weights[i] for i in senders) / total
    np.testing.assert_allclose(avg["w"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("codec,tol", [("fp16", 2e-3), ("bf16", 1.6e-2), ("int8", 4e-2)])
def test_compressed_rounds_are_bit_identical_and_within_codec_error(codec, tol):
    modes = ["node", "node", "client", "aux"]
    rng = np.random.default_rng(7)
    trees = [make_tree(rng, ODD_SHAPES) for _ in modes]
    weights = [1.0, 2.0, 3.0, 1.0]
    outcome, _, names = run_round(modes, trees, weights, codec=codec)
    # parts and results are each rounded once: allow two codec errors relative to |x| ~ 3
    check_survivors(outcome, trees, weights, names, rtol=0, atol=tol * 4)


def test_shares_follow_bandwidth_and_beat_an_equal_split_in_simulated_time():
    mbit = 1e6 / 8
    speeds = [10, 25, 50, 100]
    bandwidth = [(s * mbit, s * mbit) for s in speeds]
    modes = ["node"] * 4
    rng = np.random.default_rng(3)
    trees = [{"g": rng.standard_normal(250_000).astype(np.float32)} for _ in modes]
    members = [Member(f"p{i}", "node", *bw) for i, bw in enumerate(bandwidth)]
    lp = solve_shares(members)
    assert lp.fractions[0] <= lp.fractions[1] < lp.fractions[2] < lp.fractions[3]
    cfg = AllReduceConfig.testing().replace(chunk_elems=1 << 14, stall_timeout=20.0)
    durations = {}
    for label, parts in (("lp", lp.parts), ("equal", fractions_to_parts(equal_split(members)))):
        outcome, durations[label], names = run_round(
            modes, trees, [1.0] * 4, bandwidth=bandwidth, config=cfg, parts=parts, timeout=300
        )
        check_survivors(outcome, trees, [1.0] * 4, names)
    bound = lp.lower_bound(250_000 * 4)
    assert bound <= durations["lp"] < durations["equal"]


class _PoisonCodec(NoCompression):
    """Encodes like "none" but corrupts one chunk: NaNs or a wrong size."""

    def __init__(self, how: str) -> None:
        super().__init__()
        object.__setattr__(self, "how", how)
        object.__setattr__(self, "calls", 0)

    def encode(self, x):
        object.__setattr__(self, "calls", self.calls + 1)
        if self.calls == 2:
            if self.how == "nan":
                x = x.copy()
                x[0] = np.nan
            else:
                return super().encode(x)[:-4]
        return super().encode(x)


@pytest.mark.parametrize("how", ["nan", "size"])
def test_non_finite_or_wrongly_sized_contribution_is_excluded_and_logged(how, caplog):
    modes = ["node", "node", "node"]
    rng = np.random.default_rng(11)
    trees = [make_tree(rng, ODD_SHAPES) for _ in modes]
    weights = [1.0, 1.0, 1.0]
    codecs = ["none", "none", _PoisonCodec(how)]
    outcome, _, names = run_round(modes, trees, weights, codecs=codecs)
    results = check_survivors(outcome, trees, weights, names)
    excluded = [
        seg for share in results[0].shares for seg in share.segments if names[2] not in seg[2]
    ]
    assert excluded, "the poisoned chunk and the ones after it must leave member 2 out"
    assert any(names[2] in rec.getMessage() for rec in caplog.records)


def test_local_nan_makes_a_member_abstain_but_still_receive():
    modes = ["node", "node", "client"]
    rng = np.random.default_rng(5)
    trees = [make_tree(rng, ODD_SHAPES) for _ in modes]
    trees[2]["leaf1"][3] = np.inf
    outcome, _, names = run_round(modes, trees, [1.0, 2.0, 3.0])
    results = check_survivors(outcome, trees, [1.0, 2.0, 3.0], names)
    assert len(results) == 3
    assert all(s.contributors == {names[0], names[1]} for s in results[0].shares)


def _killer(victim: int, at: float):
    async def fault(net, nodes, scopes):
        await trio.sleep(at)
        net.kill(host_of(net, nodes[victim]))
        scopes[victim].cancel()

    return fault


@pytest.mark.parametrize("seed", range(8))
def test_peer_killed_at_a_random_point_leaves_identical_results(seed):
    rng = np.random.default_rng(100 + seed)
    modes = ["node", "node", "node", "client", "aux"]
    trees = [make_tree(rng, [(30, 50), (700,)]) for _ in modes]
    weights = [float(w) for w in rng.integers(1, 5, len(modes))]
    victim = int(rng.choice([0, 1, 2, 3, 4]))
    at = float(rng.uniform(0.05, 1.0))  # the fault-free round takes about 0.8 s here
    outcome, duration, names = run_round(
        modes,
        trees,
        weights,
        bandwidth=[(4e4, 4e4)] * 5,
        fault=_killer(victim, at),
        seed=seed,
        timeout=60,
    )
    assert outcome[victim] is None
    survivors = [i for i, m in enumerate(modes) if i != victim and m != "aux"]
    ok = [i for i in survivors if not isinstance(outcome[i], Exception)]
    assert ok, outcome
    results = check_survivors(outcome, trees, weights, names)
    assert len(results) == len(ok)
    for i in survivors:  # a survivor either has the common result or a clear error
        assert i in ok or isinstance(outcome[i], ShareLostError)
    assert duration <= 60


def test_reducer_killed_mid_round_is_repaired_by_survivors():
    rng = np.random.default_rng(1)
    modes = ["node"] * 4 + ["client"]
    trees = [make_tree(rng, [(30, 50), (700,)]) for _ in modes]
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    outcome, _, names = run_round(
        modes, trees, weights, bandwidth=[(4e4, 4e4)] * 5, fault=_killer(1, 0.6)
    )
    results = check_survivors(outcome, trees, weights, names)
    assert len(results) == 4
    lost = [s for s in results[0].shares if s.owner == names[1]][0]
    assert lost.repaired
    assert all(names[1] not in seg[2] for seg in lost.segments[-1:])


def test_stalled_peer_does_not_stall_the_round_past_its_timeout():
    rng = np.random.default_rng(2)
    modes = ["node"] * 4
    trees = [make_tree(rng, [(30, 50), (700,)]) for _ in modes]
    weights = [1.0] * 4

    async def stall(net, nodes, scopes):
        await trio.sleep(0.3)
        net.set_bandwidth(host_of(net, nodes[3]), 1.0, 1.0)  # effectively frozen

    outcome, duration, names = run_round(
        modes, trees, weights, bandwidth=[(4e4, 4e4)] * 4, fault=stall, timeout=30
    )
    assert duration <= 30 + 1e-6
    results = check_survivors(outcome, trees, weights, names)
    assert len(results) >= 3
    assert any(names[3] not in seg[2] for s in results[0].shares for seg in s.segments)


@pytest.mark.parametrize("at", [0.3, 0.6])
def test_a_partition_in_mid_round_never_leaves_two_different_results(at):
    """Both sides of a partition lose the other side's shares. Only a side holding a majority
    of the senders may re-reduce them; the other side's members fail the round instead of
    ending it with values of their own (a 100-peer soak saw such a divergence)."""
    rng = np.random.default_rng(7)
    modes = ["node"] * 6
    trees = [make_tree(rng, [(30, 50), (700,)]) for _ in modes]
    weights = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]

    async def split(net, nodes, scopes):
        await trio.sleep(at)
        hosts = [host_of(net, n) for n in nodes]
        net.partition(hosts[4:], hosts[:4])

    outcome, _, names = run_round(
        modes, trees, weights, bandwidth=[(4e4, 4e4)] * 6, fault=split, timeout=60
    )
    assert all(isinstance(outcome[i], BaseException) for i in (4, 5)), outcome[4:]
    results = check_survivors(outcome, trees, weights, names)  # bit-identical, correct means
    assert len(results) == 4


def test_the_ack_never_overlaps_a_send_that_returns_late(monkeypatch):
    """A stream takes one sending task at a time (the mux raises BusyResourceError). On a busy
    machine a part's send can return after the reducer already answered it; the ack must wait
    for it. A two-peer round on loopback crashed on exactly this under CI load."""
    real_send = MessageStream.send
    busy: set[int] = set()

    async def send_that_returns_late(self, msg):
        if id(self) in busy:
            raise trio.BusyResourceError("another task is sending on this stream")
        busy.add(id(self))
        try:
            await real_send(self, msg)
            if wire.kind_of(msg) == "part":
                await trio.sleep(1.0)  # the data is out; this task resumes late
        finally:
            busy.discard(id(self))

    monkeypatch.setattr(MessageStream, "send", send_that_returns_late)
    rng = np.random.default_rng(8)
    modes = ["node", "node", "client"]
    trees = [make_tree(rng, [(30, 50), (700,)]) for _ in modes]
    weights = [1.0, 2.0, 3.0]
    cfg = AllReduceConfig.testing().replace(chunk_elems=512, stall_timeout=5.0)  # 2 parts a share
    outcome, _, names = run_round(modes, trees, weights, timeout=60, config=cfg)
    results = check_survivors(outcome, trees, weights, names)
    assert len(results) == 3, outcome
    assert all(not s.repaired for s in results[0].shares)


def test_a_sender_sends_no_part_before_its_streams_to_every_reducer_are_open(monkeypatch):
    """Parts sent while other streams of the sender still open take the uplink the openings
    need: in bench.collaboration a 14 KB/s sender opened its 8th stream after 21 s, and that
    reducer excluded it as stalled. Here the stream to one reducer takes 3 s to open (a long
    path); the sender's first part leaves only then."""
    from dedloc_jax.averaging import AveragingService, GroupSpec, all_reduce
    from dedloc_jax.averaging.partition import FRACTION_GRID
    from p2p.node import NodeConfig
    from p2p.sim import SimNetwork
    from p2p.testing import open_sim_nodes, run_sim

    sent_at: list[float] = []
    part = wire.part

    def timed_part(k, data):
        sent_at.append(trio.current_time())
        return part(k, data)

    monkeypatch.setattr(wire, "part", timed_part)
    cfg = AllReduceConfig.internet()
    results: list = []

    async def main() -> None:
        net = SimNetwork(seed=0)
        async with open_sim_nodes(net, 3, config=NodeConfig.testing(), latency=0.01) as nodes:
            services = [AveragingService(node, cfg) for node in nodes]
            for a in nodes:
                for b in nodes:
                    if a is not b:
                        a.peerstore.add_addrs(b.peer_id, b.addrs)
                        await a.connect(b.peer_id)
            # The only sender is node 0; the path to reducer 2 is long.
            net.set_latency(host_of(net, nodes[0]), host_of(net, nodes[2]), 0.75)
            modes = ("node", "aux", "aux")
            spec = GroupSpec(
                tuple(Member(str(n.peer_id), m) for n, m in zip(nodes, modes, strict=True)),
                b"opening",
                (0, FRACTION_GRID // 2, FRACTION_GRID - FRACTION_GRID // 2),
            )
            vec = np.arange(1 << 16, dtype=np.float32)
            t0 = trio.current_time()

            async def one(i: int) -> None:
                tree = vec if i == 0 else np.zeros_like(vec)
                weight = float(i == 0)
                results.append(await all_reduce(services[i], spec, tree, weight, config=cfg))

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, i)
            sent_at[:] = [t - t0 for t in sent_at]

    run_sim(main)
    assert len(results) == 3
    assert sent_at and min(sent_at) >= 1.5  # after the 2 x 0.75 s round trip to reducer 2
