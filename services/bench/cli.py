"""`hintserve bench ...`: the benchmarks behind every figure the README quotes."""

from __future__ import annotations

import argparse
import os


def _engine(args: argparse.Namespace) -> int:
    from services.bench.engine_bench import run_engine_bench

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise FileNotFoundError(f"no model (config.json) in {args.model}")
    if args.repeats < 1 or args.new_tokens < 2:
        raise ValueError("--repeats must be >= 1 and --new-tokens >= 2")
    run_engine_bench(args.model, args.json, args.repeats, args.new_tokens, args.prompt_len, args.prefill_len, args.dtype)
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from services.bench.gateway_bench import run_gateway_bench

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise FileNotFoundError(f"no model (config.json) in {args.model}")
    if args.concurrency < 1 or args.rounds < 1 or args.max_tokens < 2 or args.prompt_words < 1:
        raise ValueError("--concurrency, --rounds and --prompt-words must be >= 1 and --max-tokens >= 2")
    if not 0 <= args.batch_window_ms <= 1000:
        raise ValueError(f"--batch-window-ms must be in [0, 1000], got {args.batch_window_ms}")
    run_gateway_bench(
        args.model, args.json, args.concurrency, args.max_tokens, args.prompt_words, args.rounds, args.batch_window_ms
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="run a benchmark")
    kinds = bench.add_subparsers(dest="bench", required=True)
    engine = kinds.add_parser("engine", help="decode/prefill throughput vs transformers generate()")
    engine.add_argument("--model", default="models/demo-moe")
    engine.add_argument("--json", default="bench/results/engine.json")
    engine.add_argument("--repeats", type=int, default=3)
    engine.add_argument("--new-tokens", type=int, default=64)
    engine.add_argument("--prompt-len", type=int, default=64)
    engine.add_argument("--prefill-len", type=int, default=256)
    engine.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    engine.set_defaults(func=_engine)

    gateway = kinds.add_parser("gateway", help="gateway overhead: TTFT vs the engine's own, CPU per token/s")
    gateway.add_argument("--model", default="models/demo-moe")
    gateway.add_argument("--json", default="bench/results/gateway.json")
    gateway.add_argument("--concurrency", type=int, default=64, help="simultaneous streaming requests")
    gateway.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    gateway.add_argument("--prompt-words", type=int, default=48, help="prompt length in words")
    gateway.add_argument("--rounds", type=int, default=3, help="measured rounds (after one warm-up round)")
    gateway.add_argument("--batch-window-ms", type=float, default=2.0, help="the gateway's batch window")
    gateway.set_defaults(func=_gateway)
