"""Reading a run's progress table: ``DHT.get`` against ``KeyFollower`` (p2p.dht.follow).

    python -m bench.progress_reads [--peers 50,200] [--rounds 16] [--update-share 0.3]

Every peer of a collaboration holds one signed subkey of ``RUN.progress`` and re-reads the
whole table about once a second; between two reads roughly a third of the peers publish a new
record. This runs that pattern on N DHT nodes over the in-memory network (``p2p.dht.memnet``:
the full DHT protocol code, messages round-tripped through msgpack, no transport or crypto,
virtual time), first with every peer reading by ``get`` and then, on the same network and
records, by a follower per peer (after one read round each that is not counted: a follower's
first read fetches the whole table, as a get does). Per read round it reports the CPU seconds
of the whole simulation, the RPCs (the round's stores included) and the records carried by
answers. The two are measured side by side in one run; the ratio is the point.

The last line is one JSON object: for each peer count, ``get`` and ``follow`` with
``cpu_s_per_round``, ``rpcs_per_round``, ``records_per_round``, plus ``cpu_ratio`` and
``records_ratio`` (get over follow).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import trio
import trio.testing

from p2p.dht import DHT, DHTClock, DHTConfig, open_dht, owner_marker
from p2p.dht.memnet import MemoryNetwork
from p2p.identity import Identity

KEY = "bench.progress"


async def _measure(n: int, rounds: int, share: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    net = MemoryNetwork(latency=0.01)
    cfg = DHTConfig.fast().replace(
        refresh_interval=1e9, republish_interval=1e9, maintenance_interval=1e9, locate_ttl=30.0
    )
    dhts: list[DHT] = []
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:

        async def run(i: int, init: list[str], task_status=trio.TASK_STATUS_IGNORED) -> None:
            node = net.add_node(Identity.from_seed(f"bench-progress/{seed}/{i}".encode()))
            async with open_dht(
                node, initial_peers=init, config=cfg, clock=DHTClock(trio.current_time)
            ) as dht:
                task_status.started(dht)
                await trio.sleep_forever()

        dhts.append(await nursery.start(run, 0, []))
        for start in range(1, n, 16):
            async with trio.open_nursery() as batch:
                for i in range(start, min(n, start + 16)):
                    init = [str(rng.choice(dhts).node.addrs[0])]
                    batch.start_soon(lambda i=i, init=init: _join(nursery, run, i, init, dhts))
        counter = [0]

        async def publish(who: list[DHT]) -> None:
            counter[0] += 1
            async with trio.open_nursery() as pub:
                for d in who:
                    pub.start_soon(
                        lambda d=d: d.store(
                            KEY,
                            {"samples": counter[0]},
                            d.now() + 60,
                            subkey=owner_marker(d.peer_id),
                            replicas=6,
                        )
                    )

        await publish(dhts)
        followers = [d.follow(KEY) for d in dhts]
        for mode in ("get", "follow"):
            async with trio.open_nursery() as reads:  # warm-up: a follower's first full read
                for d, f in zip(dhts, followers, strict=True):
                    reads.start_soon(_read, d if mode == "get" else f, [])
            base = sum(d.protocol.stats.get("find_records_sent", 0) for d in dhts)
            cpu = 0.0
            rpcs0 = net.calls
            records = 0
            sizes: list[int] = []
            for _ in range(rounds):
                await publish([d for d in dhts if rng.random() < share])
                await trio.sleep(1.0)
                before = sum(f.stats["records"] for f in followers)
                c0 = time.process_time()
                async with trio.open_nursery() as reads:
                    for d, f in zip(dhts, followers, strict=True):
                        reads.start_soon(_read, d if mode == "get" else f, sizes)
                cpu += time.process_time() - c0
                if mode == "follow":
                    records += sum(f.stats["records"] for f in followers) - before
            if mode == "get":
                records = sum(d.protocol.stats.get("find_records_sent", 0) for d in dhts) - base
            out[mode] = {
                "cpu_s_per_round": cpu / rounds,
                "rpcs_per_round": (net.calls - rpcs0) / rounds,
                "records_per_round": records / rounds,
                "complete_reads": sum(s == n for s in sizes) / len(sizes),
            }
        nursery.cancel_scope.cancel()
    out["cpu_ratio"] = out["get"]["cpu_s_per_round"] / out["follow"]["cpu_s_per_round"]
    out["records_ratio"] = out["get"]["records_per_round"] / max(
        1.0, out["follow"]["records_per_round"]
    )
    return out


async def _read(reader: Any, sizes: list[int]) -> None:
    """One peer's read of the table: ``DHT.get(KEY)`` or ``KeyFollower.get()``."""
    value = await (reader.get(KEY) if isinstance(reader, DHT) else reader.get())
    sizes.append(len(value or {}))


async def _join(nursery: trio.Nursery, run: Any, i: int, init: list[str], dhts: list) -> None:
    dhts.append(await nursery.start(run, i, init))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.progress_reads")
    p.add_argument("--peers", default="50,200")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--update-share", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    result: dict[str, Any] = {}
    for n in (int(x) for x in args.peers.split(",") if x):
        r = trio.run(
            _measure,
            n,
            args.rounds,
            args.update_share,
            args.seed,
            clock=trio.testing.MockClock(autojump_threshold=0),
        )
        result[str(n)] = r
        for mode in ("get", "follow"):
            m = r[mode]
            print(
                f"{n} peers, {mode:6s}: {m['cpu_s_per_round']:.2f} CPU s per read round, "
                f"{m['rpcs_per_round']:.0f} RPCs, {m['records_per_round']:.0f} records "
                f"(complete reads {m['complete_reads']:.0%})"
            )
        print(f"{n} peers: get/follow CPU {r['cpu_ratio']:.1f}x, records {r['records_ratio']:.1f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
