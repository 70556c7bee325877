"""The TCP addresses a process listens on, read from /proc (Linux): its socket inodes from /proc/PID/fd, matched to
the LISTEN rows of /proc/PID/net/tcp and tcp6."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

_LISTEN = "0A"


def _address(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    # The kernel prints each 32-bit word of the address in host order.
    words = b"".join(struct.pack("@I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as rows:
                next(rows)
                for row in rows:
                    fields = row.split()
                    if fields[3] == _LISTEN and fields[9] in inodes:
                        hex_ip, hex_port = fields[1].split(":")
                        found.append((_address(hex_ip), int(hex_port, 16)))
        except FileNotFoundError:
            continue
    return found


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def ipv4_of(name: str) -> str | None:
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            answer = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


def external_interface() -> str | None:
    """A network interface with an IPv4 address that is not loopback, if this machine has one."""
    return next((name for _, name in socket.if_nameindex()
                 if (address := ipv4_of(name)) is not None and not is_loopback(address)), None)
