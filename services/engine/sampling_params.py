"""Per-request sampling parameters, validated once at admission."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.engine.errors import InvalidRequestError


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # OpenAI: logit -= frequency_penalty * count + presence_penalty * (count > 0), over generated tokens.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # vLLM / HF: every token id of the prompt or the output gets logit / p if positive, else logit * p.
    repetition_penalty: float = 1.0

    def validate(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # also rejects NaN
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise InvalidRequestError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0
