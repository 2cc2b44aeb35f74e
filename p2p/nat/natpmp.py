"""NAT-PMP (RFC 6886): ask the home router (the default gateway) for a TCP port mapping.

Protocol (UDP to the gateway's port 5351, big-endian, version 0)::

    external address request   version u8 = 0, opcode u8 = 0                     (2 bytes)
    its response               0, 128, result u16, epoch u32, address 4 bytes    (12 bytes)
    mapping request            0, opcode (1 UDP, 2 TCP), reserved u16 = 0,
                               internal port u16, suggested external port u16,
                               lifetime u32 (seconds; 0 with external port 0 deletes)  (12 bytes)
    its response               0, 128 + opcode, result u16, epoch u32, internal port u16,
                               mapped external port u16, lifetime u32             (16 bytes)

Requests are retried after 250 ms, doubling each time (the RFC's schedule, cut short: a router
that does not answer in a few seconds speaks no NAT-PMP). A mapping is renewed at half its
lifetime by sending the same request again. The encoders and decoders are pure; a reply of the
wrong size, version, opcode, or for another port is refused with :class:`PortMapError`.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from p2p.nat.errors import OtherProtocol, PortMapError, PortMapRefused

logger = logging.getLogger(__name__)

T = TypeVar("T")

PORT = 5351
MAX_REPLY = 1100  # PCP's largest message (RFC 6887); NAT-PMP's are at most 16 bytes
OP_EXTERNAL = 0
OP_MAP_UDP = 1
OP_MAP_TCP = 2
RESPONSE = 128
RESULTS = {
    0: "success",
    1: "unsupported version",
    2: "not authorized / refused",
    3: "network failure",
    4: "out of resources",
    5: "unsupported opcode",
}


@dataclass(frozen=True)
class ExternalAddress:
    epoch: int
    address: str


@dataclass(frozen=True)
class Mapping:
    epoch: int
    internal_port: int
    external_port: int
    lifetime: int


def encode_external_request() -> bytes:
    return bytes((0, OP_EXTERNAL))


def encode_map_request(
    internal_port: int, external_port: int, lifetime: int, *, tcp: bool = True
) -> bytes:
    """A mapping request; ``lifetime`` 0 (and ``external_port`` 0) deletes the mapping."""
    if not 0 < internal_port < 65536 or not 0 <= external_port < 65536:
        raise ValueError("ports must be in 1..65535 (external 0: any)")
    if not 0 <= lifetime < 1 << 32:
        raise ValueError("lifetime must fit 32 bits")
    op = OP_MAP_TCP if tcp else OP_MAP_UDP
    return struct.pack("!BBHHHI", 0, op, 0, internal_port, external_port, lifetime)


def _header(data: bytes, opcode: int, size: int) -> None:
    """Check size, version, opcode and result code (PortMapError / PortMapRefused)."""
    if data[:1] == b"\x02":  # a PCP server's answer (RFC 6887): it does not speak NAT-PMP
        raise OtherProtocol("the gateway speaks PCP, not NAT-PMP")
    if len(data) != size:
        raise PortMapError(f"NAT-PMP reply of {len(data)} bytes, expected {size}")
    version, op, result = struct.unpack_from("!BBH", data)
    if version != 0:
        raise PortMapError(f"NAT-PMP reply of version {version}")
    if op != RESPONSE + opcode:
        raise PortMapError(f"NAT-PMP reply to opcode {op - RESPONSE}, expected {opcode}")
    if result != 0:
        raise PortMapRefused(f"NAT-PMP refused: {RESULTS.get(result, f'result {result}')}")


def decode_external_response(data: bytes) -> ExternalAddress:
    _header(data, OP_EXTERNAL, 12)
    (epoch,) = struct.unpack_from("!I", data, 4)
    address = str(ipaddress.IPv4Address(data[8:12]))
    return ExternalAddress(epoch, address)


def decode_map_response(data: bytes, internal_port: int, *, tcp: bool = True) -> Mapping:
    _header(data, OP_MAP_TCP if tcp else OP_MAP_UDP, 16)
    epoch, internal, external, lifetime = struct.unpack_from("!IHHI", data, 4)
    if internal != internal_port:
        raise PortMapError(f"NAT-PMP reply for port {internal}, asked for {internal_port}")
    if external == 0 and lifetime != 0:
        raise PortMapError("NAT-PMP mapped external port 0")
    return Mapping(epoch, internal, external, lifetime)


def default_gateway(route_table: str | None = None) -> str | None:
    """The IPv4 default gateway from ``/proc/net/route`` (this process's namespace), or None."""
    if route_table is None:
        try:
            with open("/proc/net/route") as f:
                route_table = f.read()
        except OSError:
            return None
    for line in route_table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4 or fields[1] != "00000000":
            continue
        try:
            flags, gateway = int(fields[3], 16), int(fields[2], 16)
        except ValueError:
            continue
        if flags & 0x2 and gateway:  # RTF_GATEWAY
            return str(ipaddress.IPv4Address(struct.pack("<I", gateway)))
    return None


async def ask_gateway(
    protocol: str,
    gateway: str,
    port: int,
    request: bytes,
    decode: Callable[[bytes], T],
    first_wait: float,
    tries: int,
) -> T:
    """Send ``request`` over UDP to ``gateway:port`` and return ``decode(reply)``; NAT-PMP's
    schedule, which PCP shares: resent after ``first_wait``, doubling, ``tries`` times.

    A reply ``decode`` rejects with PortMapError (garbage, a stale or another request's
    reply) is ignored and the wait goes on; PortMapRefused (a refusal, or the other protocol
    answering) and an ICMP error (nobody listens there) end the attempt at once.
    """
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with sock:
        await sock.connect((gateway, port))
        wait = first_wait
        last: PortMapError | None = None
        for _ in range(tries):
            await sock.send(request)
            with trio.move_on_after(wait):
                while True:
                    try:
                        data = await sock.recv(MAX_REPLY)
                    except OSError as e:  # ICMP port unreachable
                        raise PortMapError(f"{protocol} at {gateway}: {e}") from None
                    try:
                        return decode(data)
                    except PortMapRefused:
                        raise
                    except PortMapError as e:
                        last = e
                        logger.debug("ignoring a %s reply: %s", protocol, e)
            wait *= 2
    raise PortMapError(f"no {protocol} answer from {gateway}" + (f" ({last})" if last else ""))


class NATPMPClient:
    """Talks NAT-PMP to one gateway (I/O; the messages are the pure functions above)."""

    def __init__(
        self, gateway: str, *, port: int = PORT, first_wait: float = 0.25, tries: int = 4
    ) -> None:
        self.gateway = gateway
        self.port = port
        self.first_wait = first_wait
        self.tries = tries

    async def _ask(self, request: bytes, decode: Callable[[bytes], T]) -> T:
        return await ask_gateway(
            "NAT-PMP", self.gateway, self.port, request, decode, self.first_wait, self.tries
        )

    async def external_address(self) -> ExternalAddress:
        return await self._ask(encode_external_request(), decode_external_response)

    async def map(self, internal_port: int, external_port: int, lifetime: int) -> Mapping:
        request = encode_map_request(internal_port, external_port, lifetime)
        return await self._ask(request, lambda d: decode_map_response(d, internal_port))

    async def unmap(self, internal_port: int) -> None:
        await self.map(internal_port, 0, 0)
