"""The gateway benchmark's load client, run in a process of its own (`python -m
services.bench.gateway_load_client CFG`) so the gateway's process CPU is the gateway's alone: streamed
completions over raw HTTP/1.1, a warm-up round and then the measured ones. It imports nothing heavy (no torch,
no httpx); `timed_rounds` is also how the benchmark times the engine and gRPC paths."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from typing import Any


def _p50_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000.0


def _p90_ms(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1000.0


async def timed_rounds(make_round: Any, rounds: int) -> dict:
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


async def client(cfg: dict) -> dict:
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
    result = await timed_rounds(
        lambda r: [_stream_completion(host, port, h, b) for h, b in requests], cfg["rounds"]
    )
    result["client_cpu_s"] = time.process_time() - cpu0
    return result


if __name__ == "__main__" and len(sys.argv) == 2:
    print(json.dumps(asyncio.run(client(json.loads(sys.argv[1])))), flush=True)
