"""Process A of the NIXL integration tests: owns a patterned KV tensor, serves the side channel,
polls notifications and prints them. Run as a script; also imported by the tests for the
shared spec and pattern.

stdout protocol (one line each, flushed):  READY <json metadata summary>  |  NOTIF <agent> <hex msg>
Exits when stdin closes, on "quit", or after --lifetime seconds, whichever comes first.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time

import torch

from disagg.worker.kv_transfer.base import KVCacheSpec


def make_spec(model_name: str = "tiny-model", num_blocks: int = 64, dtype: str = "float16",
              num_layers: int = 2, block_size: int = 4) -> KVCacheSpec:
    # bytes_per_block = layers * 2 * block_size * heads * head_dim * 2 = 512 with the defaults
    return KVCacheSpec(model_name=model_name, num_layers=num_layers, num_kv_heads=2, head_dim=8,
                       block_size=block_size, num_blocks=num_blocks, dtype=dtype)


def make_kv(spec: KVCacheSpec, seed: int | None) -> torch.Tensor:
    """Block-major KV tensor; seed=None -> zeros, else deterministic random bits."""
    shape = (spec.num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    kv = torch.zeros(shape, dtype=getattr(torch, spec.dtype))
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        kv.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g))
    return kv


class OwnerProcess:
    """Runs this file as a child process and collects its READY/NOTIF lines (test side)."""

    def __init__(self, engine_id: str, *extra_args: str, lifetime: float = 60.0):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--engine-id", engine_id, "--lifetime", str(lifetime),
             *extra_args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.notifs: list[tuple[str, bytes]] = []

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith(("READY", "NOTIF")):
                self._lines.put(line.rstrip("\n"))

    def wait_ready(self, timeout: float = 30.0) -> dict:
        line = self._lines.get(timeout=timeout)
        assert line.startswith("READY"), line
        return json.loads(line.split(" ", 1)[1])

    def wait_notifs(self, count: int, timeout: float = 5.0) -> list[tuple[str, bytes]]:
        deadline = time.monotonic() + timeout
        while len(self.notifs) < count and time.monotonic() < deadline:
            try:
                _, agent, msg = self._lines.get(timeout=max(0.0, deadline - time.monotonic())).split(" ")
            except queue.Empty:
                break
            self.notifs.append((agent, bytes.fromhex(msg)))
        return self.notifs

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream:
                stream.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--model-name", default="tiny-model")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lifetime", type=float, default=60.0)
    args = parser.parse_args()

    from disagg.worker.kv_transfer.nixl_transport import NixlTransport
    from disagg.worker.kv_transfer.side_channel import SideChannelServer

    spec = make_spec(args.model_name, args.num_blocks, args.dtype, args.num_layers)
    transport = NixlTransport(args.engine_id, spec, make_kv(spec, args.seed))
    transport.register()
    server = SideChannelServer(transport.local_metadata(), "127.0.0.1", 0)
    md = transport.local_metadata()
    print("READY", json.dumps({"port": server.port, "agent_name": md.agent_name}), flush=True)
    deadline = time.monotonic() + args.lifetime
    try:
        while time.monotonic() < deadline:
            for agent, msg in transport.get_new_notifs():
                print("NOTIF", agent, msg.hex(), flush=True)
            readable, _, _ = select.select([sys.stdin], [], [], 0.001)
            if readable:
                line = sys.stdin.readline()
                if not line or line.strip() == "quit":
                    break
    finally:
        server.close()
        transport.close()


if __name__ == "__main__":
    main()
