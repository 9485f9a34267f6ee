"""One streamed `/v1/completions` request, timed per token on the client side.

httpx rather than the openai client: we stamp each SSE event the moment its line arrives, with no per-chunk
pydantic parsing on a busy CPU in between, no hidden retries (the openai client retries twice by default, which
would hide failures and inflate latencies), and vLLM's `ignore_eos` goes straight into the JSON body.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

_ERROR_BODY_CHARS = 300


@dataclass
class RequestResult:
    """What one request did. Times are seconds; `start_s` is relative to the run's start."""

    index: int
    arrival_s: float  # when it was scheduled
    input_len: int  # prompt tokens we built (the trace's ContextTokens after clipping)
    output_len: int  # max_tokens asked for
    start_s: float = 0.0  # when it was actually sent (after the concurrency limit)
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0  # end-to-end: send to last byte
    itl: list[float] = field(default_factory=list)  # gaps between successive token chunks
    chunks: int = 0  # chunks carrying text
    completion_tokens: int = 0  # from the usage chunk, else the chunk count
    prompt_tokens: int | None = None  # as the server counted them (usage), if it said

    @property
    def tpot(self) -> float:
        """Time per output token after the first (0 for single-token outputs, as vLLM counts it)."""
        n = self.completion_tokens
        return (self.latency - self.ttft) / (n - 1) if n > 1 else 0.0


def completion_body(model: str, prompt: str, max_tokens: int) -> dict:
    """The request body: exact output length via max_tokens + ignore_eos (a vLLM extension our server
    shares), streamed with a final usage chunk so completion tokens are counted by the server."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_completion(client: httpx.AsyncClient, url: str, body: dict, result: RequestResult,
                          run_start: float, headers: dict[str, str] | None = None) -> RequestResult:
    """Sends one request and fills `result`; never raises for HTTP, network or protocol errors."""
    start = time.perf_counter()
    result.start_s = start - run_start
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code >= 400:
                text = (await resp.aread()).decode("utf-8", "replace")[:_ERROR_BODY_CHARS]
                result.error = f"HTTP {resp.status_code}: {text}"
                return result
            done = False
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {json.dumps(chunk['error'])[:_ERROR_BODY_CHARS]}"
                    return result
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    # A chunk may carry several tokens (server stream interval); ITL is per chunk, as in vLLM.
                    if result.chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.chunks += 1
                usage = chunk.get("usage")
                if usage:
                    result.completion_tokens = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens") is not None:
                        result.prompt_tokens = int(usage["prompt_tokens"])
            result.latency = time.perf_counter() - start
            if not done and result.completion_tokens == 0:
                result.error = "stream ended without [DONE]"
            elif result.chunks == 0:
                result.error = "no tokens received"
            else:
                result.completion_tokens = result.completion_tokens or result.chunks
                result.success = True
    except httpx.TimeoutException as exc:
        result.error = f"timeout: {type(exc).__name__} {exc}".strip()
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    except (ValueError, KeyError, TypeError) as exc:  # malformed JSON / chunk shape
        result.error = f"bad response: {type(exc).__name__}: {exc}"
    return result
