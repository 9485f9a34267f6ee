"""`hintserve bench ...`: the benchmarks behind every figure the docs quote."""

from __future__ import annotations

import argparse
import os

from services.bench import cli_cpu
from services.bench.cli_args import expert_dtypes, fractions, numbers, parse_policies, require_model
from services.engine.expert_format import DEFAULT_GROUP_SIZE, GROUP_SIZES


def _engine(args: argparse.Namespace) -> int:
    from services.bench.engine_bench import run_engine_bench

    require_model(args.model)
    if args.repeats < 1 or args.new_tokens < 2:
        raise ValueError("--repeats must be >= 1 and --new-tokens >= 2")
    run_engine_bench(args.model, args.json, args.repeats, args.new_tokens, args.prompt_len, args.prefill_len, args.dtype)
    return 0


def _gateway(args: argparse.Namespace) -> int:
    from services.bench.gateway_bench import run_gateway_bench

    require_model(args.model)
    if args.concurrency < 1 or args.rounds < 1 or args.max_tokens < 2 or args.prompt_words < 1:
        raise ValueError("--concurrency, --rounds and --prompt-words must be >= 1 and --max-tokens >= 2")
    if not 0 <= args.batch_window_ms <= 1000:
        raise ValueError(f"--batch-window-ms must be in [0, 1000], got {args.batch_window_ms}")
    run_gateway_bench(
        args.model, args.json, args.concurrency, args.max_tokens, args.prompt_words, args.rounds, args.batch_window_ms
    )
    return 0


def _offload(args: argparse.Namespace) -> int:
    from services.bench.offload_bench import run_offload_bench

    require_model(args.model)
    policies = parse_policies(args.policies)
    if "resident" not in policies:
        policies.insert(0, "resident")  # the reference every other policy is compared against
    if args.new_tokens < 2 or args.repeats < 1:
        raise ValueError("--new-tokens must be >= 2 and --repeats >= 1")
    run_offload_bench(
        args.model, policies, fractions(args.cache), numbers(args.link_ratio, float),
        numbers(args.batch, int), args.json, args.plot, args.new_tokens, args.repeats, args.device, args.link,
        expert_dtypes(args.expert_dtypes), args.expert_group_size, args.hot_set_from,
    )
    return 0


def _online(args: argparse.Namespace) -> int:
    from services.bench.online_bench import run_online_bench

    require_model(args.model)
    policies = parse_policies(args.policies)
    slos = {k: float(v) for k, v in (item.split(":") for item in args.goodput)}
    run_online_bench(args.model, policies, args.json, args.duration, args.speedup, args.max_context,
                     fractions(args.cache)[0], numbers(args.link_ratio, float)[0], slos, args.prompts)
    return 0


def _itl_target(args: argparse.Namespace) -> int:
    from services.bench.itl_bench import run_itl_bench

    require_model(args.model)
    targets = [None if t == "none" else float(t) for t in args.targets.split(",") if t]
    if not targets or any(t is not None and t <= 0 for t in targets):
        raise ValueError(f"--targets: comma-separated milliseconds > 0 or none; got {args.targets!r}")
    run_itl_bench(args.model, targets, args.json, args.rate, args.duration, args.input_len, args.output_len,
                  args.serve_args)
    return 0


def _quant(args: argparse.Namespace) -> int:
    from services.bench.quant_bench import run_quant_bench

    require_model(args.model)
    dtypes = list(expert_dtypes(args.expert_dtypes))
    groups = numbers(args.group_sizes, int)
    if any(g not in GROUP_SIZES for g in groups):
        raise ValueError(f"--group-sizes must be among {', '.join(map(str, GROUP_SIZES))}; got {args.group_sizes!r}")
    if args.prompts < 1 or args.new_tokens < 1 or args.prompt_len < 1:
        raise ValueError("--prompts, --new-tokens and --prompt-len must be >= 1")
    for row in run_quant_bench(args.model, dtypes, groups, args.json, args.prompts, args.new_tokens,
                               args.prompt_len):
        print(row)
    return 0


def _vs_vllm(args: argparse.Namespace) -> int:
    from services.bench.vs_vllm import Workload, run_vs_vllm

    require_model(args.model)
    if args.vllm_python is not None and not os.path.isfile(args.vllm_python):
        raise FileNotFoundError(f"--vllm-python: no such interpreter {args.vllm_python}")
    if args.input_len < 1 or args.output_len < 2 or args.prompts_per_concurrency < 1 or args.rounds < 1:
        raise ValueError("--input-len, --prompts-per-concurrency and --rounds must be >= 1 and --output-len >= 2")
    load = Workload(args.input_len, args.output_len, args.prompts_per_concurrency)
    run_vs_vllm(args.model, args.vllm_python, numbers(args.concurrency, int), args.json, load, args.rounds)
    return 0


def _prefill(args: argparse.Namespace) -> int:
    from services.bench.prefill_bench import run_prefill_bench

    require_model(args.model)
    budgets = numbers(args.budgets, int)
    if args.long_tokens < 2 or min(args.prefix_tokens, args.threads, args.running, args.running_context) < 1:
        raise ValueError("--long-tokens must be at least 2, --prefix-tokens, --threads, --running and "
                         "--running-context at least 1")
    engine = {"dtype": "float32", "expert_dtype": args.expert_dtype, "weight_dtype": args.weight_dtype,
              "threads": args.threads}
    result = run_prefill_bench(args.json, args.model, engine, budgets, args.long_tokens, args.prefix_tokens,
                               running=args.running, running_context=args.running_context)
    print(f"wrote {args.json} ({len(result['chunking'])} budgets; prefix caching off and on)")
    return 0


def _all(args: argparse.Namespace) -> int:
    from services.bench.suite import run_all

    require_model(args.model)
    print(f"report: {run_all(args.model, args.out, args.run_command, args.quick)}")
    return 0


def _hints(args: argparse.Namespace) -> int:
    from services.bench.hints_bench import run_hints_bench
    from services.common.messages import Shape

    shape = Shape("bench", args.layers, args.experts, args.top_k, args.hidden)
    shape.validate()
    if args.steps < 1 or args.interval_ms < 0 or args.horizon < 0:
        raise ValueError("--steps must be >= 1, --interval-ms and --horizon >= 0")
    run_hints_bench(args.redis_url, args.predictor, shape, numbers(args.batch, int), args.steps,
                    args.interval_ms, args.horizon, args.json)
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

    offload = kinds.add_parser("offload", help="every offload policy on the same prompts: TTFT, TPOT, hit rate")
    offload.add_argument("--model", default="models/demo-moe")
    offload.add_argument("--policies", default="all", help="comma-separated policy names, or all")
    offload.add_argument("--cache", default="25%", help="expert cache sizes, e.g. 10%%,25%%,50%%")
    offload.add_argument("--link-ratio", default="30", help="emulated link ratios, e.g. 10,30,100")
    offload.add_argument("--batch", default="1,4,16", help="concurrent requests, e.g. 1,4,16")
    offload.add_argument("--new-tokens", type=int, default=32)
    offload.add_argument("--repeats", type=int, default=1, help="runs per case; figures are medians")
    offload.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    offload.add_argument("--link", default="emulated", choices=("emulated", "native"),
                         help="native: the CUDA copy engine (the ratio is then ignored)")
    offload.add_argument("--expert-dtypes", default="auto",
                         help="rows per expert storage, e.g. bf16,int8,int4 (not auto: the cache is sized in bytes)")
    offload.add_argument("--expert-group-size", type=int, choices=GROUP_SIZES, default=DEFAULT_GROUP_SIZE)
    offload.add_argument("--hot-set-from", default="warmup", choices=("warmup", "measured"),
                         help="prompts whose routing the static hot sets (ktransformers, fiddler) are counted on: "
                              "the warm-up ones (a calibration set, as those systems profile) or the measured "
                              "ones themselves (an oracle hot set)")
    offload.add_argument("--json", default="bench/results/offload.json")
    offload.add_argument("--plot", default=None, help="PNG of TPOT per policy (default: next to --json)")
    offload.set_defaults(func=_offload)

    online = kinds.add_parser("online", help="hintserve serve replaying the Azure conv trace, once per policy")
    online.add_argument("--model", default="models/demo-moe")
    online.add_argument("--policies", default="all")
    online.add_argument("--duration", type=float, default=60.0, help="replayed seconds per policy")
    online.add_argument("--speedup", type=float, default=0.4, help="trace time scale (what 2 cores can serve)")
    online.add_argument("--max-context", type=int, default=256)
    online.add_argument("--cache", default="25%")
    online.add_argument("--link-ratio", default="30")
    online.add_argument("--goodput", nargs="+", default=["ttft:300", "tpot:50"], help="SLOs, e.g. ttft:2000")
    online.add_argument("--prompts", default="auto", help="sharegpt | synthetic | FILE, as loadgen's; auto: "
                        "sharegpt if ../shared/data/prompts is beside the checkout, else synthetic (the JSON says which)")
    online.add_argument("--json", default="bench/results/online.json")
    online.set_defaults(func=_online)

    itl = kinds.add_parser("itl-target", help="long prompts arriving while others stream, per --itl-target-ms")
    itl.add_argument("--model", default="models/demo-moe")
    itl.add_argument("--targets", default="none,250", help="ms per setting, none: no target")
    itl.add_argument("--rate", type=float, default=0.2, help="requests/s (Poisson)")
    itl.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per setting")
    itl.add_argument("--input-len", type=int, default=1500)
    itl.add_argument("--output-len", type=int, default=64)
    itl.add_argument("--serve-args", default="", help="more hintserve serve flags, e.g. '--expert-dtype int4'")
    itl.add_argument("--json", default="bench/results/itl_target.json")
    itl.set_defaults(func=_itl_target)

    hints = kinds.add_parser("hints", help="hint delivery latency engine -> predictor -> engine over Redis")
    hints.add_argument("--redis-url", default="redis://127.0.0.1:6379")
    hints.add_argument("--predictor", default="previous-token", help="the service's predictor")
    hints.add_argument("--layers", type=int, default=32, help="model shape (default Mixtral-8x7B)")
    hints.add_argument("--experts", type=int, default=8)
    hints.add_argument("--top-k", type=int, default=2)
    hints.add_argument("--hidden", type=int, default=4096)
    hints.add_argument("--horizon", type=int, default=0, help="layers hinted per context (0: all)")
    hints.add_argument("--batch", default="1,8", help="requests per step, e.g. 1,8")
    hints.add_argument("--steps", type=int, default=1000, help="measured steps per batch size")
    hints.add_argument("--interval-ms", type=float, default=5.0, help="decode step period")
    hints.add_argument("--json", default="bench/results/hints.json")
    hints.set_defaults(func=_hints)

    quant = kinds.add_parser("quant", help="int8/int4 experts: validation perplexity and greedy agreement")
    quant.add_argument("--model", default="models/demo-moe")
    quant.add_argument("--expert-dtypes", default="auto,bf16,int8,int4", help="first one is the reference")
    quant.add_argument("--group-sizes", default="128,64,32", help="int4 group sizes (int8 is per row)")
    quant.add_argument("--prompts", type=int, default=20)
    quant.add_argument("--new-tokens", type=int, default=32)
    quant.add_argument("--prompt-len", type=int, default=32, help="tokens of each prompt (cut from the split)")
    quant.add_argument("--json", default="bench/results/quant.json")
    quant.set_defaults(func=_quant)

    vs_vllm = kinds.add_parser("vs-vllm", help="hintserve serve vs vLLM's server, both driven by vLLM's client")
    vs_vllm.add_argument("--model", default="models/demo-moe")
    vs_vllm.add_argument("--vllm-python", default=None,
                         help="interpreter with vllm installed (e.g. /root/vllm-venv/bin/python); without it, "
                              "hintserve alone with our loadgen")
    vs_vllm.add_argument("--concurrency", default="1,16,32", help="concurrent requests, e.g. 1,16,32")
    vs_vllm.add_argument("--input-len", type=int, default=128)
    vs_vllm.add_argument("--output-len", type=int, default=64)
    vs_vllm.add_argument("--prompts-per-concurrency", type=int, default=4,
                         help="requests per run: max(16, concurrency x this)")
    vs_vllm.add_argument("--rounds", type=int, default=3,
                         help="rounds of every concurrency on each server, order flipped each round; medians reported")
    vs_vllm.add_argument("--json", default="bench/results/vs_vllm.json")
    vs_vllm.set_defaults(func=_vs_vllm)

    prefill = kinds.add_parser("prefill", help="long prompts in chunks beside a running request; prompts "
                               "sharing a prefix with prefix caching off and on")
    prefill.add_argument("--model", required=True, help="HF folder")
    prefill.add_argument("--budgets", default="2048,512,256", help="--max-num-batched-tokens values to compare")
    prefill.add_argument("--long-tokens", type=int, default=1900, help="the long prompt's tokens")
    prefill.add_argument("--prefix-tokens", type=int, default=480, help="the prefix the cached prompts share")
    prefill.add_argument("--running", type=int, default=1, help="requests decoding when the long prompt arrives")
    prefill.add_argument("--running-context", type=int, default=16, help="the decoding requests' prompt tokens")
    prefill.add_argument("--expert-dtype", choices=("auto", "bf16", "int8", "int4"), default="auto")
    prefill.add_argument("--weight-dtype", choices=("auto", "fp32", "bf16", "int8", "int4"), default="auto")
    prefill.add_argument("--threads", type=int, default=1)
    prefill.add_argument("--json", default="bench/results/prefill.json")
    prefill.set_defaults(func=_prefill)

    cli_cpu.register(kinds)

    suite = kinds.add_parser("all", help="every benchmark, then bench/results/REPORT.md")
    suite.add_argument("--model", default="models/demo-moe")
    suite.add_argument("--out", default="bench/results")
    suite.add_argument("--quick", action="store_true", help="fewer cases and repeats")
    suite.set_defaults(func=_all)
