"""Port mapping messages (NAT-PMP, PCP, SSDP, HTTP, UPnP SOAP): pure encoders and decoders, and
garbage replies refused with PortMapError (never another exception)."""

from __future__ import annotations

import ipaddress
import random
import struct

import pytest

from p2p.nat.errors import PortMapError, PortMapRefused
from p2p.nat.natpmp import (
    decode_external_response,
    decode_map_response,
    default_gateway,
    encode_external_request,
    encode_map_request,
)
from p2p.nat.pcp import decode_map_response as decode_pcp_response
from p2p.nat.pcp import encode_map_request as encode_pcp_request
from p2p.nat.portmap import PortMapConfig, PortMapping
from p2p.nat.upnp import (
    IGDService,
    encode_http_request,
    encode_msearch,
    encode_soap,
    fault_code,
    parse_description,
    parse_http_response,
    parse_soap_response,
    parse_ssdp_response,
)

WANIP1 = "urn:schemas-upnp-org:service:WANIPConnection:1"


def test_natpmp_requests_have_the_rfc_layout() -> None:
    assert encode_external_request() == b"\x00\x00"
    req = encode_map_request(4001, 4001, 3600)
    assert len(req) == 12 and struct.unpack("!BBHHHI", req) == (0, 2, 0, 4001, 4001, 3600)
    assert encode_map_request(4001, 0, 0)[-6:] == b"\x00\x00\x00\x00\x00\x00"  # delete
    with pytest.raises(ValueError):
        encode_map_request(0, 1, 1)
    with pytest.raises(ValueError):
        encode_map_request(1, 1, 1 << 32)


def test_natpmp_replies_decode_and_refusals_name_the_reason() -> None:
    ext = decode_external_response(
        bytes([0, 128, 0, 0]) + struct.pack("!I", 7) + bytes([5, 6, 7, 8])
    )
    assert ext.address == "5.6.7.8" and ext.epoch == 7
    ok = struct.pack("!BBHIHHI", 0, 130, 0, 9, 4001, 40001, 1800)
    m = decode_map_response(ok, 4001)
    assert (m.external_port, m.lifetime, m.epoch) == (40001, 1800, 9)
    with pytest.raises(PortMapError, match="asked for 4002"):
        decode_map_response(ok, 4002)  # a reply for another port
    refused = struct.pack("!BBHIHHI", 0, 130, 2, 9, 4001, 0, 0)
    with pytest.raises(PortMapRefused, match="not authorized"):
        decode_map_response(refused, 4001)
    with pytest.raises(PortMapError, match="version 1"):
        decode_map_response(b"\x01" + ok[1:], 4001)
    with pytest.raises(PortMapError, match="opcode"):
        decode_map_response(struct.pack("!BBHIHHI", 0, 129, 0, 9, 4001, 1, 1), 4001)
    with pytest.raises(PortMapError, match="external port 0"):
        decode_map_response(struct.pack("!BBHIHHI", 0, 130, 0, 9, 4001, 0, 60), 4001)


def test_natpmp_garbage_is_refused_cleanly() -> None:
    rng = random.Random(5)
    for _ in range(3000):
        data = rng.randbytes(rng.choice([0, 1, 2, 11, 12, 13, 15, 16, 17, 40]))
        if rng.random() < 0.5 and len(data) >= 2:
            data = bytes([0, rng.choice([128, 130])]) + data[2:]
        for decode in (decode_external_response, lambda d: decode_map_response(d, 4001)):
            try:
                decode(data)
            except PortMapError:
                pass


def test_default_gateway_from_the_route_table() -> None:
    table = (
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\n"
        "eth0\t0001A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"
        "eth0\t00000000\t0101A8C0\t0003\t0\t0\t0\t00000000\n"
    )
    assert default_gateway(table) == "192.168.1.1"
    assert default_gateway(table.splitlines()[0] + "\n") is None
    assert default_gateway("x\n00000000 zz\n") is None


SSDP_OK = (
    b"HTTP/1.1 200 OK\r\nCACHE-CONTROL: max-age=120\r\n"
    b"ST: urn:schemas-upnp-org:device:InternetGatewayDevice:1\r\n"
    b"LOCATION: http://10.0.0.1:5000/rootDesc.xml\r\n\r\n"
)


def test_ssdp() -> None:
    assert b"M-SEARCH * HTTP/1.1" in encode_msearch() and b"ssdp:discover" in encode_msearch()
    assert parse_ssdp_response(SSDP_OK) == "http://10.0.0.1:5000/rootDesc.xml"
    for bad in (
        b"",
        b"NOTIFY * HTTP/1.1\r\n\r\n",
        SSDP_OK.replace(b"200", b"404"),
        SSDP_OK.replace(b"LOCATION", b"X-LOC"),
        SSDP_OK.replace(b"http://", b"file://"),
        SSDP_OK.replace(b"http://10.0.0.1:5000", b"http://10.0.0.1:99999"),
        SSDP_OK + b"\xff",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        SSDP_OK + b"x" * 3000,
    ):
        with pytest.raises(PortMapError):
            parse_ssdp_response(bad)


def test_http_framing() -> None:
    req = encode_http_request("POST", "http://10.0.0.1:5000/ctl", {"SOAPAction": '"a#b"'}, b"xyz")
    assert req.startswith(b"POST /ctl HTTP/1.1\r\nHost: 10.0.0.1:5000\r\n")
    assert b"Content-Length: 3\r\n\r\nxyz" in req
    status, headers, body = parse_http_response(
        b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nbodyEXTRA"
    )
    assert (status, body, headers["content-length"]) == (200, b"body", "4")
    chunked = (
        b"HTTP/1.1 500 X\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n"
    )
    assert parse_http_response(chunked)[::2] == (500, b"abcde")
    for bad in (
        b"HTTP/1.1 200 OK\r\n",
        b"SSH-2.0\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab\r\n",
    ):
        with pytest.raises(PortMapError):
            parse_http_response(bad)


DESCRIPTION = f"""<?xml version="1.0"?>
<root xmlns="urn:schemas-upnp-org:device-1-0"><device><deviceList><device><deviceList><device>
<serviceList>
<service><serviceType>urn:schemas-upnp-org:service:WANCommonInterfaceConfig:1</serviceType>
<controlURL>/ctl/CmnIfCfg</controlURL></service>
<service><serviceType>{WANIP1}</serviceType><controlURL>/ctl/IPConn</controlURL></service>
</serviceList></device></deviceList></device></deviceList></device></root>""".encode()


def test_device_description() -> None:
    svc = parse_description(DESCRIPTION, "http://10.0.0.1:5000/rootDesc.xml")
    assert svc == IGDService(WANIP1, "http://10.0.0.1:5000/ctl/IPConn")
    with_base = DESCRIPTION.replace(
        b"<device>", b"<URLBase>http://10.0.0.9:80/</URLBase><device>", 1
    )
    assert parse_description(with_base, "http://x/").control_url == "http://10.0.0.9:80/ctl/IPConn"
    with pytest.raises(PortMapError, match="no WANIPConnection"):
        parse_description(DESCRIPTION.replace(WANIP1.encode(), b"urn:other"), "http://x/")
    with pytest.raises(PortMapError, match="DOCTYPE"):
        bomb = b'<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaa">]><root>&a;</root>'
        parse_description(bomb, "http://x/")
    with pytest.raises(PortMapError, match="malformed XML"):
        parse_description(DESCRIPTION[:-20], "http://x/")


def _envelope(inner: str) -> bytes:
    return (
        '<?xml version="1.0"?><s:Envelope xmlns:s="http://schemas.xmlsoap.org/soap/envelope/">'
        f"<s:Body>{inner}</s:Body></s:Envelope>"
    ).encode()


def test_soap_calls_replies_and_faults() -> None:
    req = encode_soap(WANIP1, "AddPortMapping", [("NewPortMappingDescription", "<a&b>")])
    assert b"<u:AddPortMapping" in req and b"&lt;a&amp;b&gt;" in req  # arguments escaped
    ok = _envelope(
        f'<u:GetExternalIPAddressResponse xmlns:u="{WANIP1}">'
        "<NewExternalIPAddress>5.6.7.8</NewExternalIPAddress></u:GetExternalIPAddressResponse>"
    )
    assert parse_soap_response(ok, "GetExternalIPAddress") == {"NewExternalIPAddress": "5.6.7.8"}
    with pytest.raises(PortMapError, match="to AddPortMapping"):
        parse_soap_response(ok, "AddPortMapping")
    fault = _envelope(
        "<s:Fault><faultcode>s:Client</faultcode><faultstring>UPnPError</faultstring><detail>"
        '<UPnPError xmlns="urn:schemas-upnp-org:control-1-0"><errorCode>718</errorCode>'
        "<errorDescription>ConflictInMappingEntry</errorDescription></UPnPError></detail>"
        "</s:Fault>"
    )
    with pytest.raises(PortMapRefused, match="718 ConflictInMappingEntry") as info:
        parse_soap_response(fault, "AddPortMapping")
    assert fault_code(info.value) == 718
    for bad in (b"", b"<x/>", _envelope(""), _envelope("<a/><b/>"), b"\xff\xfe<", b"<a>" * 5):
        with pytest.raises(PortMapError):
            parse_soap_response(bad, "AddPortMapping")


def test_config_and_mapping_address() -> None:
    with pytest.raises(ValueError):
        PortMapConfig(protocols=("stun",))
    with pytest.raises(ValueError):
        PortMapConfig(lease=0)
    m = PortMapping("upnp", "5.6.7.8", 40001, 4001, 3600)
    assert str(m.addr) == "/ip4/5.6.7.8/tcp/40001"


NONCE = bytes(range(12))


def _pcp_reply(result=0, nonce=NONCE, internal=4001, external=40001, lifetime=600, ext="5.6.7.8"):
    header = struct.pack("!BBxBII12x", 2, 0x81, result, lifetime, 7)
    addr = ipaddress.IPv6Address(f"::ffff:{ext}").packed
    return header + struct.pack("!12sB3xHH16s", nonce, 6, internal, external, addr)


def test_pcp_map_request_and_response() -> None:
    req = encode_pcp_request("192.168.1.20", NONCE, 4001, 4001, 600)
    assert len(req) == 60 and req[:2] == b"\x02\x01" and struct.unpack_from("!I", req, 4) == (600,)
    assert req[8:24] == ipaddress.IPv6Address("::ffff:192.168.1.20").packed
    assert (
        req[24:36] == NONCE and req[36] == 6 and struct.unpack_from("!HH", req, 40) == (4001, 4001)
    )
    got = decode_pcp_response(_pcp_reply(), NONCE, 4001)
    assert (got.external_address, got.external_port, got.lifetime) == ("5.6.7.8", 40001, 600)
    with pytest.raises(PortMapRefused, match="not authorized"):
        decode_pcp_response(_pcp_reply(result=2), NONCE, 4001)
    with pytest.raises(PortMapRefused, match="speaks NAT-PMP"):
        decode_pcp_response(struct.pack("!BBHI", 0, 129, 1, 0), NONCE, 4001)
    with pytest.raises(PortMapRefused, match="speaks PCP"):  # and the other way round
        decode_map_response(_pcp_reply()[:16], 4001)
    for bad, why in (
        (_pcp_reply(nonce=bytes(12)), "nonce"),
        (_pcp_reply(internal=4002), "port 4002"),
        (_pcp_reply(external=0), "external port 0"),
        (_pcp_reply()[:56], "56 bytes"),
        (b"\x01" + _pcp_reply()[1:], "version 1"),
    ):
        with pytest.raises(PortMapError, match=why):
            decode_pcp_response(bad, NONCE, 4001)
    with pytest.raises(PortMapError, match="non-IPv4"):
        decode_pcp_response(_pcp_reply()[:44] + bytes(16), NONCE, 4001)


def test_pcp_garbage_is_refused_cleanly() -> None:
    rng = random.Random(6)
    good = _pcp_reply()
    for _ in range(3000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(len(data) + 1)]
        try:
            decode_pcp_response(bytes(data), NONCE, 4001)
        except PortMapError:
            pass
