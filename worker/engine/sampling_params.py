"""Per-request sampling settings (vLLM's names and meanings)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 16  # new tokens to generate at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]
    top_k: int = 0  # 0 or -1 = disabled
    seed: int | None = None  # per-request generator seed, for reproducible sampling
    stop: list[str] = field(default_factory=list)  # stop strings; not included in the output text
    stop_token_ids: list[int] = field(default_factory=list)  # extra token ids that end generation
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
