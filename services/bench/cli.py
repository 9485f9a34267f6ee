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
