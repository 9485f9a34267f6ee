"""`hintserve bench gateway`: what the gateway costs, in TTFT and in CPU, at N concurrent streaming requests.

Three paths, the same prompts and engine settings, `rounds` measured rounds after a warm-up round each:
  engine    an in-process AsyncLLMEngine driven directly by asyncio tasks (the engine's own TTFT);
  grpc      the engine in its own process (`hintserve engine`), driven directly over gRPC;
  gateway   the same engine process behind the gateway (in this process), driven over HTTP/SSE by a load
            client in a third process, so that this process's CPU time is the gateway's alone.
Gateway CPU per 100 tokens/s = 100 x (this process's CPU seconds during the gateway run) / (tokens streamed):
CPU seconds per second, per 100 tokens per second.

The load client is this module run with `--client` (`python -m services.bench.gateway_bench --client CFG`);
it imports nothing heavy (no torch, no httpx).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import statistics
import sys
import time
from typing import Any

_TEXT = (
    "Mixture of experts models route each token to a few experts. The gateway admits requests, batches them "
    "and streams tokens back while the engine moves expert weights from host memory to the device. "
)


def _prompts(concurrency: int, words: int) -> list[str]:
    tokens = _TEXT.split()
    return [" ".join(tokens[(i * 7 + j) % len(tokens)] for j in range(words)) for i in range(concurrency)]


def _p50_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000.0


def _p90_ms(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1000.0


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
        return await _rounds(lambda r: [one(f"r{r}-{i}", p) for i, p in enumerate(prompts)], rounds)
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

        return await _rounds(lambda r: [one(f"g{r}-{i}", p) for i, p in enumerate(prompts)], rounds)


async def _rounds(make_round: Any, rounds: int) -> dict:
    """Warm-up round, then `rounds` measured ones: TTFT p50 per round, all TTFTs, tokens, wall time."""
    await asyncio.gather(*make_round(-1))
    ttfts: list[float] = []
    p50s: list[float] = []
    tokens = 0
    wall = 0.0
    for r in range(rounds):
        start = time.perf_counter()
        results = await asyncio.gather(*make_round(r))
        wall += time.perf_counter() - start
        round_ttfts = [t for t, _ in results]
        ttfts += round_ttfts
        p50s.append(_p50_ms(round_ttfts))
        tokens += sum(n for _, n in results)
    return {
        "ttft_p50_ms": statistics.median(p50s),
        "ttft_p90_ms": _p90_ms(ttfts),
        "round_p50s_ms": p50s,
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
    }


# --- the load client (a separate process) -----------------------------------------------------------


async def _stream_completion(host: str, port: int, head: bytes, body: bytes) -> tuple[float, int]:
    """One streamed POST over a raw connection: (TTFT at the first SSE chunk, completion tokens).

    Hand-rolled HTTP/1.1 rather than httpx, which spends ~1 ms of CPU per streamed chunk: on a 2-core box
    that client would slow the measured server down, and its own lag would count as TTFT.
    """
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(head + body)
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP error: {status!r} {await reader.read(2000)!r}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers: the body is chunked (a streamed response has no length)
        ttft, tokens = 0.0, 0
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            data = await reader.readexactly(size + 2)
            if not ttft and data.startswith(b"data: {"):
                ttft = time.perf_counter() - start
            if b'"usage":{' in data:
                tokens = json.loads(data[6:].split(b"\n\n")[0])["usage"]["completion_tokens"]
        return ttft, tokens
    finally:
        writer.close()


async def _client(cfg: dict) -> dict:
    host, port = cfg["host"], cfg["port"]

    def request(prompt: str) -> tuple[bytes, bytes]:
        body = json.dumps(
            {
                "model": cfg["model"],
                "prompt": prompt,
                "max_tokens": cfg["max_tokens"],
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {cfg['api_key']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        return head, body

    requests = [request(p) for p in cfg["prompts"]]
    print("READY", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # wait for GO
    cpu0 = time.process_time()
    result = await _rounds(
        lambda r: [_stream_completion(host, port, h, b) for h, b in requests], cfg["rounds"]
    )
    result["client_cpu_s"] = time.process_time() - cpu0
    return result


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
            "services.bench.gateway_bench",
            "--client",
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


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--client":
    print(json.dumps(asyncio.run(_client(json.loads(sys.argv[2])))), flush=True)
