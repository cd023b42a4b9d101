"""Per-request sampling settings (vLLM's names and meanings)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20  # top logprobs per position at most (OpenAI's limit)


@dataclass
class StructuredOutputSpec:
    """What the output must match: exactly one of json (a schema, or None with json_object for any JSON object),
    regex, choice or grammar (EBNF). `compiled` is set by the engine when it accepts the request."""

    json: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    compiled: Any = field(default=None, repr=False, compare=False)

    def kind(self) -> str:
        kinds = [k for k, v in (("json", self.json), ("json_object", self.json_object or None),
                                ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar))
                 if v is not None]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs must name exactly one of json, json_object, regex, choice, "
                             f"grammar; got {kinds or 'none'}")
        return kinds[0]


@dataclass
class SamplingParams:
    max_tokens: int = 16  # new tokens to generate at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    seed: int | None = None  # per-request generator seed, for reproducible sampling
    stop: list[str] = field(default_factory=list)  # stop strings; not in the output unless include_stop_str...
    stop_token_ids: list[int] = field(default_factory=list)  # extra token ids that end generation
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    n: int = 1  # choices from one prompt (the engine forks n sequences)
    presence_penalty: float = 0.0  # [-2, 2], subtracted once from every token already generated
    frequency_penalty: float = 0.0  # [-2, 2], subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # > 0; divides positive / multiplies negative logits of prompt+output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # top logprobs per sampled token (0: the sampled token's only)
    prompt_logprobs: int | None = None  # the same for each prompt token
    skip_special_tokens: bool = True
    structured_output: StructuredOutputSpec | None = None
    eos_token_ids: frozenset[int] = field(default=frozenset(), repr=False)  # set by the engine (min_tokens)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
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
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.structured_output is not None:
            self.structured_output.kind()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
