"""What the hostile-input tests send: completions, a prefill worker's hand-off, and a NIXL agent of their own."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from waiting import wait_for

from disagg.worker.ports import free_port

MODEL = "tiny-llama"
REPO = Path(__file__).resolve().parents[2]


def complete(url: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, timeout=60, **kw)


def kv_params(prefill: str, prompt_ids: list[int]) -> dict[str, Any]:
    """A prefill worker's hand-off for `prompt_ids` (its blocks now wait for a reader, until the lease ends)."""
    r = complete(prefill, {"prompt": prompt_ids, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["disagg_signature"].startswith("v1:"), params  # a worker with a key signs what it hands out
    return params


@contextlib.contextmanager
def disagg_up(tmp: Path, doc: dict[str, Any], *flags: str) -> Iterator[tuple[int, Callable[[], str]]]:
    """`disagg up -f` the spec `doc` with `flags`, until it serves and has answered its own first request: yields
    the router's port and a reader of its output; SIGTERM after, which must end it cleanly."""
    from serving_fleet import CLI

    (tmp / "spec.yaml").write_text(yaml.safe_dump(doc))
    port = free_port()
    out = (tmp / "up.out").open("w")
    launcher = subprocess.Popen([*CLI, "up", "-f", str(tmp / "spec.yaml"), "--port", str(port), *flags, "--log-dir",
                                 str(tmp / "logs"), "--worker-arg=--num-kv-blocks=128"], stdout=out,
                                stderr=subprocess.STDOUT, cwd=REPO)
    text = lambda: (tmp / "up.out").read_text()  # noqa: E731
    try:
        # serving, and the launcher's own first request answered ("  -> ...")
        wait_for(lambda: "  -> " in text() or launcher.poll() is not None, 180, "disagg up to serve", 0.1)
        assert launcher.poll() is None, text()
        yield port, text
    finally:
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 0
        out.close()


class StrangerAgent:
    """A NIXL agent in the test process that loads a prefill engine's agent and sends it notifications, as a peer
    that got the metadata (here with the resource's token) but was handed no KV would."""

    def __init__(self, host: str, port: int, signer: Any, name: str = "stranger"):
        import torch

        from disagg.worker.kv_transfer.base import KVCacheSpec
        from disagg.worker.kv_transfer.nixl_transport import NixlTransport
        from disagg.worker.kv_transfer.side_channel import fetch_engine_metadata

        md = fetch_engine_metadata(host, port, 5.0, signer, name)
        c = md.compat
        spec = KVCacheSpec(c["model_name"], c["num_layers"], c["num_kv_heads"], c["head_dim"], c["block_size"], 2,
                           c["dtype"])
        kv = torch.zeros((2, c["num_layers"], 2, c["block_size"], c["num_kv_heads"], c["head_dim"]),
                         dtype=getattr(torch, c["dtype"]))
        self.transport = NixlTransport(name, spec, kv)
        self.transport.register()
        self.transport.add_peer(md)
        self.peer = md.engine_id

    def notify(self, msg: bytes, timeout_s: float = 10.0) -> None:
        from disagg.worker.kv_transfer.nixl_transport import TransferState

        handle = self.transport.notify(self.peer, msg)
        deadline = time.monotonic() + timeout_s
        while self.transport.poll(handle) is TransferState.PROC:
            assert time.monotonic() < deadline, "the stranger's notification did not go out"
            time.sleep(0.01)

    def __enter__(self) -> StrangerAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.transport.close()
