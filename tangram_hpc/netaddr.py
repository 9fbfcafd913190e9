"""Which address a coordinator binds and which one it tells workers and clients to use.

``--host`` and ``--advertise-host`` take a host name, an IP address or a
network interface name (``ib0``, ``eth0``: its IPv4 address).  Bound to all
interfaces with nothing advertised, the coordinator advertises this host's
fully qualified name, unless that name resolves to a loopback address (a
common ``/etc/hosts`` default, useless to workers on other nodes): then the
address of the interface that routes off this host.
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

__all__ = ["interface_address", "resolve_host", "advertised_host", "is_loopback_name"]

_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` (None: no such interface, or it has none)."""
    if not name or len(name) > 15 or name not in {n for _, n in socket.if_nameindex()}:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def resolve_host(text: str) -> str:
    """A host as given, or the address of the interface it names."""
    if text in ("*", "0.0.0.0"):
        return text
    addr = interface_address(text)
    return addr if addr is not None else text


def is_loopback_name(host: str) -> bool:
    """Whether ``host`` (a name or an address) resolves to a loopback address only."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    addrs = {ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos}
    return bool(addrs) and all(a.is_loopback for a in addrs)


def _routed_address() -> str | None:
    """The local address of the interface that routes off this host (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))   # TEST-NET-1: only the routing table is consulted
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(addr).is_loopback else addr


def advertised_host(bind_host: str, advertise: str | None) -> tuple[str, str]:
    """The host to write into the connection file, and why that one."""
    if advertise:
        resolved = resolve_host(advertise)
        return resolved, ("--advertise-host" if resolved == advertise else f"interface {advertise}")
    if bind_host not in ("0.0.0.0", "*"):
        return bind_host, "the bound address"
    name = socket.getfqdn()
    if not is_loopback_name(name):
        return name, "this host's name"
    routed = _routed_address()
    if routed is not None:
        return routed, f"this host's name {name!r} is a loopback address; the routed interface's address instead"
    return name, (f"this host's name, though it is a loopback address: workers on other nodes cannot reach "
                  f"{name!r}; set --advertise-host")
