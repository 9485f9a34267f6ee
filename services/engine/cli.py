"""`hintserve engine` (serve gRPC) and `hintserve generate` (offline, in-process) subcommands."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
import time
import uuid
from typing import Any

from services.common.metrics_http import MetricsEndpoint, add_metrics_args, check_metrics_port
from services.engine.config import EngineConfig
from services.engine.expert_format import DEFAULT_GROUP_SIZE, EXPERT_DTYPES, GROUP_SIZES
from services.engine.sampling_params import SamplingParams

ENGINE_PORT = 50051  # gRPC's customary port


def register(subparsers: Any) -> None:
    serve = subparsers.add_parser("engine", help="serve a model over gRPC until SIGINT/SIGTERM")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=ENGINE_PORT, help="0 picks a free port")
    serve.add_argument("--no-auth", action="store_true",
                       help="serve gRPC without HINTSERVE_ENGINE_TOKEN on a non-loopback --host (explicit opt-out)")
    add_metrics_args(serve, default_port=-1, what="engine")
    serve.set_defaults(func=run_engine)

    gen = subparsers.add_parser("generate", help="generate text offline with an in-process engine")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]; 0 = off")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]; 0 = off")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1 = off")
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: when the tokenizer has one)",
    )
    gen.set_defaults(func=run_generate)


def add_engine_args(parser: argparse.ArgumentParser, model_default: str | None = None) -> None:
    """Flags for every EngineConfig knob; unset ones fall back to HINTSERVE_<FIELD>, then defaults."""
    from services.engine.offload.eviction import EVICTION_POLICIES
    from services.engine.offload.policies import POLICIES

    if model_default is None:
        parser.add_argument("--model", required=True, help="model directory (config.json, weights, tokenizer)")
    else:
        parser.add_argument("--model", default=model_default, help=f"model directory (default {model_default})")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=None)
    parser.add_argument("--device", default=None, help="cpu or cuda[:N]")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--itl-target-ms", type=float, default=None,
                        help="while streams decode, prefill chunks sized so a step takes about this long "
                        "(their inter-token latency; default: whole --max-num-batched-tokens chunks)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-mb", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU compute threads (default: cores - 1; OMP_NUM_THREADS when set)")
    parser.add_argument("--weight-dtype", choices=("auto", "fp32", "bf16", "int8", "int4"), default=None,
                        help="CPU: attention projections and LM head storage (auto: the run dtype)")
    parser.add_argument("--weight-group-size", type=int, choices=(64, 128), default=None,
                        help="int4 --weight-dtype: inputs per scale (64)")
    parser.add_argument("--enforce-eager", action="store_true", default=None,
                        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    parser.add_argument("--enable-prefix-caching", action="store_true", default=None,
                        help="reuse the KV blocks of prompt prefixes seen before (shared system prompts, "
                        "multi-turn chats): their prefill is skipped")
    parser.add_argument("--step-watchdog-s", type=float, default=None,
                        help="requests waiting and no engine step finished for this long: stop and exit 1 "
                        "(default 60; 0: off)")
    offload = parser.add_argument_group("expert offload")
    offload.add_argument("--offload-policy", choices=tuple(POLICIES), default=None, help="default: resident")
    offload.add_argument("--expert-cache-gb", type=float, default=None, help="device expert cache budget in GB (1e9 bytes)")
    offload.add_argument("--expert-cache-experts", type=int, default=None, help="device expert cache slots")
    offload.add_argument("--expert-cache-fraction", type=float, default=None, help="of all experts (0.25)")
    offload.add_argument("--link", choices=("emulated", "native"), default=None)
    offload.add_argument("--link-gbps", type=float, default=None, help="emulated link bandwidth, GB/s")
    offload.add_argument("--link-ratio", type=float, default=None, help="emulated: transfer/compute per expert")
    offload.add_argument("--host-ratio", type=float, default=None,
                         help="emulated host: expert compute on the host / on the device (default 15.6)")
    offload.add_argument("--host-threads", type=int, default=None, help="host expert executor threads (1)")
    offload.add_argument("--prefetch-distance", type=int, default=None, help="default: the policy's own")
    offload.add_argument("--eviction", choices=tuple(EVICTION_POLICIES), default=None)
    offload.add_argument("--routing-trace", default=None, help="recorded routing (oracle, belady)")
    offload.add_argument("--expert-dtype", choices=EXPERT_DTYPES, default=None,
                         help="routed experts' storage on the host, the link and the device (auto: run dtype)")
    offload.add_argument("--expert-group-size", type=int, choices=GROUP_SIZES, default=None,
                         help=f"int4: inputs per scale and zero (default {DEFAULT_GROUP_SIZE})")
    link = parser.add_argument_group("predictor link (policies with prediction hints)")
    link.add_argument("--redis-url", default=None, help="broker for the predictor service (default: embedded)")
    link.add_argument("--engine-id", default=None, help="this engine's hint channel name (default: generated)")
    link.add_argument("--predictor", default=None, help="override the policy's predictor; none turns hints off")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from flags; unset flags fall back to HINTSERVE_<FIELD> env vars, then defaults."""
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    config = EngineConfig.from_env(**{n: getattr(args, n) for n in names if getattr(args, n, None) is not None})
    config.validate()  # raises FileNotFoundError / ValueError with a one-line message
    from services.engine.startup_checks import check_expert_kernels, check_kernel_cache, check_model_dir

    check_model_dir(config.model)  # before the loader (and its process) can fail with a traceback
    if config.device == "cpu":
        check_kernel_cache()
    else:
        check_expert_kernels(config.device, config.expert_dtype, config.expert_group_size)
    return config


def load_engine(config: EngineConfig, core_in_thread: bool = False) -> Any:
    # Imported here so `hintserve --help` and argument errors stay fast (no torch model code).
    from services.engine.async_engine import AsyncLLMEngine

    return AsyncLLMEngine(config, core_in_thread=core_in_thread)


async def start_engine(engine: Any) -> None:
    """Starts the engine, then says what a CPU engine computes with (after the load: a failed start stays the
    one line of its error)."""
    from services.engine.cpu_threads import compute_line

    await engine.start()
    line = compute_line(engine.config)
    if line:
        print(f"[hintserve] {line}", file=sys.stderr, flush=True)


# --- hintserve engine ----------------------------------------------------------------------------


def run_engine(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    check_metrics_port(args.metrics_port)
    token = engine_grpc_token(args.host, args.no_auth)
    config = engine_config(args)
    engine = load_engine(config)
    return asyncio.run(_serve(engine, args.host, args.port, args.metrics_host, args.metrics_port, token))


def engine_grpc_token(host: str, no_auth: bool) -> str | None:
    """HINTSERVE_ENGINE_TOKEN; required when --host is not loopback (anything on the network could drive
    the engine), unless --no-auth says otherwise explicitly, as the gateway's API keys are."""
    from services.common.engine_token import ENGINE_TOKEN_ENV, engine_token
    from services.common.hosts import is_loopback_host

    token = engine_token()
    if no_auth and token:
        raise ValueError(f"--no-auth contradicts {ENGINE_TOKEN_ENV}: unset one of them")
    if token is None and not no_auth and not is_loopback_host(host):
        raise ValueError(
            f"--host {host} is not loopback: set {ENGINE_TOKEN_ENV} (on the gateways too), or pass --no-auth"
        )
    return token


def start_engine_metrics(engine: Any, host: str, port: int) -> MetricsEndpoint | None:
    """The engine's /metrics endpoint (`--metrics-port`; -1: none), started once the engine runs."""
    if port < 0:
        return None
    from services.engine.metrics_endpoint import serve_engine_metrics

    endpoint = serve_engine_metrics(engine.stats, host, port)
    print(f"[hintserve] engine metrics at {endpoint.url}", file=sys.stderr, flush=True)
    return endpoint


async def until_stopped_or_dead(stop: asyncio.Event, engine: Any) -> int:
    """0 once `stop` is set; 1 if the engine loop dies first (so compose / Kubernetes restart the process)."""
    stopped = asyncio.ensure_future(stop.wait())
    died = asyncio.ensure_future(engine.wait_dead())
    await asyncio.wait({stopped, died}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    died.cancel()
    if died.done() and not died.cancelled():
        print(f"[hintserve] engine loop failed, exiting: {died.result()}", file=sys.stderr, flush=True)
        return 1
    return 0


async def _serve(
    engine: Any, host: str, port: int, metrics_host: str, metrics_port: int, token: str | None = None
) -> int:
    from services.engine.grpc_server import serve_engine, stop_server

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await start_engine(engine)
    server, bound = await serve_engine(engine, host, port, token)
    metrics = start_engine_metrics(engine, metrics_host, metrics_port)
    try:
        info = engine.model_info()
        print(
            f"[hintserve] engine serving {info.get('model')} on {host}:{bound}", file=sys.stderr, flush=True
        )
        code = await until_stopped_or_dead(stop, engine)
        print("[hintserve] shutting down", file=sys.stderr, flush=True)
        return code
    finally:
        if metrics is not None:
            metrics.close()
        await stop_server(server, grace=5.0)  # in-flight streams get 5 s, then are cancelled (and aborted)
        await engine.shutdown()


# --- hintserve generate --------------------------------------------------------------------------


def run_generate(args: argparse.Namespace) -> int:
    if not args.prompt:
        raise ValueError("--prompt must not be empty")
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        repetition_penalty=args.repetition_penalty,
    )
    params.validate()  # before loading the model: bad flags fail fast (InvalidRequestError is a ValueError)
    config = engine_config(args)
    if args.max_num_seqs is None:  # one prompt: a KV cache for one sequence, not a server's 2 GB
        config.max_num_seqs = 1
    engine = load_engine(config, core_in_thread=True)  # offline, one request: no second process needed
    if args.chat and not engine.has_chat_template:
        raise ValueError(f"--chat: the tokenizer in {args.model} has no chat template")
    use_chat = engine.has_chat_template if args.chat is None else args.chat
    prompt = args.prompt
    if use_chat:
        prompt = engine.apply_chat_template([{"role": "user", "content": args.prompt}])
    asyncio.run(_generate(engine, prompt, params))
    return 0


async def _generate(engine: Any, prompt: str, params: SamplingParams) -> None:
    await start_engine(engine)
    try:
        start = time.perf_counter()
        first: float | None = None
        prompt_tokens = completion_tokens = 0
        async for out in engine.generate(f"cli-{uuid.uuid4().hex[:8]}", prompt, params):
            if first is None and out.delta_token_ids:
                first = time.perf_counter()
            if out.delta_text:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
            prompt_tokens, completion_tokens = out.prompt_tokens, out.completion_tokens
        end = time.perf_counter()
    finally:
        await engine.shutdown()
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(timing_line(prompt_tokens, completion_tokens, start, first, end), file=sys.stderr, flush=True)


def timing_line(
    prompt_tokens: int, completion_tokens: int, start: float, first: float | None, end: float
) -> str:
    """E.g. `[hintserve] prompt 23 tok, 64 tok generated in 1.23 s (TTFT 45 ms, 52.0 tok/s decode)`."""
    ttft = (first if first is not None else end) - start
    # Decode rate excludes the first token, which the prefill produced.
    decode_time = end - first if first is not None else 0.0
    rate = (completion_tokens - 1) / decode_time if completion_tokens > 1 and decode_time > 0 else 0.0
    return (
        f"[hintserve] prompt {prompt_tokens} tok, {completion_tokens} tok generated in {end - start:.2f} s "
        f"(TTFT {ttft * 1000:.0f} ms, {rate:.1f} tok/s decode)"
    )
