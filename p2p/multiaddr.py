"""Multiaddr-style addresses: ``/ip4/127.0.0.1/tcp/4001/p2p/<peer-id>``.

Only the text form is used (we never put binary multiaddrs on the wire). Supported protocols:
``ip4``, ``ip6``, ``dns``/``dns4``/``dns6``, ``tcp``, ``sim`` (a host of the in-memory simulated
network), ``p2p`` (a peer ID) and ``p2p-circuit`` (a relayed hop, no value).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from p2p.errors import IdentityError, MultiaddrError
from p2p.identity import PeerID

_WITH_VALUE = {"ip4", "ip6", "dns", "dns4", "dns6", "tcp", "sim", "p2p"}
_WITHOUT_VALUE = {"p2p-circuit"}
_HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6", "sim")


def _check_value(proto: str, value: str) -> str:
    if proto == "ip4":
        try:
            return str(ipaddress.IPv4Address(value))
        except ValueError:
            raise MultiaddrError(f"invalid IPv4 address {value!r}") from None
    if proto == "ip6":
        try:
            return str(ipaddress.IPv6Address(value))
        except ValueError:
            raise MultiaddrError(f"invalid IPv6 address {value!r}") from None
    if proto == "tcp":
        # isascii(): str.isdigit() also accepts digits like '²' that int() rejects.
        if not (value.isascii() and value.isdigit()) or not 0 <= int(value) <= 65535:
            raise MultiaddrError(f"invalid TCP port {value!r}")
        return str(int(value))
    if proto == "p2p":
        try:
            PeerID.from_base58(value)
        except IdentityError as e:
            raise MultiaddrError(str(e)) from None
        return value
    if not value or any(c.isspace() for c in value):
        raise MultiaddrError(f"invalid {proto} value {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Multiaddr:
    """An immutable, hashable address made of ``(protocol, value)`` components."""

    components: tuple[tuple[str, str | None], ...]

    @classmethod
    def parse(cls, text: str | Multiaddr) -> Multiaddr:
        if isinstance(text, Multiaddr):
            return text
        if not isinstance(text, str):
            raise MultiaddrError(f"a multiaddr is text, got {type(text).__name__}")
        if not text.startswith("/"):
            raise MultiaddrError(f"a multiaddr starts with '/': {text!r:.200}")
        parts = text.split("/")[1:]
        if text.endswith("/"):
            parts = parts[:-1]
        comps: list[tuple[str, str | None]] = []
        i = 0
        while i < len(parts):
            proto = parts[i]
            if proto in _WITHOUT_VALUE:
                comps.append((proto, None))
                i += 1
            elif proto in _WITH_VALUE:
                if i + 1 >= len(parts):
                    raise MultiaddrError(f"protocol {proto!r} needs a value in {text!r:.200}")
                comps.append((proto, _check_value(proto, parts[i + 1])))
                i += 2
            else:
                raise MultiaddrError(f"unknown protocol {proto!r} in {text!r:.200}")
        if not comps:
            raise MultiaddrError("empty multiaddr")
        return cls(tuple(comps))

    @classmethod
    def from_components(cls, comps: Iterable[tuple[str, str | None]]) -> Multiaddr:
        return cls.parse("".join(f"/{p}" + (f"/{v}" if v is not None else "") for p, v in comps))

    def __str__(self) -> str:
        return "".join(f"/{p}" + (f"/{v}" if v is not None else "") for p, v in self.components)

    def __repr__(self) -> str:
        return f"Multiaddr({str(self)!r})"

    def value_of(self, proto: str) -> str | None:
        """The value of the first component named ``proto``, or None."""
        for p, v in self.components:
            if p == proto:
                return v
        return None

    @property
    def is_relayed(self) -> bool:
        return any(p == "p2p-circuit" for p, _ in self.components)

    @property
    def peer_id(self) -> PeerID | None:
        """The target peer: the last ``/p2p/`` component (after any circuit hop)."""
        last = None
        for p, v in self.components:
            if p == "p2p":
                last = v
        return PeerID.from_base58(last) if last is not None else None

    @property
    def host(self) -> str | None:
        for p, v in self.components:
            if p in _HOST_PROTOCOLS:
                return v
        return None

    @property
    def port(self) -> int | None:
        v = self.value_of("tcp")
        return int(v) if v is not None else None

    def transport_part(self) -> Multiaddr:
        """The address without its ``/p2p/...`` suffix (what a transport dials)."""
        comps = []
        for p, v in self.components:
            if p in ("p2p", "p2p-circuit"):
                break
            comps.append((p, v))
        if not comps:
            raise MultiaddrError(f"{self} has no transport part")
        return Multiaddr(tuple(comps))

    def with_peer(self, peer_id: PeerID) -> Multiaddr:
        """This address with ``/p2p/<peer_id>`` appended (replacing a trailing one)."""
        comps = list(self.components)
        if comps and comps[-1][0] == "p2p":
            comps.pop()
        comps.append(("p2p", peer_id.to_base58()))
        return Multiaddr(tuple(comps))

    def relay_parts(self) -> tuple[Multiaddr, PeerID] | None:
        """For ``RELAY_ADDR/p2p-circuit/p2p/TARGET``: (relay's full address, target ID)."""
        for i, (p, _) in enumerate(self.components):
            if p == "p2p-circuit":
                relay = Multiaddr(self.components[:i])
                rest = Multiaddr(self.components[i + 1 :]) if i + 1 < len(self.components) else None
                target = rest.peer_id if rest is not None else None
                if relay.peer_id is None or target is None:
                    raise MultiaddrError(f"a relayed address needs both peer IDs: {self}")
                return relay, target
        return None
