"""`python -m loadgen replay|poisson ...`: builds a ReplayConfig, runs it, prints vLLM's result table."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import NoReturn

from loadgen.metrics import format_table
from loadgen.replay import ReplayConfig, arun_replay


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (its default prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000 (/v1/completions is added)")
    p.add_argument("--model", required=True, help="model name sent in requests; a local dir also gives the tokenizer")
    p.add_argument("--duration", type=_positive_float, help="send window in seconds (in-flight requests finish)")
    p.add_argument("--max-context", type=int, help="clip input+output to this many tokens (input first)")
    p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    p.add_argument("--prompts", default="auto", help="sharegpt | synthetic | FILE (ShareGPT JSON or text); "
                   "auto: sharegpt if ../shared/data/prompts is there, else synthetic")
    p.add_argument("--tokenizer", help="local HF tokenizer dir for exact prompt lengths (default: --model if it is "
                   "a local dir, else an approximation)")
    p.add_argument("--no-special-tokens", action="store_true",
                   help="count prompt tokens without BOS etc. (servers that tokenize with add_special_tokens=False)")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token ($OPENAI_API_KEY)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=_positive_float, default=600.0, help="per request, seconds")
    p.add_argument("--json", dest="json_path", help="write the result JSON here")
    p.add_argument("--csv", dest="csv_path", help="write one row per request here")
    p.add_argument("--plot", dest="plot_path", help="write the latency CDF PNG here")
    p.add_argument("--label", help="legend label in the plot (default: the model)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m loadgen", description="Load generator for OpenAI-compatible LLM servers.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    replay = sub.add_parser("replay", help="replay an Azure LLM inference trace (or a CSV in its format)")
    replay.add_argument("--trace", default="conv", help="conv | code | FILE (TIMESTAMP,ContextTokens,GeneratedTokens)")
    replay.add_argument("--speedup", type=_positive_float, default=1.0, help="divide trace times by this")
    replay.add_argument("--start-offset", type=float, default=0.0, help="skip this many trace seconds first")
    replay.add_argument("--max-requests", type=int, help="send at most this many requests")
    _common(replay)
    poisson = sub.add_parser("poisson", help="Poisson arrivals with fixed input/output lengths")
    poisson.add_argument("--rate", type=_positive_float, required=True, help="requests per second (inf: all at once)")
    poisson.add_argument("--num-requests", type=int, help="requests to send (default 100 unless --duration)")
    poisson.add_argument("--input-len", type=int, default=128)
    poisson.add_argument("--output-len", type=int, default=64)
    _common(poisson)
    return parser


def config_from_args(args: argparse.Namespace) -> ReplayConfig:
    shared = dict(
        url=args.url, model=args.model, duration=args.duration, max_context=args.max_context,
        max_concurrency=args.max_concurrency, prompts=args.prompts, tokenizer=args.tokenizer,
        count_special_tokens=not args.no_special_tokens, goodput=args.goodput or [], api_key=args.api_key,
        seed=args.seed, request_timeout=args.request_timeout, json_path=args.json_path, csv_path=args.csv_path,
        plot_path=args.plot_path, progress=not args.no_progress, label=args.label,
    )
    if args.command == "replay":
        return ReplayConfig(workload="trace", trace=args.trace, speedup=args.speedup,
                            start_offset=args.start_offset, max_requests=args.max_requests, **shared)
    num = args.num_requests if args.num_requests is not None or args.duration else 100
    return ReplayConfig(workload="poisson", rate=args.rate, num_requests=num, input_len=args.input_len,
                        output_len=args.output_len, **shared)


async def _run_interruptible(cfg: ReplayConfig) -> dict:
    """Ctrl-C stops the run with a partial report; a second Ctrl-C aborts as usual."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        print("\ninterrupted: stopping, partial report follows (Ctrl-C again to abort)", file=sys.stderr)
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError):  # not the main thread / not supported: plain Ctrl-C
        pass
    try:
        return await arun_replay(cfg, stop)
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = f"python -m loadgen {args.command}"
    try:
        cfg = config_from_args(args)
        cfg.validate()
        result = asyncio.run(_run_interruptible(cfg))
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(format_table(result))
    return 130 if result["interrupted"] else 0
