"""POST /v1/completions: text or token-id prompts (one or several), n choices, streaming or not."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any, cast

from services.engine.sampling_params import DEFAULT_MAX_TOKENS
from services.gateway.errors import APIError, bad_request
from services.gateway.protocol import CompletionRequest, usage
from services.gateway.serving_engine import SSE_DONE, OpenAIServing, new_request_id, now_s, sse

MAX_PROMPTS = 16  # several prompts in one request take one admission slot each; keep a burst bounded


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [cast("list[int]", list(prompt))]
    return cast("list[str | list[int]]", list(prompt))  # strings or token lists; the engines check each


class OpenAIServingCompletion:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def _prompt_ids(self, prompt: str | list[int], param: str) -> str | list[int]:
        if isinstance(prompt, list):
            self.serving.check_token_ids(prompt, param)
            return prompt
        if not prompt:
            raise bad_request("prompt must not be empty", param=param)
        if self.serving.tokenizer is None:
            return prompt  # the engine tokenizes; it also enforces the context window
        self.serving.check_prompt_size(len(prompt), param)
        return await self.serving.off_loop(len(prompt), self.serving.encode, prompt)

    async def create_completion(self, request: CompletionRequest, arrival: float) -> Any:
        """A response dict (non-streaming) or an async iterator of SSE strings (streaming)."""
        serving = self.serving
        model = serving.check_model(request.model)
        serving.check_fields(request)
        prompts = _prompts(request.prompt)
        if len(prompts) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        if len(prompts) * request.n > serving.max_n:
            raise bad_request(f"prompts x n must be at most {serving.max_n}", param="n")
        jobs = []
        for p, raw in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{p}]"
            prompt = await self._prompt_ids(raw, param)
            max_tokens = request.max_tokens
            if isinstance(prompt, list):
                if not prompt:
                    raise bad_request("prompt must not be empty", param=param)
                max_tokens = serving.check_context(len(prompt), max_tokens, param)
            jobs += [
                (prompt, serving.sampling_params(request, max_tokens or DEFAULT_MAX_TOKENS, i)) for i in range(request.n)
            ]
        request_id = new_request_id("cmpl")
        outputs = await serving.start(request_id, jobs, model, arrival, "prompt")
        if request.stream:
            return self._stream(request, request_id, model, len(jobs), outputs)
        return await self._full(request_id, model, len(jobs), request.n, outputs)

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        model: str,
        num_choices: int,
        outputs: AsyncGenerator[tuple[int, Any], None],
    ) -> AsyncGenerator[str, None]:
        base: dict[str, Any] = {
            "id": request_id,
            "object": "text_completion",
            "created": now_s(),
            "model": model,
        }
        include_usage = request.include_usage
        if include_usage:
            base["usage"] = None
        prompt_tokens = [0] * num_choices
        completion_tokens = [0] * num_choices
        try:
            async for index, out in outputs:
                prompt_tokens[index] = out.prompt_tokens
                completion_tokens[index] = out.completion_tokens
                if out.delta_text or out.finished:
                    reason = out.finish_reason if out.finished else None
                    choice = {
                        "index": index,
                        "text": out.delta_text,
                        "logprobs": None,
                        "finish_reason": reason,
                    }
                    yield sse({**base, "choices": [choice]})
            if include_usage:
                total_prompt = sum(prompt_tokens[:: request.n])  # each prompt once, not once per choice
                yield sse({**base, "choices": [], "usage": usage(total_prompt, sum(completion_tokens))})
        except APIError as err:
            yield sse(err.body())
        finally:
            await outputs.aclose()
        yield SSE_DONE

    async def _full(
        self, request_id: str, model: str, num_choices: int, n: int, outputs: AsyncGenerator[tuple[int, Any], None]
    ) -> dict[str, Any]:
        texts: list[list[str]] = [[] for _ in range(num_choices)]
        reasons: list[str | None] = [None] * num_choices
        prompt_tokens = [0] * num_choices
        completion_tokens = [0] * num_choices
        try:
            async for index, out in outputs:
                if out.delta_text:
                    texts[index].append(out.delta_text)
                prompt_tokens[index] = out.prompt_tokens
                completion_tokens[index] = out.completion_tokens
                if out.finished:
                    reasons[index] = out.finish_reason
        finally:
            await outputs.aclose()
        choices = [
            {"index": i, "text": "".join(texts[i]), "logprobs": None, "finish_reason": reasons[i]}
            for i in range(num_choices)
        ]
        return {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage(sum(prompt_tokens[::n]), sum(completion_tokens)),
            "system_fingerprint": None,
        }
