"""`hintserve predictor --redis-url URL ...`: the standalone predictor service (stream loop, gRPC, /metrics).

If another module already registered a `predictor` command group (train / eval subcommands), the service
flags and the run function are added to that group, so `hintserve predictor --redis-url ...` runs the
service and `hintserve predictor train ...` still reaches its subcommand.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from typing import Any

from services.common.broker import CONTEXT_STREAM
from services.common.metrics_http import add_metrics_args

REDIS_URL_ENV = "HINTSERVE_REDIS_URL"
PREDICTOR_METRICS_PORT = 9464  # OpenTelemetry's Prometheus exporter port, free on most hosts


def register(subparsers: Any) -> None:
    parser = subparsers.choices.get("predictor")
    if parser is None:
        parser = subparsers.add_parser("predictor", help="run the predictor service (contexts in, hints out)")
    add_service_args(parser)
    parser.set_defaults(func=run_service)


def add_service_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("predictor service")
    g.add_argument("--redis-url", default=None, help=f"broker, redis://host:port (also: env {REDIS_URL_ENV})")
    g.add_argument("--engine-id", default=None, help="answer only these engines (comma-separated; default all)")
    g.add_argument("--predictor", default="expert-map", help="registry name or package.module:Class")
    g.add_argument("--snapshot-dir", default=None, help="snapshot here periodically and on SIGTERM; restore at start")
    g.add_argument("--snapshot-interval-s", type=float, default=60.0, help="0: only on shutdown")
    g.add_argument("--grpc-host", default="127.0.0.1")
    g.add_argument("--grpc-port", type=int, default=50061, help="0 picks a free port, -1 disables gRPC")
    add_metrics_args(g, default_port=PREDICTOR_METRICS_PORT, what="predictor")
    g.add_argument("--stream", default=CONTEXT_STREAM, help="the engines' context stream")
    g.add_argument("--group", default=None, help="consumer group (default hintserve-predictor[:engine ids])")
    g.add_argument("--consumer", default=None, help="consumer name in the group; keep it across restarts to resume")
    g.add_argument("--skip-backlog", action="store_true", help="a new group reads only new contexts, not the stream")
    g.add_argument("--max-context-age-ms", type=float, default=250.0, help="older contexts: observe, no hints")
    g.add_argument("--mass", type=float, default=0.9, help="hint the fewest experts covering this probability")
    g.add_argument("--max-experts", type=int, default=0, help="per hinted layer (0: 2 x top-k)")
    g.add_argument("--horizon", type=int, default=0, help="predict this many layers ahead (0: all)")
    g.add_argument("--max-models", type=int, default=8)
    g.add_argument("--max-requests", type=int, default=4096, help="live request histories per model")


def _validate(args: argparse.Namespace) -> str:
    url = args.redis_url or os.environ.get(REDIS_URL_ENV)
    if not url:
        raise ValueError(f"needs --redis-url (or {REDIS_URL_ENV}); without one the engine embeds the predictor")
    from services.common.broker import check_broker_url

    check_broker_url(url)
    for name in ("grpc_port", "metrics_port"):
        if not -1 <= getattr(args, name) <= 65535:
            raise ValueError(f"--{name.replace('_', '-')} must be in [-1, 65535]")
    if not 0 < args.mass <= 1 or args.max_context_age_ms <= 0 or args.snapshot_interval_s < 0:
        raise ValueError("--mass must be in (0, 1], --max-context-age-ms > 0, --snapshot-interval-s >= 0")
    if min(args.max_models, args.max_requests) < 1 or min(args.max_experts, args.horizon) < 0:
        raise ValueError("--max-models/--max-requests must be >= 1, --max-experts/--horizon >= 0")
    return url


def run_service(args: argparse.Namespace) -> int:
    url = _validate(args)
    from services.predictor.hub import resolve_predictor

    factory = resolve_predictor(args.predictor)  # unknown names fail before anything starts
    logging.basicConfig(level=logging.INFO, format="[hintserve] %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(args, url, factory))
    return 0


def _say(line: str) -> None:
    print(f"[hintserve] {line}", file=sys.stderr, flush=True)


async def _serve(args: argparse.Namespace, url: str, factory: Any) -> None:
    from services.common.broker import PREDICTOR_GROUP, make_broker
    from services.predictor.hub import PredictorHub, Selection
    from services.predictor.metrics import ServiceMetrics
    from services.predictor.server import serve_predictor
    from services.predictor.service import PredictorService
    from services.predictor.snapshots import Snapshotter

    selection = Selection(mass=args.mass, max_experts=args.max_experts, horizon=args.horizon)
    hub = PredictorHub(factory, args.predictor, selection, args.max_models, args.max_requests)
    snapshotter = None
    if args.snapshot_dir:
        from services.common.paths import check_writable_dir

        check_writable_dir(args.snapshot_dir, "--snapshot-dir")  # unusable: one line, exit 2, before serving
        snapshotter = Snapshotter(args.snapshot_dir, hub)
        restored = snapshotter.restore_all()
        _say(f"restored {len(restored)} model(s) from {args.snapshot_dir}: {[s.model for s in restored]}")
    broker = make_broker(url)
    metrics = ServiceMetrics()
    engines = set(args.engine_id.split(",")) if args.engine_id else None
    # A predictor answering only some engines reads in its own group: the shared one would hand it
    # other engines' contexts that its siblings then never see.
    group = args.group or (f"{PREDICTOR_GROUP}:{args.engine_id}" if engines else PREDICTOR_GROUP)
    service = PredictorService(
        broker, hub, consumer=args.consumer or f"predictor-{socket.gethostname()}", group=group, stream=args.stream,
        snapshotter=snapshotter,
        snapshot_interval_s=args.snapshot_interval_s, metrics=metrics,
        max_context_age_s=args.max_context_age_ms / 1000, engines=engines, start="$" if args.skip_backlog else "0",
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, service.stop)
    server = None
    try:
        parts = [f"predictor {args.predictor} consuming {service.stream} on {url} as {service.group}/{service.consumer}"]
        if args.grpc_port >= 0:
            server, port = await serve_predictor(service, args.grpc_host, args.grpc_port)
            parts.append(f"gRPC {args.grpc_host}:{port}")
        if args.metrics_port >= 0:
            parts.append(f"metrics http://{args.metrics_host}:{metrics.serve(args.metrics_port, args.metrics_host)}/metrics")
        _say("; ".join(parts))
        if not service.sealer.enabled:
            _say("broker messages are unsigned (HINTSERVE_BROKER_SECRET not set): any client that can write to "
                 "Redis is trusted as an engine")
        await service.run()  # until SIGTERM / SIGINT; snapshots on the way out
        _say("predictor stopped" + (f" (snapshot in {args.snapshot_dir})" if snapshotter else ""))
    finally:
        if server is not None:
            await server.stop(grace=1.0)
        metrics.close()
        await broker.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m services.predictor.service_cli ...`: the service without loading the engine's CLI (torch)."""
    parser = argparse.ArgumentParser(prog="hintserve predictor")
    add_service_args(parser)
    args = parser.parse_args(argv)
    try:
        return run_service(args)
    except ValueError as exc:
        print(f"hintserve predictor: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
