"""`hintserve trace collect` and `hintserve predictor train|eval|bench-search`.

`predictor` is a subparser group. The predictor *service* (`hintserve predictor --redis-url ...`) belongs to
another module: it can either register after this one and reuse the group (`subparsers.choices["predictor"]`,
add its flags and `set_defaults(func=...)` so the bare command runs the service), or own the group itself and
call `add_predictor_subcommands(nested_subparsers)`; `register` then adds train/eval/bench-search to the
existing group instead of creating a second one. Without a service, bare `hintserve predictor` exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

ALL = "all"


def register(subparsers: Any) -> None:
    trace = subparsers.add_parser("trace", help="record or inspect routing traces")
    tsub = trace.add_subparsers(dest="trace_command", required=True)
    collect = tsub.add_parser("collect", help="greedy-decode prompts with our engine and record routing traces")
    collect.add_argument("--model", required=True, help="model directory")
    collect.add_argument("--prompts", required=True, action="append",
                         help="jsonl (question/prompt fields) or txt (one per line); repeatable")
    collect.add_argument("--out", required=True, help="output trace directory (index.json + trace.npz)")
    collect.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    collect.add_argument("--batch", type=int, default=8, help="requests decoded together (default 8)")
    collect.add_argument("--limit", type=int, default=None, help="use the first N prompts of each file")
    collect.add_argument("--layer-inputs", action="store_true",
                         help="also store every token's MoE-block input (learned gate, skip-gate)")
    collect.set_defaults(func=run_collect)

    group = subparsers.choices.get("predictor")
    if group is None:
        group = subparsers.add_parser("predictor", help="expert predictors: train, evaluate, benchmark")
    nested = next((a for a in group._actions if isinstance(a, argparse._SubParsersAction)), None)
    if nested is None:
        nested = group.add_subparsers(dest="predictor_command", metavar="{train,eval,bench-search}")
    add_predictor_subcommands(nested)
    if group.get_default("func") is None:
        group.set_defaults(func=_no_subcommand)


def add_predictor_subcommands(sub: Any) -> None:
    train = sub.add_parser("train", help="train DuoServe's ExpertMLP on a trace (held-out split by request)")
    train.add_argument("--trace", required=True, help="trace directory or routing file")
    train.add_argument("--out", required=True, help="output model file (.pt)")
    train.add_argument("--epochs", type=int, default=20)
    train.add_argument("--max-seconds", type=float, default=50.0, help="stop after this long (default 50)")
    train.add_argument("--holdout", type=float, default=0.1, help="held-out fraction of requests (default 0.1)")
    train.add_argument("--width", type=int, default=2048, help="first hidden width (default 2048, halves to 64)")
    train.add_argument("--seed", type=int, default=0)
    train.set_defaults(func=run_train)

    ev = sub.add_parser("eval", help="score predictors on a train/test split by request")
    ev.add_argument("--train", action="append", required=True, help="training trace (repeatable)")
    ev.add_argument("--test", required=True, help="test trace (split by request if also a --train)")
    ev.add_argument("--predictors", default=ALL, help="comma-separated names or 'all'")
    ev.add_argument("--distance", default="1,2,3,4", help="prefetch distances (default 1,2,3,4)")
    ev.add_argument("--budget", type=int, default=None, help="experts fetched per layer (default top-k)")
    ev.add_argument("--layer-ms", type=float, default=1.0, help="time of one layer (GoodPred timing model)")
    ev.add_argument("--expert-ms", type=float, default=0.5, help="time to move one expert over the link")
    ev.add_argument("--predict-ms", default="0.2", help="predictor latency in the timing model, or 'measured'")
    ev.add_argument("--folds", type=int, default=1, help="k-fold by request when test is also a train trace")
    ev.add_argument("--test-fraction", type=float, default=0.25, help="test share of requests when --folds 1")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--include-prefill", action="store_true", help="also score prefill iterations")
    ev.add_argument("--offline", action="store_true",
                    help="do not observe test iterations (ablation: no within-request / online memory)")
    ev.add_argument("--json", required=True, help="output JSON; .md and .png are written next to it")
    ev.add_argument("--title", default=None)
    ev.set_defaults(func=run_eval_command)

    bench = sub.add_parser("bench-search", help="expert-map search latency (FineMoE map store)")
    bench.add_argument("--capacity", default="1000,10000", help="map store sizes (default 1000,10000)")
    bench.add_argument("--layers", type=int, default=32)
    bench.add_argument("--experts", type=int, default=8)
    bench.add_argument("--hidden", type=int, default=4096, help="embedding size (semantic keys)")
    bench.add_argument("--queries", type=int, default=3000)
    bench.add_argument("--json", default=None)
    bench.set_defaults(func=run_bench_search)


def _no_subcommand(args: argparse.Namespace) -> int:
    raise ValueError("choose a subcommand: train, eval or bench-search (see hintserve predictor --help)")


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"--{name} must be positive, got {value}")


def _single_thread() -> None:
    import torch

    torch.set_num_threads(1)  # the predictors' networks are small: intra-op threads only add overhead


def run_collect(args: argparse.Namespace) -> int:
    from services.predictor.traces import collect_traces, read_prompts, save_traces

    for name in ("max_tokens", "batch"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise FileNotFoundError(f"no model (config.json) in {args.model}")
    if args.limit is not None:
        _positive("limit", args.limit)
    prompts = []
    for path in args.prompts:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"prompts file not found: {path}")
        prompts += read_prompts(path, args.limit)
    trace = collect_traces(args.model, prompts, args.max_tokens, args.batch, args.layer_inputs)
    save_traces(trace, args.out)
    print(f"[hintserve] {len(trace.requests)} requests, {trace.num_iterations} iterations, {trace.num_layers} MoE "
          f"layers x {trace.num_experts} experts -> {args.out}", file=sys.stderr)
    return 0


def run_train(args: argparse.Namespace) -> int:
    from services.predictor.train import train_from_trace

    _positive("epochs", args.epochs)
    _positive("max-seconds", args.max_seconds)
    if not 0 < args.holdout < 1:
        raise ValueError(f"--holdout must be in (0, 1), got {args.holdout}")
    _single_thread()
    report = train_from_trace(args.trace, args.out, args.epochs, args.max_seconds, args.holdout, args.seed, args.width)
    last = min(report["epochs"], key=lambda e: e["heldout_bce"])
    print(f"[hintserve] expert-mlp: {report['train_samples']} samples ({report['train_requests']} requests), "
          f"held-out {report['heldout_requests']} requests: BCE {last['heldout_bce']:.4f}, top-k recall "
          f"{last['heldout_topk_recall']:.3f} (epoch {last['epoch']}) -> {args.out}", file=sys.stderr)
    return 0


def _eval_config(args: argparse.Namespace):
    from services.predictor.eval import EvalConfig

    try:
        distances = [int(d) for d in args.distance.split(",") if d]
    except ValueError:
        raise ValueError(f"--distance must be comma-separated integers, got {args.distance!r}") from None
    if not distances or any(d < 1 for d in distances):
        raise ValueError(f"--distance values must be >= 1, got {args.distance!r}")
    if args.budget is not None:
        _positive("budget", args.budget)
    _positive("layer-ms", args.layer_ms)
    _positive("expert-ms", args.expert_ms)
    _positive("folds", args.folds)
    if not 0 < args.test_fraction < 1:
        raise ValueError(f"--test-fraction must be in (0, 1), got {args.test_fraction}")
    predict_ms = None if args.predict_ms == "measured" else float(args.predict_ms)
    return EvalConfig(distances, args.budget, args.layer_ms, args.expert_ms, predict_ms, args.seed,
                      args.test_fraction, args.folds, args.include_prefill, online=not args.offline)


def run_eval_command(args: argparse.Namespace) -> int:
    from services.predictor.eval import markdown_report, run_eval, write_report
    from services.predictor.predictors import PREDICTORS, predictor_class
    from services.predictor.traces import load_traces

    cfg = _eval_config(args)
    names = list(PREDICTORS) if args.predictors == ALL else [p for p in args.predictors.split(",") if p]
    for name in names:
        predictor_class(name)  # unknown names fail before any trace is loaded
    paths = [os.path.normpath(p) for p in args.train]
    test_path = os.path.normpath(args.test)
    loaded = {p: load_traces(p) for p in dict.fromkeys(paths + [test_path])}
    _single_thread()
    payload = run_eval([loaded[p] for p in paths], paths, loaded[test_path], test_path, names, cfg)
    title = args.title or f"Expert prediction on {os.path.basename(test_path)}"
    written = write_report(payload, args.json, title)
    print(markdown_report({**payload}, title))
    print(f"[hintserve] wrote {', '.join(written)}", file=sys.stderr)
    return 0


def run_bench_search(args: argparse.Namespace) -> int:
    from services.predictor.predictors.expert_map import bench_search

    capacities = [int(c) for c in args.capacity.split(",") if c]
    for value, name in ((min(capacities, default=0), "capacity"), (args.layers, "layers"), (args.experts, "experts"),
                        (args.hidden, "hidden"), (args.queries, "queries")):
        _positive(name, value)
    results = [bench_search(c, args.layers, args.experts, args.hidden, args.queries) for c in capacities]
    for r in results:
        print(f"C={r['capacity']:>6}  wall p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  |  CPU p50 "
              f"{r['cpu_p50_ms']:.3f} ms  p99 {r['cpu_p99_ms']:.3f} ms  (wall p99: semantic "
              f"{r['semantic_p99_ms']:.3f}, trajectory {r['trajectory_p99_ms']:.3f})")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", file=sys.stderr)
    if args.json:
        from services.common.report import run_header, write_json

        write_json(args.json, {**run_header(), "layers": args.layers, "experts": args.experts,
                               "hidden": args.hidden, "load_average": os.getloadavg()[0], "results": results})
    return 0
