"""Per-transfer NIXL statistics, accumulated by NixlTransport and drained once per engine step, and the metrics
they feed (NIXL_METRICS, the NIXL connector's declaration): vLLM's NIXL metrics, names, types and buckets, and
the bytes every connector reports as loaded."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disagg.worker import metric_names as names
from disagg.worker.kv_transfer.base import ConnectorMetric, kv_bytes_loaded

XFER_TIME_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)  # seconds
BYTES_BUCKETS = tuple(float(2**k) for k in range(10, 34, 2))  # 1 KiB .. 8 GiB
DESCRIPTOR_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0, 4096.0)

NIXL_METRICS = (
    ConnectorMetric(names.NIXL_XFER_TIME, "histogram", "Transfer duration for NIXL KV cache transfers.",
                    "xfer_time_s", XFER_TIME_BUCKETS),
    ConnectorMetric(names.NIXL_POST_TIME, "histogram", "Transfer post time for NIXL KV cache transfers.",
                    "post_time_s", XFER_TIME_BUCKETS),
    ConnectorMetric(names.NIXL_BYTES, "histogram", "Number of bytes transferred per NIXL KV cache transfer.",
                    "bytes", BYTES_BUCKETS),
    ConnectorMetric(names.NIXL_DESCRIPTORS, "histogram", "Number of descriptors per NIXL KV cache transfer.",
                    "num_descriptors", DESCRIPTOR_BUCKETS),
    ConnectorMetric(names.NIXL_FAILED_TRANSFERS, "counter", "Number of failed NIXL KV cache transfers.",
                    "num_failed_transfers"),
    ConnectorMetric(names.NIXL_EXPIRED_REQS, "counter", "Requests whose KV blocks expired unread (lease).",
                    "num_kv_expired_reqs"),
    ConnectorMetric(names.KV_RELEASED_UNREAD, "counter", "Requests whose KV blocks were freed unread because "
                    "the router said no decode will pull them (its decode hop was refused).", "num_kv_released_reqs"),
    ConnectorMetric(names.KV_NOTIFICATIONS_REJECTED, "counter", "KV notifications ignored: not signed for the "
                    "NIXL agent that sent them (a stranger, or another reader's token).",
                    "num_notifications_rejected"),
    kv_bytes_loaded("bytes"),
)


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
