"""The TCP sockets a process tree listens on, read from /proc: what a port scan of the machine would find open."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from ringmaster.service.process_tree import ProcessTree

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


@dataclass(frozen=True)
class ListeningSocket:
    host: str  # as the kernel holds it: 0.0.0.0 or :: mean every interface
    port: int
    pid: int
    command: str

    @property
    def loopback_only(self) -> bool:
        address = ipaddress.ip_address(self.host)
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            return address.ipv4_mapped.is_loopback  # ::ffff:127.0.0.1, where an IPv6 socket took an IPv4 address
        return address.is_loopback


def listening_sockets(root: int) -> list[ListeningSocket]:
    """Every TCP socket (IPv4 and IPv6) in LISTEN state held by a process of root's tree (the processes Ray starts in
    sessions of their own included)."""
    listening = _listening_by_inode()
    found = []
    for pid in sorted(ProcessTree(root).look()):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            descriptors = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # ended meanwhile
        for descriptor in descriptors:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{descriptor}")
            except OSError:
                continue
            if target.startswith("socket:[") and (address := listening.get(int(target[8:-1]))) is not None:
                found.append(ListeningSocket(address[0], address[1], pid, command))
    return found


def _listening_by_inode() -> dict[int, tuple[str, int]]:
    sockets = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != _LISTEN:
                continue
            host_hex, port_hex = fields[1].split(":")
            sockets[int(fields[9])] = (_host(bytes.fromhex(host_hex), width), int(port_hex, 16))
    return sockets


def _host(raw: bytes, width: int) -> str:
    """/proc/net's address: 32-bit words in host (little-endian) byte order."""
    assert len(raw) == width
    ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
    return str(ipaddress.ip_address(ordered))
