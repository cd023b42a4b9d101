"""Ports to hand to a process that binds them later (a worker's HTTP port, a NIXL side channel, vLLM's KV-event
sockets).

Asking the kernel for port 0 and closing the socket gives a port from the ephemeral range, which the kernel
hands out again to the next socket that binds port 0 or connects out. Between our pick and the child's bind,
another process's outgoing connection or its own bind to port 0 may take it: vLLM binds several internal ZMQ
sockets that way, and a second vLLM started beside the first then failed to bind the side channel we gave it
(ZMQError: Address already in use) and waited forever for its handshake listener. So ports are picked below
the ephemeral range (net.ipv4.ip_local_port_range), where the kernel never allocates on its own, and checked
free on every address (a wildcard bind fails while any address holds the port).
"""
from __future__ import annotations

import random
import socket

LOWEST = 10000  # below: well-known and registered services' ports
RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_range() -> tuple[int, int]:
    try:
        with open(RANGE_FILE) as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None, attempts: int = 200) -> int:
    """A TCP port no socket holds now, outside the kernel's ephemeral range; falls back to one the kernel
    picks when none is found (a machine whose ephemeral range leaves no room below it)."""
    rng = rng or random.SystemRandom()
    low, _ = ephemeral_range()
    if low - 1 > LOWEST:
        for _ in range(attempts):
            port = rng.randint(LOWEST, low - 1)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("", "0.0.0.0") else "127.0.0.1", 0))
        return s.getsockname()[1]
