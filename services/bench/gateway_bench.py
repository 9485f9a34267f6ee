"""`hintserve bench gateway`: what the gateway costs, in TTFT and in CPU, at N concurrent streaming requests.

Three paths, the same prompts and engine settings, `rounds` measured rounds after a warm-up round each:
  engine    an in-process AsyncLLMEngine driven directly by asyncio tasks (the engine's own TTFT);
  grpc      the engine in its own process (`hintserve engine`), driven directly over gRPC;
  gateway   the same engine process behind the gateway (in this process), driven over HTTP/SSE by a load
            client in a third process, so that this process's CPU time is the gateway's alone.
Gateway CPU per 100 tokens/s = 100 x (this process's CPU seconds during the gateway run) / (tokens streamed):
CPU seconds per second, per 100 tokens per second.

The load client is gateway_load_client.py, in a process of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import sys
import time

from services.bench.gateway_load_client import timed_rounds

_TEXT = (
    "Mixture of experts models route each token to a few experts. The gateway admits requests, batches them "
    "and streams tokens back while the engine moves expert weights from host memory to the device. "
)


def _prompts(concurrency: int, words: int) -> list[str]:
    tokens = _TEXT.split()
    return [" ".join(tokens[(i * 7 + j) % len(tokens)] for j in range(words)) for i in range(concurrency)]


# --- the engine alone (in-process) ----------------------------------------------------------------


async def _engine_rounds(
    model: str, prompts: list[str], max_tokens: int, rounds: int, max_num_seqs: int
) -> dict:
    from services.engine.async_engine import AsyncLLMEngine
    from services.engine.config import EngineConfig
    from services.engine.sampling_params import SamplingParams

    engine = AsyncLLMEngine(EngineConfig(model=model, max_num_seqs=max_num_seqs))
    await engine.start()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(tag: str, prompt: str) -> tuple[float, int]:
        start, ttft, tokens = time.perf_counter(), 0.0, 0
        async for out in engine.generate(tag, prompt, params):
            if not ttft and out.delta_token_ids:
                ttft = time.perf_counter() - start
            tokens = out.completion_tokens
        return ttft, tokens

    try:
        return await timed_rounds(lambda r: [one(f"r{r}-{i}", p) for i, p in enumerate(prompts)], rounds)
    finally:
        await engine.shutdown()


async def _grpc_rounds(address: str, prompts: list[str], max_tokens: int, rounds: int) -> dict:
    from services.engine.grpc_client import EngineClient
    from services.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async with EngineClient(address) as client:
        await client.wait_ready()

        async def one(tag: str, prompt: str) -> tuple[float, int]:
            start, ttft, tokens = time.perf_counter(), 0.0, 0
            async for out in client.generate(tag, prompt, params):
                if not ttft and out.delta_token_ids:
                    ttft = time.perf_counter() - start
                tokens = out.completion_tokens
            return ttft, tokens

        return await timed_rounds(lambda r: [one(f"g{r}-{i}", p) for i, p in enumerate(prompts)], rounds)


async def _gateway_rounds(
    address: str, model: str, prompts: list[str], max_tokens: int, rounds: int, batch_window_ms: float
) -> dict:
    from services.engine.grpc_client import EngineClient
    from services.gateway.config import GatewayConfig
    from services.gateway.server import Gateway, HTTPServer

    api_key = secrets.token_hex(16)
    n = len(prompts)
    config = GatewayConfig(
        model_name="bench",
        tokenizer=model,
        api_keys=[api_key],
        max_queue=n,
        max_concurrency_per_engine=n,
        batch_window_ms=batch_window_ms,
        max_batch=n,
    )
    gateway = Gateway(config, [EngineClient(address)])
    server = HTTPServer(gateway.app, "127.0.0.1", 0)
    await server.start()
    cfg = {
        "host": server.host,
        "port": server.port,
        "model": "bench",
        "api_key": api_key,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "rounds": rounds,
    }
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.bench.gateway_load_client",
            json.dumps(cfg),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None
        ready = await proc.stdout.readline()
        if ready.strip() != b"READY":
            raise RuntimeError(f"load client failed to start: {ready!r}")
        cpu0, wall0 = time.process_time(), time.perf_counter()
        proc.stdin.write(b"GO\n")
        await proc.stdin.drain()
        line = await proc.stdout.readline()
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
        if await proc.wait() != 0 or not line:
            raise RuntimeError("load client failed")
        result = json.loads(line)
    finally:
        await server.stop()
    # The client's token count covers its measured rounds; the CPU window also spans its warm-up round.
    all_tokens = result["tokens"] * (rounds + 1) / rounds
    result.update(
        cpu_s=cpu_s,
        cpu_wall_s=wall_s,
        cpu_core_fraction=cpu_s / wall_s,
        cpu_per_100_tok_s=100.0 * cpu_s / all_tokens,
    )
    return result


# --- the engine process ------------------------------------------------------------------------------


async def _start_engine_process(model: str, max_num_seqs: int) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        "engine",
        "--model",
        model,
        "--port",
        "0",
        "--max-num-seqs",
        str(max_num_seqs),
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    lines = []
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), 300)).decode()
        if not line:
            raise RuntimeError("engine process exited:\n" + "".join(lines))
        lines.append(line)
        if match := re.search(r"engine serving .* on (\S+:\d+)", line):
            return proc, match.group(1)


async def _stop_process(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()


async def _run(
    model: str, concurrency: int, max_tokens: int, prompt_words: int, rounds: int, batch_window_ms: float
) -> dict:
    prompts = _prompts(concurrency, prompt_words)
    engine = await _engine_rounds(model, prompts, max_tokens, rounds, concurrency)
    proc, address = await _start_engine_process(model, concurrency)
    try:
        grpc = await _grpc_rounds(address, prompts, max_tokens, rounds)
        gateway = await _gateway_rounds(address, model, prompts, max_tokens, rounds, batch_window_ms)
    finally:
        await _stop_process(proc)
    return {"engine": engine, "grpc": grpc, "gateway": gateway}


def run_gateway_bench(
    model: str,
    json_path: str,
    concurrency: int = 64,
    max_tokens: int = 32,
    prompt_words: int = 48,
    rounds: int = 3,
    batch_window_ms: float = 2.0,
) -> dict:
    from services.common.report import bar_plot, markdown_table, run_header, write_json, write_markdown

    paths = asyncio.run(_run(model, concurrency, max_tokens, prompt_words, rounds, batch_window_ms))
    engine, grpc, gateway = paths["engine"], paths["grpc"], paths["gateway"]
    result = {
        **run_header(),
        "model": os.path.abspath(model),
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "prompt_words": prompt_words,
        "rounds": rounds,
        "batch_window_ms": batch_window_ms,
        "ttft_p50_ratio_gateway_vs_engine": gateway["ttft_p50_ms"] / engine["ttft_p50_ms"],
        "ttft_p50_ratio_gateway_vs_grpc": gateway["ttft_p50_ms"] / grpc["ttft_p50_ms"],
        "gateway_cpu_per_100_tok_s": gateway["cpu_per_100_tok_s"],
        "goals": {"ttft_p50_ratio_max": 1.2, "gateway_cpu_per_100_tok_s_max": 0.30},
        **paths,
    }
    rows = [
        (name, p["ttft_p50_ms"], p["ttft_p90_ms"], p["tok_s"])
        for name, p in (
            ("engine (in-process, direct)", engine),
            ("engine over gRPC (separate process)", grpc),
            ("gateway -> gRPC engine (HTTP/SSE client)", gateway),
        )
    ]
    table = markdown_table(("path", "TTFT p50 ms", "TTFT p90 ms", "tokens/s"), rows)
    table += (
        f"\n\n{concurrency} concurrent streaming requests, {max_tokens} tokens each, median of {rounds} rounds. "
        f"TTFT p50 gateway / engine: {result['ttft_p50_ratio_gateway_vs_engine']:.2f}x (goal <= 1.2); "
        f"gateway / gRPC: {result['ttft_p50_ratio_gateway_vs_grpc']:.2f}x. Gateway process CPU: "
        f"{gateway['cpu_core_fraction']:.2f} cores while streaming, {gateway['cpu_per_100_tok_s']:.3f} cores per "
        f"100 tokens/s (goal < 0.30)."
    )
    print(table)
    write_json(json_path, result)
    stem = os.path.splitext(json_path)[0]
    write_markdown(stem + ".md", "Gateway overhead", result, table)
    bar_plot(
        stem + ".png",
        f"TTFT p50 at {concurrency} concurrent streams",
        ["engine", "engine/gRPC", "gateway"],
        {"TTFT p50 (ms)": [engine["ttft_p50_ms"], grpc["ttft_p50_ms"], gateway["ttft_p50_ms"]]},
        "ms",
    )
    return result
