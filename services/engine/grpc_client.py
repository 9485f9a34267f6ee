"""A small async client for the engine's gRPC service (services/engine/grpc_server.py); the gateway reuses it."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import grpc

from services.common.engine_token import engine_token, token_metadata
from services.common.protos import engine_pb2, engine_pb2_grpc
from services.engine.sampling_params import SamplingParams

# gRPC's reconnect backoff grows to 120 s by default: a restarted engine would wait that long to be
# re-admitted. Capped at 1 s, it is back within about a second of listening again.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
MODEL_INFO_FIELDS = tuple(f.name for f in engine_pb2.ModelInfoResponse.DESCRIPTOR.fields)


def params_to_proto(params: SamplingParams) -> Any:
    msg = engine_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        repetition_penalty=params.repetition_penalty,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


class EngineClient:
    """Async client for the Engine service.

    `generate` mirrors `AsyncLLMEngine.generate(request_id, prompt, params)` and yields GenerateResponse
    messages, whose field names match RequestOutput's (finish_reason is "" rather than None while running).
    RPC errors surface as `grpc.aio.AioRpcError` (check `.code()`: INVALID_ARGUMENT, ALREADY_EXISTS, ...).
    """

    def __init__(self, address: str, channel: grpc.aio.Channel | None = None, token: str | None = None) -> None:
        self.address = address
        # The engines' shared token (default: HINTSERVE_ENGINE_TOKEN), sent with every call.
        self._metadata = token_metadata(token or engine_token())
        self._channel = channel or grpc.aio.insecure_channel(address, options=RECONNECT_OPTIONS)
        self.stub = engine_pb2_grpc.EngineStub(self._channel)

    async def wait_ready(self, timeout: float = 10.0) -> None:
        import asyncio

        await asyncio.wait_for(self._channel.channel_ready(), timeout)

    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> AsyncGenerator[Any, None]:
        request = engine_pb2.GenerateRequest(
            request_id=request_id, sampling=params_to_proto(params or SamplingParams())
        )
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        call = self.stub.Generate(request, metadata=self._metadata)
        try:
            async for response in call:
                yield response
        finally:
            # The consumer stopped early (or failed): cancel the RPC so the server aborts the request.
            call.cancel()

    async def abort(self, request_id: str) -> None:
        await self.stub.Abort(engine_pb2.AbortRequest(request_id=request_id), metadata=self._metadata)

    async def health(self) -> bool:
        response = await self.stub.Health(engine_pb2.HealthRequest(), metadata=self._metadata)
        return response.status == engine_pb2.HealthResponse.SERVING

    async def model_info(self) -> dict[str, Any]:
        response = await self.stub.ModelInfo(engine_pb2.ModelInfoRequest(), metadata=self._metadata)
        return {name: getattr(response, name) for name in MODEL_INFO_FIELDS}

    async def stats(self) -> dict[str, float]:
        response = await self.stub.Stats(engine_pb2.StatsRequest(), metadata=self._metadata)
        return dict(response.counters)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
