"""Ports handed to child processes come from below the kernel's ephemeral range, so no socket that binds
port 0 or connects out (vLLM's internal ZMQ sockets did) can take one between our pick and the child's bind."""
from __future__ import annotations

import random
import socket

from disagg.worker import ports


def test_picked_ports_are_free_and_below_the_ephemeral_range():
    low, _ = ports.ephemeral_range()
    picked = {ports.free_port() for _ in range(50)}
    assert all(ports.LOWEST <= p < low for p in picked)
    for p in picked:  # free on every address: a child binding "*:port" succeeds
        with socket.socket() as s:
            s.bind(("", p))


def test_a_port_held_on_any_address_is_not_picked():
    held = socket.socket()
    held.bind(("127.0.0.2", ports.free_port()))  # another address than the one the caller names
    port = held.getsockname()[1]
    try:
        # the picker's first candidate is the held port: it moves on to another
        assert ports.free_port("127.0.0.1", rng=FixedThenRandom([port])) not in (port, None)
    finally:
        held.close()


def test_ephemeral_allocations_never_land_on_a_picked_port():
    picked = ports.free_port()
    clients = []
    try:
        for _ in range(200):  # the kernel's own port-0 allocations stay in the ephemeral range
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            clients.append(s)
            assert s.getsockname()[1] != picked
    finally:
        for s in clients:
            s.close()


class FixedThenRandom(random.Random):
    def __init__(self, first: list[int]):
        super().__init__(1)
        self.first = list(first)

    def randint(self, a: int, b: int) -> int:
        return self.first.pop(0) if self.first else super().randint(a, b)
