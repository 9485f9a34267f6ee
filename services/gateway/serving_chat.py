"""POST /v1/chat/completions: chat template, n choices, streaming (SSE) and non-streaming responses."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from services.gateway.errors import APIError, bad_request
from services.gateway.protocol import CHAT_ROLES, ChatCompletionRequest, chat_unsupported_fields, usage
from services.gateway.serving_engine import SSE_DONE, OpenAIServing, new_request_id, now_s, sse


def _chars(content: str | list[Any] | None) -> int:
    if isinstance(content, list):
        return sum(len(part.text or "") + 1 for part in content)
    return len(content or "")


class OpenAIServingChat:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _render(self, request: ChatCompletionRequest) -> str:
        tokenizer = self.serving.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise bad_request(
                "this server has no chat template for the model; use /v1/completions, or start the gateway "
                "with --tokenizer pointing at the model directory",
                param="messages",
            )
        messages = []
        for i, message in enumerate(request.messages):
            if message.role not in CHAT_ROLES:
                raise bad_request(
                    f"unsupported role {message.role!r} in messages[{i}]", param=f"messages[{i}].role"
                )
            content = message.content
            if isinstance(content, list):  # text parts only (others were refused as unsupported)
                content = "\n".join(part.text or "" for part in content)
            entry = {"role": message.role, "content": content or ""}
            if message.name is not None:
                entry["name"] = message.name
            messages.append(entry)
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja2 TemplateError, e.g. a template requiring alternating roles
            raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from exc

    async def create_chat_completion(self, request: ChatCompletionRequest, arrival: float) -> Any:
        """A response dict (non-streaming) or an async iterator of SSE strings (streaming)."""
        serving = self.serving
        model = serving.check_model(request.model)
        serving.check_fields(request, chat_unsupported_fields(request))
        chars = sum(_chars(m.content) + len(m.name or "") for m in request.messages)
        serving.check_prompt_size(chars, "messages")  # the template only adds text: refuse before rendering
        prompt_ids = await serving.off_loop(chars, lambda: serving.encode(self._render(request)))
        requested = request.max_completion_tokens or request.max_tokens
        max_tokens = serving.check_context(len(prompt_ids), requested, "messages")
        jobs = [(prompt_ids, serving.sampling_params(request, max_tokens, i)) for i in range(request.n)]
        request_id = new_request_id("chatcmpl")
        outputs = await serving.start(request_id, jobs, model, arrival, "messages")
        if request.stream:
            return self._stream(request, request_id, model, outputs)
        return await self._full(request, request_id, model, outputs)

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        model: str,
        outputs: AsyncGenerator[tuple[int, Any], None],
    ) -> AsyncGenerator[str, None]:
        created = now_s()
        include_usage = request.include_usage
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        if include_usage:
            base["usage"] = None  # as OpenAI: every chunk has the key, only the last one a value

        def chunk(index: int, delta: dict[str, Any], finish_reason: str | None) -> str:
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return sse({**base, "choices": [choice]})

        started: set[int] = set()
        prompt_tokens = 0
        completion_tokens = [0] * request.n
        try:
            async for index, out in outputs:
                if index not in started:
                    started.add(index)
                    yield chunk(index, {"role": "assistant", "content": ""}, None)
                completion_tokens[index] = out.completion_tokens
                prompt_tokens = out.prompt_tokens
                if out.finished:
                    delta = {"content": out.delta_text} if out.delta_text else {}
                    yield chunk(index, delta, out.finish_reason)
                elif out.delta_text:
                    yield chunk(index, {"content": out.delta_text}, None)
            if include_usage:
                yield sse({**base, "choices": [], "usage": usage(prompt_tokens, sum(completion_tokens))})
        except APIError as err:  # after the headers: the error travels in the stream (the client raises it)
            yield sse(err.body())
        finally:
            await outputs.aclose()
        yield SSE_DONE

    async def _full(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        model: str,
        outputs: AsyncGenerator[tuple[int, Any], None],
    ) -> dict[str, Any]:
        texts: list[list[str]] = [[] for _ in range(request.n)]
        reasons: list[str | None] = [None] * request.n
        completion_tokens = [0] * request.n
        prompt_tokens = 0
        try:
            async for index, out in outputs:
                if out.delta_text:
                    texts[index].append(out.delta_text)
                completion_tokens[index] = out.completion_tokens
                prompt_tokens = out.prompt_tokens
                if out.finished:
                    reasons[index] = out.finish_reason
        finally:
            await outputs.aclose()
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": "".join(texts[i])},
                "logprobs": None,
                "finish_reason": reasons[i],
            }
            for i in range(request.n)
        ]
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage(prompt_tokens, sum(completion_tokens)),
            "system_fingerprint": None,
        }
