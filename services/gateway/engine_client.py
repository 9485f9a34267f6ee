"""The engine backends the gateway routes to: one interface, two implementations.

* `services.engine.grpc_client.EngineClient`: a remote engine over gRPC; yields proto GenerateResponse,
  raises `grpc.aio.AioRpcError`.
* `InProcessEngineClient` (here): an `AsyncLLMEngine` in this process, so `hintserve serve` skips gRPC;
  yields RequestOutput, raises the engine's InvalidRequestError / ContextLengthExceededError /
  EngineDeadError.

Both outputs carry the same field names (request_id, delta_text, delta_token_ids, prompt_tokens,
completion_tokens, finished, finish_reason); finish_reason is "" (proto) or None (in-process) while
running. `services.gateway.errors.from_engine_error` maps both kinds of errors.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol

from services.engine.errors import EngineDeadError
from services.engine.sampling_params import SamplingParams

IN_PROCESS_ADDRESS = "in-process"


class EngineBackend(Protocol):
    address: str

    def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncGenerator[Any, None]:
        """Streams deltas; closing the iterator early aborts the request and frees its KV blocks."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def health(self) -> bool: ...

    async def model_info(self) -> dict[str, Any]: ...

    async def stats(self) -> dict[str, float]: ...

    async def close(self) -> None: ...


class InProcessEngineClient:
    """`EngineClient`'s interface over an in-process AsyncLLMEngine (whose lifecycle the caller owns)."""

    def __init__(self, engine: Any, address: str = IN_PROCESS_ADDRESS) -> None:
        self.engine = engine
        self.address = address

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncGenerator[Any, None]:
        stream = self.engine.generate(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            # Explicit, so an early close aborts the engine request now rather than at garbage collection.
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def health(self) -> bool:
        return bool(self.engine.is_running)

    async def model_info(self) -> dict[str, Any]:
        if not self.engine.is_running:
            raise EngineDeadError("engine loop is not running")
        return dict(self.engine.model_info())

    async def stats(self) -> dict[str, float]:
        return dict(self.engine.stats())

    async def close(self) -> None:
        return None
