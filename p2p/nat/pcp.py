"""PCP (RFC 6887), NAT-PMP's successor: ask the default gateway for a TCP port mapping.

Protocol (UDP to the gateway's port 5351, big-endian, version 2; addresses are 16 bytes,
IPv4 as IPv4-mapped IPv6 ``::ffff:a.b.c.d``). A MAP request is 60 bytes::

    header   version u8 = 2, R (0) | opcode u7 (1 = MAP), reserved u16,
             requested lifetime u32 (0 deletes), client address 16 bytes
    MAP      nonce 12 bytes, protocol u8 (6 = TCP), reserved 3 bytes,
             internal port u16, suggested external port u16, suggested external address 16

The response (at least 60 bytes) echoes the opcode with R = 1::

    header   version 2, 0x80 | opcode, reserved u8, result u8, lifetime u32, epoch u32,
             reserved 12 bytes
    MAP      nonce, protocol, reserved 3, internal port, assigned external port,
             assigned external address 16

The nonce ties a response to our request (and a later renewal or delete to the mapping). A
router that speaks only NAT-PMP answers a version-0 "unsupported version" reply, which ends the
attempt at once. Encoders and decoders are pure; the client shares NAT-PMP's retry loop
(:func:`p2p.nat.natpmp.ask_gateway`).
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

from p2p.nat.errors import OtherProtocol, PortMapError, PortMapRefused
from p2p.nat.natpmp import ask_gateway

PORT = 5351
VERSION = 2
OP_MAP = 1
TCP = 6
REQUEST_BYTES = 60
RESULTS = {
    0: "success",
    1: "unsupported version",
    2: "not authorized",
    3: "malformed request",
    4: "unsupported opcode",
    5: "unsupported option",
    6: "malformed option",
    7: "network failure",
    8: "no resources",
    9: "unsupported protocol",
    10: "user exceeded quota",
    11: "cannot provide external",
    12: "address mismatch",
    13: "excessive remote peers",
}
_HEADER = struct.Struct("!BBHI16s")
_MAP = struct.Struct("!12sB3xHH16s")
_RESPONSE = struct.Struct("!BBxBII12x")


@dataclass(frozen=True)
class PCPMapping:
    lifetime: int
    epoch: int
    internal_port: int
    external_port: int
    external_address: str


def _mapped(address: str) -> bytes:
    return ipaddress.IPv6Address(f"::ffff:{ipaddress.IPv4Address(address)}").packed


def _unmapped(packed: bytes) -> str:
    ip = ipaddress.IPv6Address(packed)
    if ip.ipv4_mapped is None:
        raise PortMapError(f"PCP gave a non-IPv4 address {ip}")
    return str(ip.ipv4_mapped)


def encode_map_request(
    client: str, nonce: bytes, internal_port: int, external_port: int, lifetime: int
) -> bytes:
    """A MAP request for TCP ``internal_port``; ``lifetime`` 0 deletes the mapping."""
    if len(nonce) != 12:
        raise ValueError("a PCP nonce is 12 bytes")
    if not 0 < internal_port < 65536 or not 0 <= external_port < 65536:
        raise ValueError("ports must be in 1..65535 (external 0: any)")
    if not 0 <= lifetime < 1 << 32:
        raise ValueError("lifetime must fit 32 bits")
    header = _HEADER.pack(VERSION, OP_MAP, 0, lifetime, _mapped(client))
    return header + _MAP.pack(nonce, TCP, internal_port, external_port, _mapped("0.0.0.0"))


def decode_map_response(data: bytes, nonce: bytes, internal_port: int) -> PCPMapping:
    """Check a MAP response against our request; PortMapRefused for a router's refusal."""
    if len(data) >= 4 and data[0] == 0 and data[1] >= 128:
        # a NAT-PMP server's reply: it does not speak PCP
        raise OtherProtocol("the gateway speaks NAT-PMP, not PCP")
    if len(data) < REQUEST_BYTES or len(data) > 1100 or len(data) % 4:
        raise PortMapError(f"PCP reply of {len(data)} bytes")
    version, op, result, lifetime, epoch = _RESPONSE.unpack_from(data)
    if version != VERSION:
        raise PortMapError(f"PCP reply of version {version}")
    if op != 0x80 | OP_MAP:
        raise PortMapError(f"PCP reply to opcode {op & 0x7F}, expected MAP")
    got_nonce, protocol, internal, external, address = _MAP.unpack_from(data, 24)
    if got_nonce != nonce:
        raise PortMapError("PCP reply with another nonce")
    if result != 0:
        raise PortMapRefused(f"PCP refused: {RESULTS.get(result, f'result {result}')}")
    if protocol != TCP or internal != internal_port:
        raise PortMapError(f"PCP reply for protocol {protocol} port {internal}")
    if external == 0 and lifetime != 0:
        raise PortMapError("PCP assigned external port 0")
    return PCPMapping(lifetime, epoch, internal, external, _unmapped(address))


class PCPClient:
    """Talks PCP to one gateway; ``client`` is our address on the interface towards it."""

    def __init__(
        self,
        gateway: str,
        client: str,
        nonce: bytes,
        *,
        port: int = PORT,
        first_wait: float = 0.25,
        tries: int = 4,
    ) -> None:
        self.gateway = gateway
        self.client = client
        self.nonce = nonce
        self.port = port
        self.first_wait = first_wait
        self.tries = tries

    async def map(self, internal_port: int, external_port: int, lifetime: int) -> PCPMapping:
        request = encode_map_request(
            self.client, self.nonce, internal_port, external_port, lifetime
        )
        return await ask_gateway(
            "PCP",
            self.gateway,
            self.port,
            request,
            lambda d: decode_map_response(d, self.nonce, internal_port),
            self.first_wait,
            self.tries,
        )

    async def unmap(self, internal_port: int) -> None:
        await self.map(internal_port, 0, 0)
