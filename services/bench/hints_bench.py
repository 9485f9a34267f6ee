"""`hintserve bench hints`: hint delivery latency engine -> predictor -> engine over a real Redis.

The engine side is the real PredictorLink + HintPrefetcher, fed synthetic decode steps of a model shape
(default Mixtral-8x7B: 32 layers x 8 experts, hidden 4096) at a fixed step period; the predictor is the
real standalone service (`python -m services.predictor.service_cli`) in its own process. Latency is
measured per context batch, from the moment the decode loop hands the step to the link until its hints
are in the HintPrefetcher: encoding, XADD, XREADGROUP, observe + predict, PUBLISH, decoding.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import torch
from tqdm import tqdm

from services.common.broker import make_broker
from services.common.iteration_context import PredictionQuery
from services.common.messages import Shape
from services.common.report import markdown_table, run_header, write_json, write_markdown
from services.engine.offload.prefetch.hints import HintPrefetcher, HintStats
from services.engine.predictor_link import PredictorLink
from services.engine.step_context import Phase, StepContext
from services.predictor.predictors.base import Predictor

_STATIC = np.linspace(1.0, 0.1, 256, dtype=np.float32)


class StaticPredictor(Predictor):
    """Transport-only runs (`--predictor services.bench.hints_bench:StaticPredictor`): constant scores."""

    name = "static"

    def predict(self, query: PredictionQuery) -> np.ndarray:
        return _STATIC[: self.num_experts]


def _step(shape: Shape, batch: int, step: int, iteration: int, gen: torch.Generator) -> StepContext:
    rids = [f"bench-{i}" for i in range(batch)]
    ctx = StepContext(Phase.DECODE, rids, batch, step_index=step, seq_lens=[1] * batch, iterations=[iteration] * batch)
    ctx.embeddings = torch.randn(batch, shape.hidden_size, generator=gen)
    logits = torch.randn(shape.num_layers, batch, shape.num_experts, generator=gen)
    for layer in range(shape.num_layers):
        probs = torch.softmax(logits[layer], dim=-1)
        ctx.router_probs[layer] = probs
        ctx.selected_experts[layer] = torch.topk(probs, shape.top_k, dim=-1).indices
    return ctx


def _quantiles(values: list[float]) -> dict[str, float]:
    v = np.asarray(values)
    return {
        "p50_ms": float(np.percentile(v, 50)), "p90_ms": float(np.percentile(v, 90)),
        "p99_ms": float(np.percentile(v, 99)), "max_ms": float(v.max()), "mean_ms": float(v.mean()),
    }


async def _redis_floor_ms(url: str, n: int, interval_s: float) -> dict[str, float]:
    """The transport floor on this machine: XADD -> XREADGROUP -> PUBLISH -> subscriber, one process, no
    predictor, no protobuf; what the full path is compared against."""
    stream, channel = f"bench:floor:{uuid.uuid4().hex[:8]}", f"bench:floor:{uuid.uuid4().hex[:8]}"
    producer, consumer = make_broker(url), make_broker(url)
    await consumer.ensure_group(stream, "g", start="$")
    sub = await producer.subscribe(channel)

    async def echo() -> None:
        while True:
            for entry_id, data in await consumer.stream_read_group(stream, "g", "c", block_ms=200):
                await consumer.publish(channel, data)
                await consumer.stream_ack(stream, "g", [entry_id])

    task = asyncio.create_task(echo())
    samples = []
    try:
        for _ in range(n):
            start = time.perf_counter()
            await producer.stream_append(stream, b"x" * 512, maxlen=100)
            if await sub.get(timeout=2.0) is not None:
                samples.append((time.perf_counter() - start) * 1e3)
            await asyncio.sleep(interval_s)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sub.close()
        await _drop(url, stream)
        await producer.close()
        await consumer.close()
    return _quantiles(samples)


def _start_predictor(url: str, predictor: str, engine_id: str, horizon: int, stream: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "services.predictor.service_cli", "--redis-url", url, "--predictor", predictor,
        "--stream", stream,
        "--engine-id", engine_id, "--grpc-port", "-1", "--metrics-port", "-1", "--horizon", str(horizon),
        "--consumer", "bench", "--skip-backlog",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None  # stderr=PIPE
    line = proc.stderr.readline()
    if "consuming" not in line:
        proc.kill()
        raise RuntimeError(f"predictor service did not start: {line.strip()}")
    return proc


def _run_case(
    url: str, shape: Shape, batch: int, steps: int, interval_s: float, engine_id: str, stream: str
) -> dict:
    hints = HintPrefetcher((True,) * shape.num_layers, HintStats(shape.num_layers))
    link = PredictorLink(lambda: make_broker(url), engine_id, shape, hints, queue_size=256, stream=stream).start()
    gen = torch.Generator().manual_seed(batch)
    pool = [_step(shape, batch, 0, 0, gen) for _ in range(16)]  # made up front: the driver stays light
    try:
        deadline = time.monotonic() + 30
        while link.engine_stats()["predictor_hint_batches_received_total"] == 0:  # warm-up: service ready
            if time.monotonic() > deadline:
                raise RuntimeError("no hints from the predictor within 30 s")
            hints.on_step_end(pool[0])
            link.observe(pool[0])
            time.sleep(0.05)
        time.sleep(0.2)
        warm = len(link.latencies_ms())
        for step in tqdm(range(1, steps + 1), desc=f"batch {batch}", leave=False, mininterval=1.0):
            ctx = pool[step % len(pool)]
            ctx.step_index, ctx.iterations = step, [step] * batch
            hints.on_step_end(ctx)
            link.observe(ctx)  # as the model runner's step observer
            time.sleep(interval_s)
        deadline = time.monotonic() + 5
        while link.engine_stats()["predictor_hint_batches_received_total"] < warm + steps and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = link.engine_stats()
        latencies = link.latencies_ms()[warm:]
    finally:
        link.close()
    return {
        "batch": batch, "steps": steps, "hint_batches": len(latencies),
        "contexts_dropped": int(stats["predictor_contexts_dropped_total"]), **_quantiles(latencies),
    }


def run_hints_bench(
    url: str, predictor: str, shape: Shape, batches: list[int], steps: int, interval_ms: float, horizon: int,
    json_path: str,
) -> dict:
    engine_id = f"bench-hints-{uuid.uuid4().hex[:8]}"
    floor = asyncio.run(_redis_floor_ms(url, min(steps, 500), interval_ms / 1000))
    stream = f"bench:ctx:{engine_id}"  # private: the bench leaves nothing in the engines' stream
    proc = _start_predictor(url, predictor, engine_id, horizon, stream)
    try:
        rows = [_run_case(url, shape, b, steps, interval_ms / 1000, engine_id, stream) for b in batches]
    finally:
        proc.terminate()
        proc.wait(10)
        asyncio.run(_drop(url, stream))
    result = {
        **run_header(), "redis_url": url, "predictor": predictor, "shape": vars(shape), "horizon": horizon,
        "step_interval_ms": interval_ms, "redis_floor": floor, "rows": rows,
    }
    write_json(json_path, result)
    headers = ["batch", "steps", "hint batches", "p50 ms", "p90 ms", "p99 ms", "max ms", "dropped"]
    table = markdown_table(headers, [
        [r["batch"], r["steps"], r["hint_batches"], r["p50_ms"], r["p90_ms"], r["p99_ms"], r["max_ms"],
         r["contexts_dropped"]] for r in rows
    ])
    note = (
        f"Predictor `{predictor}`, {shape.num_layers} layers x {shape.num_experts} experts, hidden "
        f"{shape.hidden_size}, hints for {horizon or shape.num_layers} layers per context, one step every "
        f"{interval_ms} ms. Transport floor on this machine (XADD -> XREADGROUP -> PUBLISH -> subscriber in one "
        f"process, no predictor): p50 {floor['p50_ms']:.3f} ms, p99 {floor['p99_ms']:.3f} ms."
    )
    write_markdown(os.path.splitext(json_path)[0] + ".md", "Hint delivery latency", result, f"{note}\n\n{table}")
    print(f"transport floor: p50 {floor['p50_ms']:.3f} ms, p99 {floor['p99_ms']:.3f} ms")
    for r in rows:
        print(f"batch {r['batch']}: p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms "
              f"({r['hint_batches']} hint batches, {r['contexts_dropped']} contexts dropped)")
    return result


async def _drop(url: str, stream: str) -> None:
    """Leaves no bench state behind on a shared Redis."""
    import redis.asyncio as redis

    client = redis.Redis.from_url(url)
    try:
        await client.delete(stream)
    finally:
        await client.aclose()
