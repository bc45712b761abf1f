"""A free local TCP port, for the servers, Ray heads and process groups the tests and benchmarks start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listened on a moment ago (the OS picks it; another process can take it
    before the caller binds it: a server that can listen on port 0 itself should, as harness.process_group does)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
