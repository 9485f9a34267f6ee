"""Per-request sampling parameters, validated once at admission."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.errors import ContextLengthExceededError, InvalidRequestError

# The proto's integer types (engine.proto): every path into the engine must fit them.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The sampler computes in fp32: a float beyond FLOAT32_MAX overflows its tensors (a 500, not a 400), and a
# divisor (temperature, top_p, repetition_penalty) below FLOAT32_TINY, the smallest normal, rounds to 0 or a
# denormal there and turns logits into inf / NaN.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38


def is_valid_utf8(text: str) -> bool:
    """False for strings holding lone surrogates (JSON allows "\\ud800"; UTF-8 and tokenizers do not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequestError(f"{name} must be an integer in [{low}, {high}], got {value!r}", name)


def _check_float(name: str, value: object, low: float, high: float, zero: bool = False) -> None:
    """value in [low, high] (or exactly 0 when `zero`); NaN, inf and non-numbers fail too."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and ((zero and value == 0) or low <= value <= high))  # NaN fails every comparison
    if not ok:
        where = f"0 or a number in [{low:.9g}, {high:.9g}]" if zero else f"a number in [{low:.9g}, {high:.9g}]"
        raise InvalidRequestError(f"{name} must be {where}, got {value!r}", name)


DEFAULT_MAX_TOKENS = 16  # completions without max_tokens (OpenAI's legacy default); the engine's default


def check_context_length(prompt_len: int, max_tokens: int, max_model_len: int, param: str | None = None) -> None:
    """The one context-length check (engine admission, gateway pre-check), in OpenAI's wording."""
    total = prompt_len + max_tokens
    if total > max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). "
            "Please reduce the prompt or max_tokens.",
            param,
        )


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # OpenAI: logit -= frequency_penalty * count + presence_penalty * (count > 0), over generated tokens.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # vLLM / HF: every token id of the prompt or the output gets logit / p if positive, else logit * p.
    repetition_penalty: float = 1.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises InvalidRequestError naming the first bad field; with `vocab_size`, token ids are checked
        against the vocabulary too (an out-of-vocabulary stop id would otherwise fail inside the sampler)."""
        _check_int("top_k", self.top_k, -1, INT32_MAX)
        _check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        _check_int("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN, INT64_MAX)
        top_id = INT32_MAX if vocab_size is None else vocab_size - 1
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, 0, top_id)
        _check_float("temperature", self.temperature, FLOAT32_TINY, 100.0, zero=True)
        _check_float("top_p", self.top_p, FLOAT32_TINY, 1.0)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}", "min_tokens"
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", "stop")
        if not all(is_valid_utf8(s) for s in self.stop):
            raise InvalidRequestError("stop strings must be valid UTF-8 (no lone surrogates)", "stop")
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, FLOAT32_TINY, FLOAT32_MAX)  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0
