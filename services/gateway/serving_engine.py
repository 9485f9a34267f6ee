"""What chat and completions share: model check, field validation, sampling params, tokenization, start."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from services.engine.errors import ContextLengthExceededError, InvalidRequestError
from services.engine.input_processor import INLINE_TOKENIZE_CHARS, check_prompt_chars, longest_token_chars
from services.engine.sampling_params import SamplingParams, check_context_length
from services.gateway.engine_pool import EnginePool
from services.gateway.errors import APIError, bad_request, context_length_exceeded, no_healthy_engine
from services.gateway.protocol import MAX_STOP_SEQUENCES, unsupported_fields
from services.gateway.router import EngineRouter
from services.gateway.streams import merge, prime

_INT64 = 2**64
T = TypeVar("T")


def sse(payload: dict[str, Any]) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"


def choice_seed(seed: int | None, index: int) -> int | None:
    """seed + index (choices must differ yet be reproducible), wrapped into the signed int64 range."""
    if seed is None:
        return None
    value = seed + index
    return value - _INT64 if value >= 2**63 else value


class OpenAIServing:
    def __init__(
        self,
        router: EngineRouter,
        pool: EnginePool,
        model_name: Callable[[], str | None],
        tokenizer: Any | None,
        max_n: int,
    ) -> None:
        self.router = router
        self.pool = pool
        self._model_name = model_name
        self.tokenizer = tokenizer  # None: prompts go to the engine as text and it counts the tokens
        self.max_n = max_n
        self.token_chars = longest_token_chars(tokenizer) if tokenizer is not None else 0
        # One thread for templates and tokenization of long inputs: never the event loop's time, and one call
        # at a time into the tokenizer (its Python wrapper is not meant for concurrent use).
        self._tokenize_pool: ThreadPoolExecutor | None = None

    @property
    def model_name(self) -> str | None:
        return self._model_name()

    def check_model(self, requested: str) -> str:
        served = self.model_name
        if served is None:  # no engine has ever answered, and no --model-name was given
            raise no_healthy_engine("the served model is not known yet")
        if requested != served:
            raise APIError(
                404,
                f"The model `{requested}` does not exist. This server serves `{served}`.",
                param="model",
                code="model_not_found",
            )
        return served

    def check_fields(self, request: Any, unsupported: list[str] | None = None) -> None:
        names = unsupported if unsupported is not None else unsupported_fields(request)
        if names:
            raise bad_request(
                f"unsupported field(s): {', '.join(names)}", param=names[0], code="unsupported_field"
            )
        if request.n > self.max_n:
            raise bad_request(f"n must be at most {self.max_n}, got {request.n}", param="n")
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if len(request.stop_list()) > MAX_STOP_SEQUENCES:
            raise bad_request(f"at most {MAX_STOP_SEQUENCES} stop sequences are supported", param="stop")

    def sampling_params(self, request: Any, max_tokens: int, index: int) -> SamplingParams:
        params = SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            seed=choice_seed(request.seed, index),
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=request.stop_list(),
            stop_token_ids=list(request.stop_token_ids or []),
            ignore_eos=request.ignore_eos,
            frequency_penalty=request.frequency_penalty or 0.0,
            presence_penalty=request.presence_penalty or 0.0,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        )
        try:  # the engine's own rules, checked before any engine is involved
            params.validate(self.vocab_size)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        return params

    @property
    def vocab_size(self) -> int | None:
        info = self.pool.model_info()
        return int(info["vocab_size"]) if info and info.get("vocab_size") else None

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Prompt token ids must lie in the vocabulary (the engine would refuse them; refuse them first)."""
        vocab = self.vocab_size
        bad = [t for t in ids if vocab is not None and t >= vocab]
        if bad:
            raise bad_request(f"{param}: token ids out of range [0, {vocab}): {bad[:5]}", param=param)

    def check_prompt_size(self, chars: int, param: str) -> None:
        """A 400 context_length_exceeded, before any template or tokenizer runs, for text that cannot fit."""
        max_len = self.pool.max_model_len()
        if max_len is None or not self.token_chars:
            return
        try:
            check_prompt_chars(chars, max_len, self.token_chars, param)
        except ContextLengthExceededError as exc:
            raise context_length_exceeded(str(exc), param) from None

    async def off_loop(self, chars: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) (template, tokenizer) inline for small inputs, else on the worker thread."""
        if chars <= INLINE_TOKENIZE_CHARS:
            return fn(*args)
        if self._tokenize_pool is None:
            self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="hintserve-gateway-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def close(self) -> None:
        if self._tokenize_pool is not None:
            self._tokenize_pool.shutdown(wait=False)
            self._tokenize_pool = None

    def encode(self, text: str) -> list[int]:
        # add_special_tokens=False, as the engine does for text: templates and prompts carry their own.
        assert self.tokenizer is not None, "encode needs the gateway's tokenizer"
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_context(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        """The completion budget; raises context_length_exceeded as the engine would, but earlier."""
        max_len = self.pool.max_model_len()
        if max_len is None:
            if max_tokens is None:
                raise no_healthy_engine("the model's context length is not known yet")
            return max_tokens
        if max_tokens is None:
            max_tokens = max_len - prompt_len  # the rest of the window (< 1 when the prompt fills it)
        try:
            check_context_length(prompt_len, max(max_tokens, 1), max_len, param)
        except ContextLengthExceededError as exc:
            raise context_length_exceeded(str(exc), param) from None
        return max_tokens

    async def start(
        self,
        request_id: str,
        jobs: Sequence[tuple[str | list[int], SamplingParams]],
        model_name: str,
        arrival: float,
        prompt_param: str,
    ) -> AsyncGenerator[tuple[int, Any], None]:
        """Starts one engine request per job and returns their merged (job index, output) stream.

        Returns only once every job has its first output, so admission and validation errors are raised
        here with their HTTP status, before any response header is sent.
        """
        streams = [
            self.router.generate(
                f"{request_id}-{i}" if len(jobs) > 1 else request_id,
                prompt,
                params,
                model_name,
                arrival,
                prompt_param,
            )
            for i, (prompt, params) in enumerate(jobs)
        ]
        firsts = await prime(streams)
        return merge(streams, firsts)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())
