"""UPnP IGD: find the home router's port-mapping service and ask it for a TCP port.

Protocol:

1. **Discovery** (SSDP): an HTTP-over-UDP ``M-SEARCH`` for
   ``urn:schemas-upnp-org:device:InternetGatewayDevice:1`` goes to 239.255.255.250:1900 (and
   to the default gateway directly, for routers that answer only unicast); the answer's
   ``LOCATION`` header is the URL of the device description.
2. **Description**: an HTTP GET of that URL returns XML listing services; we take the first
   ``WANIPConnection`` (v2, then v1) or ``WANPPPConnection:1`` and its ``controlURL``.
3. **Control** (SOAP over HTTP POST to the control URL): ``GetExternalIPAddress``,
   ``AddPortMapping`` (external port, TCP, internal port and client, lease seconds),
   ``DeletePortMapping``. A refusal is a SOAP fault with a UPnP error code (e.g. 718: the
   external port is taken, 725: only permanent leases).

Everything that builds or parses a message is a pure function here; replies are bounded in
size, must be well-formed, and XML with a DOCTYPE (entity expansion) is refused. We only fetch
from the device that answered the search (its LOCATION and control URL must name its address),
so a LAN host cannot make us send requests to a third party.
"""

from __future__ import annotations

import logging
import socket
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit
from xml.sax.saxutils import escape

import trio

from p2p.nat.errors import PortMapError, PortMapRefused

logger = logging.getLogger(__name__)

SSDP_ADDR = ("239.255.255.250", 1900)
IGD = "urn:schemas-upnp-org:device:InternetGatewayDevice:1"
SERVICES = (
    "urn:schemas-upnp-org:service:WANIPConnection:2",
    "urn:schemas-upnp-org:service:WANIPConnection:1",
    "urn:schemas-upnp-org:service:WANPPPConnection:1",
)
MAX_DATAGRAM = 2048
MAX_HTTP = 128 * 1024
SOAP_ENV = "http://schemas.xmlsoap.org/soap/envelope/"


# ---- SSDP -------------------------------------------------------------------------------
def encode_msearch(search_target: str = IGD, wait: int = 2) -> bytes:
    return (
        "M-SEARCH * HTTP/1.1\r\n"
        f"HOST: {SSDP_ADDR[0]}:{SSDP_ADDR[1]}\r\n"
        'MAN: "ssdp:discover"\r\n'
        f"MX: {wait}\r\n"
        f"ST: {search_target}\r\n\r\n"
    ).encode()


def _headers(lines: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise PortMapError(f"malformed header line {line[:60]!r}")
        out[name.strip().lower()] = value.strip()
    return out


def parse_ssdp_response(data: bytes) -> str:
    """The description URL (``LOCATION``) of an SSDP answer; PortMapError on anything else."""
    if len(data) > MAX_DATAGRAM:
        raise PortMapError("SSDP answer too large")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise PortMapError("SSDP answer is not ASCII") from None
    lines = text.split("\r\n")
    status = lines[0].split(" ", 2)
    if len(status) < 2 or not status[0].startswith("HTTP/1.") or status[1] != "200":
        raise PortMapError(f"not an SSDP answer: {lines[0][:60]!r}")
    headers = _headers([line for line in lines[1:] if line])
    location = headers.get("location")
    if not location:
        raise PortMapError("SSDP answer without LOCATION")
    check_http_url(location)
    return location


def check_http_url(url: str) -> tuple[str, int, str]:
    """(host, port, path) of a plain ``http://host[:port]/path`` URL, else PortMapError."""
    try:
        parts = urlsplit(url)
        port = parts.port or 80
    except ValueError:
        raise PortMapError(f"malformed URL {url[:80]!r}") from None
    if parts.scheme != "http" or not parts.hostname or len(url) > 1024:
        raise PortMapError(f"not an http URL: {url[:80]!r}")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return parts.hostname, port, path


# ---- HTTP -------------------------------------------------------------------------------
def encode_http_request(
    method: str, url: str, headers: dict[str, str] | None = None, body: bytes = b""
) -> bytes:
    host, port, path = check_http_url(url)
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def parse_http_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of a whole response read to EOF (chunked bodies decoded)."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        raise PortMapError("truncated HTTP response")
    try:
        lines = head.decode("latin-1").split("\r\n")
        version, code, *_ = lines[0].split(" ", 2)
        status = int(code)
    except ValueError:
        raise PortMapError("malformed HTTP status line") from None
    if not version.startswith("HTTP/1."):
        raise PortMapError(f"not an HTTP response: {lines[0][:60]!r}")
    headers = _headers(lines[1:])
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = _dechunk(body)
    elif "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError:
            raise PortMapError("malformed Content-Length") from None
        if length < 0 or len(body) < length:
            raise PortMapError("truncated HTTP body")
        body = body[:length]
    return status, headers, body


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while True:
        size_line, sep, rest = data.partition(b"\r\n")
        if not sep:
            raise PortMapError("truncated chunked body")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            raise PortMapError("malformed chunk size") from None
        if size < 0 or len(rest) < size + 2 or rest[size : size + 2] != b"\r\n":
            raise PortMapError("truncated or malformed chunk")
        if size == 0:
            return bytes(out)
        out += rest[:size]
        data = rest[size + 2 :]


# ---- XML --------------------------------------------------------------------------------
def _parse_xml(body: bytes) -> ET.Element:
    if len(body) > MAX_HTTP:
        raise PortMapError("XML document too large")
    if b"<!DOCTYPE" in body.upper() or b"<!ENTITY" in body.upper():
        raise PortMapError("XML with a DOCTYPE refused")
    try:
        return ET.fromstring(body)
    except ET.ParseError as e:
        raise PortMapError(f"malformed XML: {e}") from None


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


@dataclass(frozen=True)
class IGDService:
    service_type: str
    control_url: str


def parse_description(body: bytes, location: str) -> IGDService:
    """The WAN connection service of a device description (best version first)."""
    root = _parse_xml(body)
    base = location
    found: dict[str, str] = {}
    for el in root.iter():
        name = _local(el.tag)
        if name == "URLBase" and el.text and el.text.strip():
            base = el.text.strip()
        elif name == "service":
            fields = {_local(c.tag): (c.text or "").strip() for c in el}
            stype, control = fields.get("serviceType", ""), fields.get("controlURL", "")
            if stype in SERVICES and control and stype not in found:
                found[stype] = control
    for stype in SERVICES:
        if stype in found:
            url = urljoin(base, found[stype])
            check_http_url(url)
            return IGDService(stype, url)
    raise PortMapError("the device offers no WANIPConnection or WANPPPConnection service")


def encode_soap(service_type: str, action: str, args: list[tuple[str, str]]) -> bytes:
    inner = "".join(f"<{k}>{escape(v)}</{k}>" for k, v in args)
    return (
        '<?xml version="1.0"?>'
        f'<s:Envelope xmlns:s="{SOAP_ENV}" s:encodingStyle="http://schemas.xmlsoap.org/soap/encoding/">'
        f'<s:Body><u:{action} xmlns:u="{escape(service_type)}">{inner}</u:{action}>'
        "</s:Body></s:Envelope>"
    ).encode()


def parse_soap_response(body: bytes, action: str) -> dict[str, str]:
    """The out-arguments of ``action``'s response; a fault raises PortMapRefused(code, text)."""
    root = _parse_xml(body)
    if _local(root.tag) != "Envelope":
        raise PortMapError("SOAP reply without an Envelope")
    bodies = [c for c in root if _local(c.tag) == "Body"]
    if len(bodies) != 1 or len(bodies[0]) != 1:
        raise PortMapError("SOAP reply without exactly one Body element")
    reply = bodies[0][0]
    if _local(reply.tag) == "Fault":
        code = desc = ""
        for el in reply.iter():
            if _local(el.tag) == "errorCode":
                code = (el.text or "").strip()
            elif _local(el.tag) == "errorDescription":
                desc = (el.text or "").strip()
        raise PortMapRefused(f"UPnP {action} refused: error {code[:8]} {desc[:100]}".rstrip())
    if _local(reply.tag) != action + "Response":
        raise PortMapError(f"SOAP reply {_local(reply.tag)[:60]!r} to {action}")
    return {_local(c.tag): (c.text or "").strip() for c in reply}


def fault_code(error: PortMapRefused) -> int | None:
    """The UPnP error code named in a refusal, if any."""
    words = str(error).split()
    try:
        return int(words[words.index("error") + 1])
    except (ValueError, IndexError):
        return None


# ---- I/O --------------------------------------------------------------------------------
async def http_exchange(url: str, request: bytes, timeout: float) -> tuple[int, bytes]:
    host, port, _ = check_http_url(url)
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            await stream.send_all(request)
            data = bytearray()
            while chunk := await stream.receive_some(65536):
                data += chunk
                if len(data) > MAX_HTTP:
                    raise PortMapError(f"HTTP reply from {host} larger than {MAX_HTTP} bytes")
    status, _, body = parse_http_response(bytes(data))
    return status, body


async def discover(gateway: str | None, timeout: float = 2.0) -> str:
    """The description URL of the first IGD that answers an M-SEARCH within ``timeout``."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with sock:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 2)
        await sock.bind(("0.0.0.0", 0))
        request = encode_msearch()
        targets = [SSDP_ADDR] + ([(gateway, SSDP_ADDR[1])] if gateway else [])
        sent = 0
        with trio.move_on_after(timeout):
            for target in targets:
                try:
                    await sock.sendto(request, target)
                    sent += 1
                except OSError as e:  # no multicast route, say
                    logger.debug("M-SEARCH to %s failed: %s", target, e)
            if not sent:
                raise PortMapError("M-SEARCH could not be sent (no route)")
            while True:
                data, sender = await sock.recvfrom(MAX_DATAGRAM + 1)
                try:
                    location = parse_ssdp_response(data)
                    if check_http_url(location)[0] != sender[0]:
                        # we fetch what it names: only from the device that answered
                        raise PortMapError(f"LOCATION names another host than {sender[0]}")
                    return location
                except PortMapError as e:
                    logger.debug("ignoring an SSDP answer from %s: %s", sender, e)
    raise PortMapError("no UPnP gateway answered")


class UPnPClient:
    """One IGD's WAN connection service."""

    def __init__(self, service: IGDService, *, timeout: float = 5.0) -> None:
        self.service = service
        self.timeout = timeout

    @classmethod
    async def find(
        cls, gateway: str | None, *, timeout: float = 2.0, request_timeout: float = 5.0
    ) -> UPnPClient:
        """The IGD that answers discovery within ``timeout``; its calls then take up to
        ``request_timeout`` each."""
        location = await discover(gateway, timeout)
        status, body = await http_exchange(location, encode_http_request("GET", location), timeout)
        if status != 200:
            raise PortMapError(f"UPnP description at {location} answered HTTP {status}")
        service = parse_description(body, location)
        if check_http_url(service.control_url)[0] != check_http_url(location)[0]:
            raise PortMapError("the control URL names another host than the device")
        return cls(service, timeout=request_timeout)

    @property
    def host(self) -> str:
        return check_http_url(self.service.control_url)[0]

    async def call(self, action: str, args: list[tuple[str, str]]) -> dict[str, str]:
        body = encode_soap(self.service.service_type, action, args)
        headers = {
            "Content-Type": 'text/xml; charset="utf-8"',
            "SOAPAction": f'"{self.service.service_type}#{action}"',
        }
        request = encode_http_request("POST", self.service.control_url, headers, body)
        _, reply = await http_exchange(self.service.control_url, request, self.timeout)
        return parse_soap_response(reply, action)  # a fault comes with HTTP 500: parse anyway

    async def external_ip(self) -> str:
        out = await self.call("GetExternalIPAddress", [])
        address = out.get("NewExternalIPAddress", "")
        try:
            socket.inet_aton(address)
        except OSError:
            raise PortMapError(f"UPnP gave no external address ({address[:40]!r})") from None
        return address

    async def add_port_mapping(
        self, external_port: int, internal_port: int, client: str, lease: int, description: str
    ) -> None:
        await self.call(
            "AddPortMapping",
            [
                ("NewRemoteHost", ""),
                ("NewExternalPort", str(external_port)),
                ("NewProtocol", "TCP"),
                ("NewInternalPort", str(internal_port)),
                ("NewInternalClient", client),
                ("NewEnabled", "1"),
                ("NewPortMappingDescription", description),
                ("NewLeaseDuration", str(lease)),
            ],
        )

    async def delete_port_mapping(self, external_port: int) -> None:
        await self.call(
            "DeletePortMapping",
            [
                ("NewRemoteHost", ""),
                ("NewExternalPort", str(external_port)),
                ("NewProtocol", "TCP"),
            ],
        )
