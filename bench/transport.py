"""Transport benchmark: encrypted throughput and RPC latency between two processes on loopback.

Run ``python -m bench.transport``. Each measurement spawns a fresh receiver process, so sender
and receiver run on different cores as they would on two machines. Figures:

Throughputs are ``*_gb_per_s``: gigabytes (1e9 bytes) per second, as in ``bench.relay``.

- ``socket_gb_per_s``: plain blocking sockets (sendall / recv_into of 1 MiB) moving the same bytes;
  the ceiling any Python transport on this machine can reach.
- ``secure_channel_gb_per_s`` / ``secure_channel8_gb_per_s``: the secure channel alone over
  TCP, 1 MiB frames, on 1 and on 8 connections at once, with the cipher both sides pick
  (AES-256-OCB3 with AES instructions); ``secure_channel_gcm_gb_per_s`` forces AES-256-GCM and
  ``secure_channel_chacha_gb_per_s`` ChaCha20.
- ``rpc_rtt_*_us``: a 64-byte request and its reply.
- ``*_cpu_s_per_gb``: CPU seconds each side spent per GB moved. On a shared machine wall-clock
  throughput swings with the load; CPU cost per byte does not, and ``cpu_bound_ratio`` (socket
  CPU / encrypted CPU of the busier side) is the throughput ratio two free cores would give.

Nodes keep freed memory for reuse by default (``NodeConfig.retain_freed_memory``: glibc then
costs no page fault per 4 KiB of each received message). ``node_no_retain_*`` is one node stream
with that switched off in both processes; it is the first node measurement, since the setting is
process-wide and lasts.

When the node/mux layer is available, ``encrypted_gb_per_s`` / ``encrypted8_gb_per_s`` are 1 MiB
messages on one and on 8 mux streams of one connection, and RPC latency is ``Node.call``;
otherwise they are the raw secure-channel figures. The last line printed is one JSON object
with every figure.

``--repeat N`` (default 3) measures the plain socket, the secure channel and the one-stream
figure N times, interleaved, so that each ratio is taken between neighbours in time:
``encrypted_vs_socket`` and ``secure_channel_vs_socket`` are the medians of those N ratios
(``*_runs`` lists them all), and every figure of the three is its median.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from p2p.errors import ConnectionClosed
from p2p.identity import Identity
from p2p.secure import secure_inbound, secure_outbound

MIB = 1 << 20
SERVER_SEED = b"bench-transport-server"
CLIENT_SEED = b"bench-transport-client"
RPC_PAYLOAD = 64
RPC_WARMUP = 50


@dataclass(frozen=True)
class Throughput:
    gbps: float
    send_cpu_s_per_gb: float
    recv_cpu_s_per_gb: float
    cipher: str = "none"


# ---- receiver processes (top-level functions: multiprocessing spawns them by name) -----------


def _socket_receiver(conn: Any, total: int) -> None:
    with socket.socket() as lsock:
        lsock.bind(("127.0.0.1", 0))
        lsock.listen(1)
        conn.send(lsock.getsockname()[1])
        sock, _ = lsock.accept()
    with sock:
        buf = memoryview(bytearray(MIB))
        cpu = time.process_time()
        got = 0
        while got < total:
            n = sock.recv_into(buf)
            if not n:
                break
            got += n
        conn.send(time.process_time() - cpu)
        sock.sendall(b"k")
        sock.recv(1)


def _secure_receiver(conn: Any, total: int, streams: int, cipher: str | None, mode: str) -> None:
    trio.run(_secure_receiver_async, conn, total, streams, cipher, mode)


async def _secure_receiver_async(
    conn: Any, total: int, streams: int, cipher: str | None, mode: str
) -> None:
    identity = Identity.from_seed(SERVER_SEED)
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(streams)
    conn.send(listener.getsockname()[1])
    done = trio.Semaphore(0)

    async def serve_one(sock: trio.socket.SocketType) -> None:
        channel = await secure_inbound(trio.SocketStream(sock), identity, cipher=cipher)
        if mode == "echo":
            while True:
                try:
                    frame = await channel.receive_frame()
                except ConnectionClosed:  # the client closing ends the benchmark
                    return
                await channel.send_frame(frame)
        got, share = 0, total // streams
        while got < share:
            got += len(await channel.receive_frame())
        done.release()
        await channel.send_frame(b"k")
        try:
            await channel.receive_frame()
        finally:
            await channel.aclose()

    cpu = time.process_time()  # handshakes included: a few milliseconds against a second or more
    async with trio.open_nursery() as nursery:
        for _ in range(streams):
            sock, _ = await listener.accept()
            nursery.start_soon(serve_one, sock)
        listener.close()
        if mode != "echo":
            for _ in range(streams):
                await done.acquire()
            conn.send(time.process_time() - cpu)


def _node_receiver(conn: Any, preset: str, retain: bool = True) -> None:
    trio.run(_node_receiver_async, conn, preset, retain)


async def _node_receiver_async(conn: Any, preset: str, retain: bool) -> None:
    from p2p.node import NodeConfig, open_node

    stop = trio.Event()

    async def sink(ctx: Any, stream: Any) -> None:
        got = 0
        async for message in stream:
            got += len(message)
        await stream.send(got)

    async def echo(ctx: Any, request: Any) -> Any:
        return request

    async def cpu(ctx: Any, request: Any) -> float:
        return time.process_time()

    async def stop_handler(ctx: Any, request: Any) -> None:
        stop.set()

    config = getattr(NodeConfig, preset)().replace(retain_freed_memory=retain)
    async with open_node(Identity.from_seed(SERVER_SEED), config=config) as node:
        node.add_stream_handler("bench.sink", sink)
        node.add_handler("bench.echo", echo)
        node.add_handler("bench.cpu", cpu)
        node.add_handler("bench.stop", stop_handler)
        conn.send(str(node.addrs[0]))
        await stop.wait()
        await trio.sleep(0.1)  # let the reply to bench.stop leave


def _spawn(target: Callable[..., None], *args: Any) -> tuple[Any, Any, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    if not parent.poll(120):
        proc.kill()
        raise RuntimeError("receiver process did not start")
    return proc, parent, parent.recv()


def _join(proc: Any) -> None:
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _receiver_cpu(pipe: Any) -> float:
    if not pipe.poll(60):
        raise RuntimeError("receiver did not report its CPU time")
    return pipe.recv()


# ---- senders ---------------------------------------------------------------------------------


def measure_socket(total: int) -> Throughput:
    proc, pipe, port = _spawn(_socket_receiver, total)
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            payload = bytes(MIB)
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(total // MIB):
                sock.sendall(payload)
            send_cpu = time.process_time() - cpu
            sock.recv(1)
            elapsed = time.perf_counter() - start
            sock.sendall(b"k")
        recv_cpu = _receiver_cpu(pipe)
    finally:
        _join(proc)
    gb = total / 1e9
    return Throughput(gb / elapsed, send_cpu / gb, recv_cpu / gb)


async def _secure_sender(port: int, total: int, streams: int, cipher: str | None) -> Throughput:
    identity = Identity.from_seed(CLIENT_SEED)
    expected = Identity.from_seed(SERVER_SEED).peer_id
    channels = []
    for _ in range(streams):
        raw = await trio.open_tcp_stream("127.0.0.1", port)
        channels.append(await secure_outbound(raw, identity, expected, cipher=cipher))
    payload = bytes(MIB)
    frames_each = total // streams // MIB
    send_cpu = 0.0

    async def run_one(channel) -> None:
        nonlocal send_cpu
        for _ in range(frames_each):
            await channel.send_frame(payload)
        send_cpu = max(send_cpu, time.process_time() - cpu)
        await channel.receive_frame()

    start, cpu = time.perf_counter(), time.process_time()
    async with trio.open_nursery() as nursery:
        for channel in channels:
            nursery.start_soon(run_one, channel)
    elapsed = time.perf_counter() - start
    for channel in channels:
        await channel.send_frame(b"k")
        await channel.aclose()
    gb = total / 1e9
    return Throughput(gb / elapsed, send_cpu / gb, 0.0, channels[0].cipher)


def measure_secure(total: int, streams: int, cipher: str | None) -> Throughput:
    proc, pipe, port = _spawn(_secure_receiver, total, streams, cipher, "sink")
    try:
        result = trio.run(_secure_sender, port, total, streams, cipher)
        recv_cpu = _receiver_cpu(pipe)
    finally:
        _join(proc)
    recv_per_gb = recv_cpu / (total / 1e9)
    return Throughput(result.gbps, result.send_cpu_s_per_gb, recv_per_gb, result.cipher)


async def _secure_rtt(port: int, rounds: int) -> list[float]:
    identity = Identity.from_seed(CLIENT_SEED)
    raw = await trio.open_tcp_stream("127.0.0.1", port)
    channel = await secure_outbound(raw, identity, Identity.from_seed(SERVER_SEED).peer_id)
    request = bytes(RPC_PAYLOAD)
    samples = []
    for i in range(rounds + RPC_WARMUP):
        start = time.perf_counter()
        await channel.send_frame(request)
        await channel.receive_frame()
        if i >= RPC_WARMUP:
            samples.append(time.perf_counter() - start)
    await channel.aclose()
    return samples


def measure_secure_rtt(rounds: int) -> list[float]:
    proc, _, port = _spawn(_secure_receiver, 0, 1, None, "echo")
    try:
        return trio.run(_secure_rtt, port, rounds)
    finally:
        _join(proc)


async def _node_sender(
    addr: str, total: int, streams: int, preset: str, rounds: int, retain: bool, cipher: str | None
) -> tuple[Throughput, list[float]]:
    from p2p.node import NodeConfig, open_node

    config = getattr(NodeConfig, preset)().replace(retain_freed_memory=retain)
    if cipher is not None:  # what the dialer offers decides: the listener offers all it has
        config = config.replace(cipher=cipher)
    async with open_node(Identity.from_seed(CLIENT_SEED), listen=(), config=config) as node:
        await node.connect(addr)
        payload = bytes(MIB)
        per_stream = total // streams // MIB
        send_cpu = 0.0

        async def one_stream() -> None:
            nonlocal send_cpu
            async with node.open_stream(addr, "bench.sink") as stream:
                for _ in range(per_stream):
                    await stream.send(payload)
                send_cpu = max(send_cpu, time.process_time() - cpu)
                await stream.send_eof()
                if await stream.receive() != per_stream * MIB:
                    raise RuntimeError("the receiver counted different bytes")

        remote_cpu = await node.call(addr, "bench.cpu", None)
        start, cpu = time.perf_counter(), time.process_time()
        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(one_stream)
        elapsed = time.perf_counter() - start
        remote_cpu = await node.call(addr, "bench.cpu", None) - remote_cpu
        samples = []
        request = bytes(RPC_PAYLOAD)
        for i in range(rounds + RPC_WARMUP if rounds else 0):
            t0 = time.perf_counter()
            await node.call(addr, "bench.echo", request)
            if i >= RPC_WARMUP:
                samples.append(time.perf_counter() - t0)
        connection = node.connection_to(Identity.from_seed(SERVER_SEED).peer_id)
        cipher = connection.channel.cipher if connection is not None else "unknown"
        await node.call(addr, "bench.stop", None)
        gb = total / 1e9
        return Throughput(gb / elapsed, send_cpu / gb, remote_cpu / gb, cipher), samples


def measure_node(
    total: int,
    streams: int,
    preset: str,
    rounds: int = 0,
    retain: bool = True,
    cipher: str | None = None,
) -> tuple[Throughput, list[float]]:
    """``retain=False`` only means something before this process opened any node with it True
    (:func:`p2p.node.retain_freed_memory` is process-wide and permanent)."""
    proc, _, addr = _spawn(_node_receiver, preset, retain)
    try:
        return trio.run(_node_sender, addr, total, streams, preset, rounds, retain, cipher)
    finally:
        _join(proc)


def _node_available() -> bool:
    try:
        import p2p.node  # noqa: F401
    except ImportError:
        return False
    return True


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _median_throughput(runs: list[Throughput]) -> Throughput:
    return Throughput(
        statistics.median(t.gbps for t in runs),
        statistics.median(t.send_cpu_s_per_gb for t in runs),
        statistics.median(t.recv_cpu_s_per_gb for t in runs),
        runs[0].cipher,
    )


def _ratios(runs: list[Throughput], sockets: list[Throughput]) -> list[float]:
    return [round(t.gbps / s.gbps, 3) for t, s in zip(runs, sockets, strict=True)]


def _show(name: str, t: Throughput) -> None:
    print(
        f"{name:28s} {t.gbps:6.2f} GB/s   CPU s/GB: send {t.send_cpu_s_per_gb:.3f}"
        f"  receive {t.recv_cpu_s_per_gb:.3f}   ({t.cipher})"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="MiB moved per throughput figure")
    parser.add_argument("--rounds", type=int, default=2000, help="RPC round trips to time")
    parser.add_argument(
        "--channel-only", action="store_true", help="measure the secure channel, not the node"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="rounds of socket / secure channel / one stream, interleaved (medians reported)",
    )
    parser.add_argument(
        "--cipher",
        choices=["aes-256-ocb", "aes-256-gcm", "chacha20-poly1305"],
        default=None,
        help="force this cipher in the node and secure-channel figures (default: negotiated)",
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    total = max(8, args.mib - args.mib % 8) * MIB
    use_node = not args.channel_only and _node_available()

    if use_node:  # first: retaining freed memory, once switched on, lasts for the process
        plain1, _ = measure_node(total, 1, "internet", retain=False, cipher=args.cipher)
        _show("node, 1 stream (no retain)", plain1)
    sock_runs: list[Throughput] = []
    sc1_runs: list[Throughput] = []
    node1_runs: list[Throughput] = []
    for _ in range(args.repeat):
        sock_runs.append(measure_socket(total))
        _show("plain socket", sock_runs[-1])
        sc1_runs.append(measure_secure(total, 1, args.cipher))
        _show("secure channel, 1 conn", sc1_runs[-1])
        if use_node:
            node1_runs.append(measure_node(total, 1, "internet", cipher=args.cipher)[0])
            _show("node, 1 stream (default)", node1_runs[-1])
    sock = _median_throughput(sock_runs)
    sc1 = _median_throughput(sc1_runs)
    sc1_ratios = _ratios(sc1_runs, sock_runs)
    sc8 = measure_secure(total, 8, args.cipher)
    _show("secure channel, 8 conns", sc8)
    gcm = measure_secure(total, 1, "aes-256-gcm")
    _show("secure channel, AES-GCM", gcm)
    chacha = measure_secure(total, 1, "chacha20-poly1305")
    _show("secure channel, ChaCha20", chacha)
    rtts = measure_secure_rtt(args.rounds)
    sc_median, sc_p99 = statistics.median(rtts) * 1e6, _percentile(rtts, 0.99) * 1e6
    print(f"secure channel echo RTT      median {sc_median:.0f} us, p99 {sc_p99:.0f} us")

    def busier(t: Throughput) -> float:
        return max(t.send_cpu_s_per_gb, t.recv_cpu_s_per_gb)

    result: dict[str, Any] = {}
    if use_node:
        _, node_rtts = measure_node(8 * MIB, 1, "internet", args.rounds)
        node1 = _median_throughput(node1_runs)
        enc_ratios = _ratios(node1_runs, sock_runs)
        node8, _ = measure_node(total, 8, "internet", cipher=args.cipher)
        _show("node, 8 streams (default)", node8)
        bulk1, _ = measure_node(total, 1, "bulk", cipher=args.cipher)
        _show("node, 1 stream (bulk)", bulk1)
        rtt_median = statistics.median(node_rtts) * 1e6
        rtt_p99 = _percentile(node_rtts, 0.99) * 1e6
        print(f"Node.call RTT                median {rtt_median:.0f} us, p99 {rtt_p99:.0f} us")
        enc1, enc8 = node1, node8
        result["node_bulk_gb_per_s"] = round(bulk1.gbps, 3)
        result["node_send_cpu_s_per_gb"] = round(node1.send_cpu_s_per_gb, 3)
        result["node_recv_cpu_s_per_gb"] = round(node1.recv_cpu_s_per_gb, 3)
        result["node_no_retain_gb_per_s"] = round(plain1.gbps, 3)
        result["node_no_retain_vs_socket"] = round(plain1.gbps / sock.gbps, 3)
        result["node_no_retain_send_cpu_s_per_gb"] = round(plain1.send_cpu_s_per_gb, 3)
        result["node_no_retain_recv_cpu_s_per_gb"] = round(plain1.recv_cpu_s_per_gb, 3)
        result["no_retain_cpu_bound_ratio"] = round(busier(sock) / busier(plain1), 3)
        measured_over = (
            "Node.open_stream (1 MiB msgpack messages, NodeConfig.internet: freed memory kept) "
            "on one connection; "
            "RTT: Node.call"
        )
    else:
        enc1, enc8, rtt_median, rtt_p99 = sc1, sc8, sc_median, sc_p99
        enc_ratios = sc1_ratios
        measured_over = "secure channel over TCP (one connection per stream); RTT: frame echo"

    result = {
        "encrypted_gb_per_s": round(enc1.gbps, 3),
        "encrypted8_gb_per_s": round(enc8.gbps, 3),
        "socket_gb_per_s": round(sock.gbps, 3),
        "rpc_rtt_median_us": round(rtt_median, 1),
        "rpc_rtt_p99_us": round(rtt_p99, 1),
        "cipher": sc1.cipher,
        "encrypted_vs_socket": round(statistics.median(enc_ratios), 3),
        "encrypted_vs_socket_runs": enc_ratios,
        "secure_channel_gb_per_s": round(sc1.gbps, 3),
        "secure_channel8_gb_per_s": round(sc8.gbps, 3),
        "secure_channel_gcm_gb_per_s": round(gcm.gbps, 3),
        "secure_channel_chacha_gb_per_s": round(chacha.gbps, 3),
        "secure_channel_vs_socket": round(statistics.median(sc1_ratios), 3),
        "secure_channel_vs_socket_runs": sc1_ratios,
        "secure_channel_rtt_median_us": round(sc_median, 1),
        "secure_channel_rtt_p99_us": round(sc_p99, 1),
        **result,
        "socket_send_cpu_s_per_gb": round(sock.send_cpu_s_per_gb, 3),
        "socket_recv_cpu_s_per_gb": round(sock.recv_cpu_s_per_gb, 3),
        "secure_channel_send_cpu_s_per_gb": round(sc1.send_cpu_s_per_gb, 3),
        "secure_channel_recv_cpu_s_per_gb": round(sc1.recv_cpu_s_per_gb, 3),
        "gcm_send_cpu_s_per_gb": round(gcm.send_cpu_s_per_gb, 3),
        "gcm_recv_cpu_s_per_gb": round(gcm.recv_cpu_s_per_gb, 3),
        "chacha_send_cpu_s_per_gb": round(chacha.send_cpu_s_per_gb, 3),
        "chacha_recv_cpu_s_per_gb": round(chacha.recv_cpu_s_per_gb, 3),
        "cpu_bound_ratio": round(busier(sock) / busier(enc1), 3),
        "secure_channel_cpu_bound_ratio": round(busier(sock) / busier(sc1), 3),
        "gcm_cpu_bound_ratio": round(busier(sock) / busier(gcm), 3),
        "chacha_cpu_bound_ratio": round(busier(sock) / busier(chacha), 3),
        "bytes_per_measurement": total,
        "repeat": args.repeat,
        "measured_over": measured_over,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
