"""The engine's gRPC front end (`grpc.aio`); its client is services/engine/grpc_client.py."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import grpc

from services.common.engine_token import token_matches
from services.common.protos import engine_pb2, engine_pb2_grpc
from services.engine.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from services.engine.grpc_client import MODEL_INFO_FIELDS
from services.engine.input_processor import MAX_REQUEST_ID_CHARS
from services.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


async def _check_request_id(request_id: str, context: grpc.aio.ServicerContext) -> None:
    """Ids are echoed in errors and logs: bounded before anything else looks at them (never a 1 MB echo)."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}",
        )


def params_from_proto(msg: Any) -> SamplingParams:
    """SamplingParams from the proto message; unset fields keep the engine defaults."""
    params = SamplingParams(
        top_k=msg.top_k,
        min_tokens=msg.min_tokens,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        frequency_penalty=msg.frequency_penalty,
        presence_penalty=msg.presence_penalty,
    )
    # proto3 `optional`: an unset field keeps the engine default, which differs from an explicit 0.
    for name in ("temperature", "top_p", "seed", "max_tokens", "repetition_penalty"):
        if msg.HasField(name):
            setattr(params, name, getattr(msg, name))
    return params


def _response(out: Any) -> Any:
    return engine_pb2.GenerateResponse(
        request_id=out.request_id,
        delta_text=out.delta_text or "",
        delta_token_ids=list(out.delta_token_ids),
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        finished=out.finished,
        finish_reason=out.finish_reason or "",
    )


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """Maps the RPCs onto an AsyncLLMEngine (see services/engine/async_engine.py)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._in_flight: set[str] = set()  # request ids with an open Generate stream on this server

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        request_id = request.request_id or uuid.uuid4().hex
        await _check_request_id(request_id, context)
        if request_id in self._in_flight:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already running")
        kind = request.WhichOneof("prompt")
        prompt: str | list[int] = request.text if kind == "text" else list(request.token_ids.ids)
        if not prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt must not be empty")
        params = params_from_proto(request.sampling)
        self._in_flight.add(request_id)
        # A coroutine handler writing with context.write (rather than an async-generator handler) so that
        # a client cancellation raises CancelledError right here and the finally always runs at once.
        stream = self._engine.generate(request_id, prompt, params)
        try:
            async for out in stream:
                await context.write(_response(out))
        except InvalidRequestError as exc:  # includes ContextLengthExceededError
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RequestFailedError as exc:  # this request alone failed; the engine goes on serving
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            self._in_flight.discard(request_id)
            # Closing the engine's generator (a no-op if it already ended) aborts an unfinished request and
            # frees its KV blocks.
            await stream.aclose()

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _check_request_id(request.request_id, context)
        # The engine returns False for ids it does not know (never seen, finished or already aborted).
        if not self._engine.abort(request.request_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no running request {request.request_id!r}")
        return engine_pb2.AbortResponse()

    async def Health(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        status, message = engine_pb2.HealthResponse.SERVING, ""
        if not getattr(self._engine, "is_running", True):
            status, message = engine_pb2.HealthResponse.NOT_SERVING, "engine loop is not running"
        return engine_pb2.HealthResponse(status=status, message=message)

    async def ModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        info = self._engine.model_info()
        return engine_pb2.ModelInfoResponse(
            **{k: v for k, v in info.items() if k in MODEL_INFO_FIELDS and v is not None}
        )

    async def Stats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        stats = {k: float(v) for k, v in self._engine.stats().items()}
        return engine_pb2.StatsResponse(
            counters=stats,
            num_running=int(stats.get("num_running", 0)),
            num_waiting=int(stats.get("num_waiting", 0)),
        )


_OPEN_METHODS = ("/hintserve.engine.v1.Engine/Health", "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")
_STREAMING_METHODS = ("/hintserve.engine.v1.Engine/Generate",)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC but Health needs the shared token (services/common/engine_token.py): UNAUTHENTICATED else."""

    def __init__(self, token: str) -> None:
        self.token = token

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong engine token (HINTSERVE_ENGINE_TOKEN)")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if details.method in _OPEN_METHODS or token_matches(details.invocation_metadata, self.token):
            return await continuation(details)
        return self._deny_stream if details.method in _STREAMING_METHODS else self._deny_unary


async def _add_health_service(server: grpc.aio.Server) -> None:
    """Register the standard grpc.health.v1 service when grpcio-health-checking is installed."""
    try:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    except ImportError:
        return  # optional: not a dependency of the project
    servicer = health.aio.HealthServicer()  # "" (the whole server) starts as SERVING
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    name = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
    await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def serve_engine(
    engine: Any, host: str = "127.0.0.1", port: int = 50051, token: str | None = None
) -> tuple[grpc.aio.Server, int]:
    """Start a gRPC server for `engine`; port 0 picks a free port. Returns (server, bound port). With `token`,
    callers must send it (services/common/engine_token.py).

    Stop it with `await stop_server(server)` (graceful: in-flight streams get a grace period, then are
    cancelled, which aborts their engine requests).
    """
    server = grpc.aio.server(interceptors=[TokenInterceptor(token)] if token else None)
    engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(engine), server)
    await _add_health_service(server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind gRPC server to {host}:{port}")
    await server.start()
    log.info("engine gRPC server listening on %s:%d", host, bound)
    return server, bound


async def stop_server(server: grpc.aio.Server, grace: float = 5.0) -> None:
    await server.stop(grace)
