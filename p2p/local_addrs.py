"""The host's own IPv4 addresses, to turn a wildcard listener into addresses others can dial.

A listener bound to ``0.0.0.0`` accepts on every interface, but ``0.0.0.0`` itself reaches
nobody: advertising it (as the DHT and identify do with ``node.addrs``) sends peers nowhere.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct

logger = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of one interface


def local_ipv4_addrs() -> list[str]:
    """Every interface's IPv4 address, non-loopback ones first; ``["127.0.0.1"]`` at least."""
    found: list[str] = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError as e:
        logger.debug("cannot list interfaces: %s", e)
        names = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface (or it went away)
            ip = socket.inet_ntoa(answer[20:24])
            if ip not in found:
                found.append(ip)
    found.sort(key=lambda ip: ipaddress.ip_address(ip).is_loopback)
    return found or ["127.0.0.1"]
