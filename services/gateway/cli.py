"""`hintserve gateway` (OpenAI API in front of gRPC engines) and `hintserve serve` (all in one process).

Authentication policy, explicit on purpose:
* `gateway`: API keys are required (HINTSERVE_API_KEYS, comma-separated, and/or --api-key-file) unless
  --no-auth is given.
* `serve`: the same, except that with no keys configured and a loopback --host (the default 127.0.0.1) it
  runs without authentication and prints a line saying so; on any other address it refuses to start
  without keys or --no-auth.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

from services.common.hosts import is_loopback_host
from services.common.metrics_http import add_metrics_args, check_metrics_port
from services.gateway.auth import ADMIN_KEY_ENV, API_KEYS_ENV, load_api_keys
from services.gateway.config import (
    DEFAULT_STREAM_IDLE_TIMEOUT_S,
    STREAM_IDLE_TIMEOUT_ENV,
    GatewayConfig,
    env_seconds,
    parse_engine_addresses,
)
from services.gateway.drain import DEFAULT_DRAIN_TIMEOUT_S, DRAIN_TIMEOUT_ENV, default_drain_timeout_s

DEFAULT_MODEL_DIR = "models/demo-moe"


_GATEWAY_AUTH = (
    f"Authentication: API keys from {API_KEYS_ENV} (comma-separated) and/or --api-key-file are required; "
    "--no-auth turns authentication off explicitly."
)
_SERVE_AUTH = (
    f"Authentication: with API keys configured ({API_KEYS_ENV} and/or --api-key-file) they are required. With "
    "none configured, serve runs WITHOUT authentication only when --host is a loopback address (the default "
    "127.0.0.1), and says so at startup; on any other address it refuses to start unless --no-auth is given."
)


def register(subparsers: Any) -> None:
    from services.engine.cli import add_engine_args

    gateway = subparsers.add_parser(
        "gateway", help="serve the OpenAI API in front of engines (gRPC)", description=_GATEWAY_AUTH
    )
    gateway.add_argument("--engines", required=True, help="engine gRPC addresses: host:port,host:port,...")
    gateway.add_argument(
        "--tokenizer",
        default=None,
        help="model directory whose tokenizer gives the chat template (needed for chat)",
    )
    gateway.add_argument(
        "--discover-engines",
        action="store_true",
        help="re-resolve the --engines host names every --health-interval-s and route to every address "
        "each one resolves to (docker compose --scale engine=N, a Kubernetes headless Service)",
    )
    _add_gateway_args(gateway)
    gateway.set_defaults(func=run_gateway)

    serve = subparsers.add_parser(
        "serve", help="gateway + in-process engine in one process (OpenAI API on :8000)", description=_SERVE_AUTH
    )
    add_engine_args(serve, model_default=DEFAULT_MODEL_DIR)
    _add_gateway_args(serve)
    # The in-process engine's own /metrics, as `hintserve engine --metrics-port` serves it (off by default:
    # the gateway's /metrics already carries the engine's series).
    add_metrics_args(serve, default_port=-1, what="in-process engine")
    serve.set_defaults(func=run_serve)


def _add_gateway_args(parser: argparse.ArgumentParser) -> None:
    d = GatewayConfig()
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port, help="0 picks a free port")
    parser.add_argument(
        "--model-name", default=None, help="served model name (default: the model directory's name)"
    )
    parser.add_argument(
        "--api-key-file", default=None, help=f"API keys, one per line (also: env {API_KEYS_ENV})"
    )
    parser.add_argument("--no-auth", action="store_true", help="serve without API keys (explicit opt-out)")
    parser.add_argument(
        "--max-queue", type=int, default=d.max_queue, help="admission queue bound; beyond: 429"
    )
    parser.add_argument("--max-concurrency-per-engine", type=int, default=d.max_concurrency_per_engine)
    parser.add_argument(
        "--batch-window-ms", type=float, default=d.batch_window_ms, help="0 disables batching"
    )
    parser.add_argument("--max-batch", type=int, default=d.max_batch)
    parser.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="larger bodies: 413")
    parser.add_argument(
        "--max-n", type=int, default=d.max_n, help="largest n (choices x prompts) per request"
    )
    parser.add_argument("--health-interval-s", type=float, default=d.health_interval_s)
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=None,
        help=f"on SIGTERM, how long streams may finish before they are cut (default {DEFAULT_DRAIN_TIMEOUT_S:g}; "
        f"env {DRAIN_TIMEOUT_ENV})",
    )
    parser.add_argument(
        "--request-read-timeout-s",
        type=float,
        default=d.request_read_timeout_s,
        help="a request's headers and body must arrive within this, else 408 (slow-client defence)",
    )
    parser.add_argument(
        "--stream-idle-timeout-s",
        type=float,
        default=None,
        help="a request that gets no output for this long (first output included) while its engine makes no "
        "progress at all is aborted and the client gets an error "
        f"(default {DEFAULT_STREAM_IDLE_TIMEOUT_S:g}; 0: off; env {STREAM_IDLE_TIMEOUT_ENV})",
    )


def resolve_auth(args: argparse.Namespace, loopback_default_off: bool) -> tuple[list[str] | None, str]:
    """(API keys or None for no auth, the line to print about it)."""
    if args.no_auth:
        if args.api_key_file:
            raise ValueError("--no-auth and --api-key-file contradict each other")
        if os.environ.get(API_KEYS_ENV, "").strip():
            raise ValueError(f"--no-auth contradicts the API keys in {API_KEYS_ENV}: unset one of them")
        return None, "authentication is OFF (--no-auth): anyone who can reach this port can use it"
    keys = load_api_keys(os.environ.get(API_KEYS_ENV), args.api_key_file)
    if keys:
        return keys, f"authentication is on: {len(keys)} API key(s) (send 'Authorization: Bearer <key>')"
    if loopback_default_off and is_loopback_host(args.host):
        return None, (
            f"authentication is OFF: no API keys configured and listening on loopback only ({args.host}); "
            f"set {API_KEYS_ENV} or --api-key-file to require keys"
        )
    where = (
        "" if not loopback_default_off else f" (serve runs without keys only on loopback, not {args.host})"
    )
    raise ValueError(
        f"no API keys configured: set {API_KEYS_ENV} or --api-key-file, or pass --no-auth{where}"
    )


def gateway_config(
    args: argparse.Namespace, api_keys: list[str] | None, tokenizer: str | None
) -> GatewayConfig:
    config = GatewayConfig(
        host=args.host,
        port=args.port,
        model_name=args.model_name,
        tokenizer=tokenizer,
        api_keys=api_keys,
        admin_key=os.environ.get(ADMIN_KEY_ENV) or None,
        max_queue=args.max_queue,
        max_concurrency_per_engine=args.max_concurrency_per_engine,
        batch_window_ms=args.batch_window_ms,
        max_batch=args.max_batch,
        max_body_bytes=args.max_body_bytes,
        max_n=args.max_n,
        health_interval_s=args.health_interval_s,
        drain_timeout_s=default_drain_timeout_s() if args.drain_timeout_s is None else args.drain_timeout_s,
        request_read_timeout_s=args.request_read_timeout_s,
        stream_idle_timeout_s=(
            env_seconds(STREAM_IDLE_TIMEOUT_ENV, DEFAULT_STREAM_IDLE_TIMEOUT_S)
            if args.stream_idle_timeout_s is None
            else args.stream_idle_timeout_s
        ),
    )
    config.validate()
    return config


def _say(line: str) -> None:
    print(f"[hintserve] {line}", file=sys.stderr, flush=True)


def _drain_on_signals(gateway: Any, server: Any) -> None:
    """SIGTERM / SIGINT start the graceful drain (a second one cuts the streams still running and stops)."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()

    def drain() -> None:
        task = loop.create_task(gateway.drain_and_stop(server))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, drain)


def _setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="[hintserve] %(levelname)s %(name)s: %(message)s")


# --- hintserve gateway ----------------------------------------------------------------------------


def run_gateway(args: argparse.Namespace) -> int:
    addresses = parse_engine_addresses(args.engines)
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        raise FileNotFoundError(f"--tokenizer directory not found: {args.tokenizer}")
    api_keys, auth_line = resolve_auth(args, loopback_default_off=False)
    config = gateway_config(args, api_keys, args.tokenizer)
    from services.gateway.server import bind_socket

    sock = bind_socket(config.host, config.port)
    _setup_logging()
    asyncio.run(_run_gateway(config, addresses, auth_line, sock, args.discover_engines))
    return 0


async def _run_gateway(
    config: GatewayConfig, addresses: list[str], auth_line: str, sock: Any, discover: bool
) -> None:
    from services.engine.grpc_client import EngineClient
    from services.gateway.engine_discovery import EngineDiscovery
    from services.gateway.server import Gateway, HTTPServer

    gateway = Gateway(config, [EngineClient(a) for a in addresses])
    if discover:
        gateway.discovery = EngineDiscovery(gateway.pool, addresses, EngineClient, config.health_interval_s)
    server = HTTPServer(gateway.app, config.host, sock=sock, read_timeout_s=config.request_read_timeout_s)
    _drain_on_signals(gateway, server)
    await server.start()
    healthy = len(gateway.pool.healthy_engines)
    _say(auth_line)
    _say(
        f"gateway serving {gateway.served_model_name or '(model unknown until an engine answers)'} at "
        f"{server.url}/v1 ({healthy}/{len(addresses)} engines healthy)"
    )
    await server.serve_forever()
    _say("gateway stopped")


# --- hintserve serve ------------------------------------------------------------------------------


def run_serve(args: argparse.Namespace) -> int:
    from services.engine.cli import engine_config

    api_keys, auth_line = resolve_auth(args, loopback_default_off=True)  # before loading the model
    config = gateway_config(args, api_keys, args.model)
    check_metrics_port(args.metrics_port)
    engine_cfg = engine_config(args)  # FileNotFoundError / ValueError with one line
    from services.gateway.server import bind_socket

    sock = bind_socket(config.host, config.port)  # a busy port fails before the model loads
    _setup_logging()
    return asyncio.run(_run_serve(config, engine_cfg, auth_line, sock, (args.metrics_host, args.metrics_port)))


async def _run_serve(
    config: GatewayConfig, engine_cfg: Any, auth_line: str, sock: Any, metrics_at: tuple[str, int]
) -> int:
    from services.engine.cli import load_engine, start_engine, start_engine_metrics, until_stopped_or_dead
    from services.gateway.engine_client import InProcessEngineClient
    from services.gateway.server import Gateway, HTTPServer

    # A policy that uses prediction hints (hintserve, finemoe, moe-infinity) starts the predictor inside the
    # engine, on the in-process broker unless --redis-url is given: all services in this one process.
    engine = load_engine(engine_cfg)
    await start_engine(engine)
    metrics = start_engine_metrics(engine, *metrics_at)
    try:
        gateway = Gateway(config, [InProcessEngineClient(engine)])
        server = HTTPServer(gateway.app, config.host, sock=sock, read_timeout_s=config.request_read_timeout_s)
        _drain_on_signals(gateway, server)
        await server.start()
        _say(auth_line)
        _say(f"serving {gateway.served_model_name} with the OpenAI API at {server.url}/v1 (Ctrl-C to stop)")
        stop = asyncio.Event()
        watch = asyncio.ensure_future(until_stopped_or_dead(stop, engine))
        watch.add_done_callback(lambda _: server.request_exit())  # the engine died: stop serving
        await server.serve_forever()
        stop.set()
        _say("shutting down")
        return await watch
    finally:
        if metrics is not None:
            metrics.close()
        await engine.shutdown()
