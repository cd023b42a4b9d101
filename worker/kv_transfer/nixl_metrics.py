"""Per-transfer NIXL statistics, accumulated by NixlTransport and drained once per engine step.

The keys mirror vLLM's NIXL connector metrics so the metrics layer can map them 1:1:
xfer_time_s -> vllm:nixl_xfer_time_seconds, bytes -> vllm:nixl_bytes_transferred,
num_descriptors -> vllm:nixl_num_descriptors, num_failed_transfers -> vllm:nixl_num_failed_transfers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class NixlTransferStats:
    xfer_time_s: list[float] = field(default_factory=list)  # post -> DONE seen by poll(), per transfer
    post_time_s: list[float] = field(default_factory=list)  # prep dlists + make + post, per transfer
    bytes: list[int] = field(default_factory=list)  # bytes moved, per successful transfer
    num_descriptors: list[int] = field(default_factory=list)  # coalesced runs, per successful transfer
    num_failed_transfers: int = 0

    def record_done(self, xfer_time_s: float, post_time_s: float, nbytes: int, num_descriptors: int) -> None:
        self.xfer_time_s.append(xfer_time_s)
        self.post_time_s.append(post_time_s)
        self.bytes.append(nbytes)
        self.num_descriptors.append(num_descriptors)

    def record_failed(self) -> None:
        self.num_failed_transfers += 1

    def is_empty(self) -> bool:
        return not self.xfer_time_s and self.num_failed_transfers == 0

    def drain(self) -> dict[str, Any]:
        """A plain dict (lists + counters) of everything since the last drain; resets."""
        out = {
            "xfer_time_s": self.xfer_time_s,
            "post_time_s": self.post_time_s,
            "bytes": self.bytes,
            "num_descriptors": self.num_descriptors,
            "num_failed_transfers": self.num_failed_transfers,
        }
        self.xfer_time_s, self.post_time_s, self.bytes, self.num_descriptors = [], [], [], []
        self.num_failed_transfers = 0
        return out


def merge_stats(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Combine two drained dicts (e.g. several steps, or several workers); None is empty."""
    if not a:
        return b
    if not b:
        return a
    return {k: a[k] + b[k] for k in a}
