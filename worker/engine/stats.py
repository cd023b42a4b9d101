"""What the engine counts for metrics: running totals (EngineStats), kept by the engine."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineStats:
    """Counters since start (for Prometheus)."""

    prompt_tokens: int = 0  # prompt tokens of requests that produced their first token
    generation_tokens: int = 0
    # per step; readers drain it (the server's loop into metrics, LLM.generate at each call)
    kv_connector_stats: list[dict[str, Any]] = field(default_factory=list)
