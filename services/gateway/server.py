"""The gateway assembled (pool, admission, batching, router, serving, metrics, app) and its HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Generator, Sequence
from typing import Any

import uvicorn

from services.gateway.admin import ReplayRunner
from services.gateway.admission import AdmissionController
from services.gateway.api_server import build_app
from services.gateway.auth import Authenticator
from services.gateway.batching import RequestBatcher
from services.gateway.config import GatewayConfig
from services.gateway.drain import CUT_GRACE_S, Drain
from services.gateway.edge import MAX_HEADER_BYTES
from services.gateway.engine_client import EngineBackend
from services.gateway.engine_discovery import EngineDiscovery
from services.gateway.engine_pool import EnginePool
from services.gateway.engine_stats_collector import EngineStatsCollector
from services.gateway.http_protocol import protocol_with_read_timeout
from services.gateway.metrics import GatewayMetrics
from services.gateway.router import EngineRouter
from services.gateway.serving_chat import OpenAIServingChat
from services.gateway.serving_completion import OpenAIServingCompletion
from services.gateway.serving_engine import OpenAIServing

log = logging.getLogger(__name__)


def load_tokenizer(model_dir: str) -> Any:
    """The model's tokenizer (chat template, token counts). The gateway loads its own copy even next to an
    in-process engine: the engine thread detokenizes concurrently, and a fast tokenizer is not meant to be
    shared across threads."""
    from services.engine.startup_checks import load_tokenizer as load

    return load(model_dir)  # ValueError naming the directory when it does not load


class _ServerWithoutSignals(uvicorn.Server):
    """uvicorn would re-raise a caught SIGTERM after shutdown (killing the process before our cleanup); the
    CLI installs its own handlers calling request_exit(), tests and benchmarks need none."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class Gateway:
    def __init__(
        self, config: GatewayConfig, clients: Sequence[EngineBackend], tokenizer: Any | None = None
    ) -> None:
        config.validate()
        self.config = config
        if tokenizer is None and config.tokenizer:
            tokenizer = load_tokenizer(config.tokenizer)
        self.created = int(time.time())
        self.pool = EnginePool(clients, config.max_concurrency_per_engine, config.health_interval_s)
        self.admission = AdmissionController(self.pool, config.max_queue)
        self.batcher = RequestBatcher(config.batch_window_ms / 1000.0, config.max_batch)
        self.metrics = GatewayMetrics()
        self.metrics.registry.register(EngineStatsCollector(self.pool))
        self.router = EngineRouter(
            self.pool, self.admission, self.batcher, self.metrics, config.stream_idle_timeout_s
        )
        self.auth = Authenticator(config.api_keys)
        self.drain = Drain(config.drain_timeout_s)
        self.serving = OpenAIServing(
            self.router, self.pool, lambda: self.served_model_name, tokenizer, config.max_n
        )
        self.chat = OpenAIServingChat(self.serving)
        self.completion = OpenAIServingCompletion(self.serving)
        self.replay = ReplayRunner()
        self.discovery: EngineDiscovery | None = None  # set by `hintserve gateway --discover-engines`
        self.app = build_app(self)

    @property
    def served_model_name(self) -> str | None:
        if self.config.model_name:
            return self.config.model_name
        info = self.pool.model_info()
        return str(info["model"]) if info and info.get("model") else None

    async def start(self) -> None:
        await self.pool.start()
        if self.discovery is not None:
            await self.discovery.start()
        names = {h.model_info.get("model") for h in self.pool.engines if h.model_info}
        if len(names) > 1:
            log.warning(
                "engines report different models %s; serving them all as %r", names, self.served_model_name
            )
        if not self.pool.any_healthy:
            log.warning("no engine is healthy yet; requests get 503 until one is")

    async def drain_and_stop(self, server: HTTPServer) -> None:
        """SIGTERM: readiness false and no new requests, streams finish within the drain timeout, those
        still running then end with an SSE error event; then the HTTP server exits."""
        if self.drain.draining:  # a second signal: end every stream now, then stop as the first would
            await self.router.cut_all()
            server.request_exit()
            return
        self.drain.begin()
        server.stop_accepting()
        if not await self.drain.wait_idle(self.drain.timeout_s):
            log.warning("drain timeout: cutting %d stream(s)", len(self.router.in_flight))
            await self.router.cut_all()
            await self.drain.wait_idle(CUT_GRACE_S)
        server.request_exit()

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self.router.watch.stop()
        self.serving.close()
        await self.pool.stop()


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: the CLI does this before loading a model, so a busy port fails fast."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only when it sees that proto;
    # without it every keep-alive response after the first waited ~40 ms on Nagle + delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets on Linux
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


class HTTPServer:
    """uvicorn on an already bound socket, as a task of the running loop (the CLI, tests, the benchmark)."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        sock: socket.socket | None = None,
        read_timeout_s: float = 30.0,
    ) -> None:
        self.sock = sock if sock is not None else bind_socket(host, port)
        self.host = host
        self.port: int = self.sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=3,  # after Gateway.drain_and_stop, only idle connections are left
            timeout_keep_alive=30,
            http=protocol_with_read_timeout(read_timeout_s),
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,  # a header block still arriving: bounded, then 431
        )
        self.server = _ServerWithoutSignals(config)
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self, timeout: float = 30.0) -> None:
        """Returns once the app's startup (engine health round) is done and requests are served."""
        self._task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises the startup error
                raise RuntimeError("HTTP server exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError("HTTP server did not start in time")
            await asyncio.sleep(0.005)

    async def serve_forever(self) -> None:
        """Until the server exits (SIGINT/SIGTERM when signal handlers are installed, or stop())."""
        if self._task is None:
            await self.start()
        assert self._task is not None
        await self._task

    def stop_accepting(self) -> None:
        """Closes the listening socket(s); connections already open are served on."""
        for listener in getattr(self.server, "servers", ()):
            listener.close()

    def request_exit(self) -> None:
        """Graceful stop: open connections get timeout_graceful_shutdown, then the app's shutdown runs.
        Never uvicorn's forced exit, which skips the app's shutdown (the gateway's engine pool was left
        running and its lifespan task died cancelled, with a traceback): a second Ctrl-C cuts the streams
        instead (Gateway.drain_and_stop)."""
        self.server.should_exit = True

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._task is not None:
            await self._task
        self.sock.close()
