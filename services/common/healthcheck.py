"""Container health probe: `python -m services.common.healthcheck --http URL | --engine HOST:PORT`.

Exit 0 when healthy, 1 otherwise (one line on stderr saying why). Docker HEALTHCHECKs, compose
healthchecks and Kubernetes exec probes all call this one module, so "healthy" means the same everywhere:
an HTTP endpoint answering 2xx (gateway /ready, predictor /metrics), or an engine answering SERVING to its
Health RPC (the model is loaded and the step loop runs). Imports neither torch nor the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import urllib.error
import urllib.request


def check_http(url: str, timeout_s: float) -> str | None:
    """None if `url` answers 2xx, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return None if 200 <= response.status < 300 else f"HTTP {response.status}"
    except (urllib.error.URLError, OSError) as exc:
        return str(exc)


async def check_engine(address: str, timeout_s: float) -> str | None:
    """None if the engine at `address` reports SERVING, else why not."""
    import grpc

    from services.common.protos import engine_pb2, engine_pb2_grpc
    from services.common.rpc_errors import describe_error

    async with grpc.aio.insecure_channel(address) as channel:
        try:
            call = engine_pb2_grpc.EngineStub(channel).Health(engine_pb2.HealthRequest())
            response = await asyncio.wait_for(call, timeout_s)
        except Exception as exc:  # unreachable, timed out, not an engine: all unhealthy
            return describe_error(exc)
    return None if response.status == engine_pb2.HealthResponse.SERVING else "engine reports NOT_SERVING"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.common.healthcheck")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--http", metavar="URL", help="healthy when URL answers 2xx")
    target.add_argument("--engine", metavar="HOST:PORT", help="healthy when the engine's Health is SERVING")
    parser.add_argument("--timeout-s", type=float, default=3.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.http:
        problem = check_http(args.http, args.timeout_s)
    else:
        problem = asyncio.run(check_engine(args.engine, args.timeout_s))
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
