"""SamplingParams, as vLLM has them, with their checks."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to sample one request's continuation(s); invalid values raise ValueError with a clear message."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1 (disable) or at least 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (0.0 < self.repetition_penalty <= 2.0, f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be ids >= 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.n > 1:
            raise ValueError("n > 1 (parallel sampling) is not supported yet")

    @property
    def greedy(self) -> bool:
        """Temperature 0 means argmax."""
        return self.temperature < 1e-5
