"""Admission checks and tokenisation of a request, wherever the tokenizer lives (API process or engine)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from services.engine.errors import ContextLengthExceededError, InvalidRequestError
from services.engine.sampling_params import SamplingParams, check_context_length, is_valid_utf8
from services.engine.sequence import Sequence

MAX_REQUEST_ID_CHARS = 256  # the id is echoed in every streamed message: a long one would multiply
# Prompts up to this many characters are tokenized on the event loop (a thread hop costs more than they do);
# longer ones in a worker thread, so one large prompt never stalls the other streams.
INLINE_TOKENIZE_CHARS = 4096
# A normalizer may map several characters to one (accents stripped): the character bound keeps this margin.
_NORMALIZER_MARGIN = 2


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The longest vocabulary entry (added tokens included), in characters: no token covers more text."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def check_prompt_chars(chars: int, max_model_len: int, token_chars: int, param: str | None = "prompt") -> None:
    """Refuses, before tokenizing, a prompt too long to fit the context window whatever its tokens: with no
    token covering more than `token_chars` characters, it needs more than max_model_len tokens."""
    limit = max_model_len * token_chars * _NORMALIZER_MARGIN
    if chars > limit:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has {chars} "
            f"characters, more than {max_model_len} tokens can hold (at most {limit} characters). "
            "Please reduce the prompt.",
            param,
        )


@dataclass(frozen=True)
class EngineLimits:
    """What admission needs to know about the engine core (sent by the core process once it is ready)."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, limits: EngineLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.token_chars = longest_token_chars(tokenizer)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", "prompt")
            check_prompt_chars(len(prompt), self.limits.max_model_len, self.token_chars)
            if not is_valid_utf8(prompt):
                raise InvalidRequestError("prompt must be valid UTF-8 (no lone surrogates)", "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if not prompt:
            raise InvalidRequestError("prompt token ids must not be empty")
        vocab = self.limits.vocab_size
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}", "prompt")
        return list(prompt)

    def make_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Validates a request and builds its sequence; raises InvalidRequestError with a clear message."""
        limits = self.limits
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(
                f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}",
                "request_id",
            )
        params.validate(limits.vocab_size)
        ids = self.tokenize(prompt)
        if not ids:
            raise InvalidRequestError("prompt tokenizes to zero tokens")
        check_context_length(len(ids), params.max_tokens, limits.max_model_len)
        seq = Sequence(request_id, ids, params, limits.block_size)
        blocks = math.ceil((len(ids) + params.max_tokens) / limits.block_size)
        if blocks > limits.num_kv_blocks:
            raise InvalidRequestError(f"request needs {blocks} KV blocks but the cache holds {limits.num_kv_blocks}")
        return seq


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> str:
    if not has_chat_template(tokenizer):
        raise InvalidRequestError("this model's tokenizer has no chat template; use completions")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)  # tokenize=False: the rendered prompt
    return text
