"""The FastAPI app: routes, body parsing, error responses, client-disconnect handling."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from services.common.hosts import is_loopback_host
from services.gateway.admin import build_replay_config, check_admin, load_replay_module
from services.gateway.errors import APIError, bad_request
from services.gateway.middleware import GatewayMiddleware
from services.gateway.openapi import install_body_schemas
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.request_body import parse_json, parse_request

if TYPE_CHECKING:
    from services.gateway.server import Gateway

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"; counted, never sent


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def until_disconnected(raw: Request, work: Awaitable[Any]) -> Any:
    """Runs `work`; if the client disconnects first, cancels it (aborting its engine requests), returns None.

    FastAPI does not cancel a handler whose client went away; without this a non-streaming request (or a
    streaming one still queued for admission) would keep its engine slot and KV blocks to the end.
    """
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


def to_response(result: Any) -> Response:
    # A stream whose client vanishes before its first byte is never iterated, so its own cleanup cannot run;
    # the engine requests are then aborted when the primed generators are garbage-collected (asyncio's
    # async-generator finalizer closes them), which CPython does as soon as the response is dropped.
    if result is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(
        result,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def build_app(gateway: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="HintServe gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(
        GatewayMiddleware,
        auth=gateway.auth,
        metrics=gateway.metrics,
        max_body_bytes=gateway.config.max_body_bytes,
        drain=gateway.drain,
        guard_loopback=not gateway.auth.enabled and is_loopback_host(gateway.config.host),
    )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        # Starlette's 405 carries the Allow header (RFC 9110 requires it): keep it.
        return error_response(APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client left while its body was read: counted as 499, nothing to answer, nothing to log.
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(bad_request(str(exc)))

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        arrival = time.monotonic()
        body = await raw.body()
        request = await gateway.serving.off_loop(len(body), parse_request, body, ChatCompletionRequest)  # large: off the loop
        return to_response(
            await until_disconnected(raw, gateway.chat.create_chat_completion(request, arrival))
        )

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        arrival = time.monotonic()
        body = await raw.body()
        request = await gateway.serving.off_loop(len(body), parse_request, body, CompletionRequest)  # large: off the loop
        return to_response(
            await until_disconnected(raw, gateway.completion.create_completion(request, arrival))
        )

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        name = gateway.served_model_name
        data = []
        if name is not None:
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": gateway.created,
                    "owned_by": "hintserve",
                    "root": name,
                    "max_model_len": gateway.pool.max_model_len(),
                }
            )
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})  # alive; readiness is /ready

    @app.get("/ready")
    async def ready(raw: Request) -> JSONResponse:
        ok = any(h.healthy and h.model_info is not None for h in gateway.pool.engines)
        status = "draining" if gateway.drain.draining else "ready" if ok else "not ready"
        body: dict[str, Any] = {"status": status}
        # The bare status is public (probes); engine addresses and errors only with an API key.
        if gateway.auth.accepts(raw.headers.get("authorization")):
            body["engines"] = [
                {"address": h.address, "healthy": h.healthy, "outstanding": h.outstanding, "error": h.last_error}
                for h in gateway.pool.engines
            ]
        return JSONResponse(body, 200 if status == "ready" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        await gateway.pool.poll_stats()  # current engine counters at scrape time, not up to an interval old
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/admin/replay")
    async def admin_replay(raw: Request) -> Response:
        check_admin(gateway.config.admin_key, raw.headers.get("authorization"))
        body = parse_json(await raw.body())
        module = load_replay_module()
        host, port = raw.scope.get("server") or (gateway.config.host, gateway.config.port)
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else (f"[{host}]" if ":" in host else host)
        config = build_replay_config(
            module,
            body,
            f"http://{host}:{port}/v1",
            gateway.served_model_name,
            gateway.auth.any_key,
            gateway.config.tokenizer,
        )
        return to_response(await until_disconnected(raw, gateway.replay.run(module, config)))

    install_body_schemas(
        app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
    )
    return app
