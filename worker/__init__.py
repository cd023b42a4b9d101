"""disagg worker: engine, model, KV transfer, HTTP server, router and local launcher."""
from __future__ import annotations

from typing import TYPE_CHECKING

from disagg.worker.sampling_params import SamplingParams

if TYPE_CHECKING:
    from disagg.worker.engine.llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):  # LLM imports torch; keep `import disagg.worker` light
    if name == "LLM":
        from disagg.worker.engine.llm import LLM

        return LLM
    raise AttributeError(name)
