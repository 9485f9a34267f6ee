"""The replay itself: one function behind both the CLI and the gateway's `POST /v1/admin/replay`.

Requests are sent at their scheduled times (trace timestamps / speedup, or Poisson arrivals), each streamed and
timed on its own task; `duration` bounds the send window (requests scheduled later are not sent; ones in flight
finish, as in `vllm bench serve`, each bounded by `request_timeout`); `max_requests` bounds the count.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from loadgen.client import RequestResult, completion_body, send_completion
from loadgen.metrics import compute_metrics, parse_goodput, write_csv
from loadgen.prompts import SHAREGPT_PATH, has_tokenizer, make_builder
from loadgen.trace import Request, load_trace, poisson_requests, resolve_trace, trace_requests


@dataclass
class ReplayConfig:
    """The CLI's flags. workload 'trace' replays `trace` (conv, code or a CSV path); 'poisson' sends
    `num_requests` (and/or for `duration` s) at `rate` req/s with fixed input/output lengths."""

    url: str
    model: str
    workload: str = "trace"
    trace: str = "conv"
    speedup: float = 1.0
    start_offset: float = 0.0  # trace seconds skipped before the replayed slice
    duration: float | None = None  # run seconds: requests scheduled at or after this are not sent
    max_requests: int | None = None
    max_context: int | None = None
    rate: float = 1.0
    num_requests: int | None = None
    input_len: int = 128
    output_len: int = 64
    max_concurrency: int | None = None
    prompts: str = "auto"  # auto (sharegpt if present, else synthetic) | sharegpt | synthetic | FILE
    tokenizer: str | None = None  # None: the model dir if `model` is a local one, else the approximation
    count_special_tokens: bool = True  # count BOS etc. like vLLM's tokenizer call does
    goodput: dict[str, float] | list[str] = field(default_factory=dict)  # {'ttft': ms, ...} or ['ttft:ms']
    api_key: str | None = None
    seed: int = 0
    request_timeout: float = 600.0
    json_path: str | None = None
    csv_path: str | None = None
    plot_path: str | None = None
    progress: bool = False
    label: str | None = None  # legend label in the plot

    def goodput_slos(self) -> dict[str, float]:
        """The goodput SLOs in ms by metric (validate() has turned a ['ttft:ms'] list into this)."""
        return parse_goodput(self.goodput) if isinstance(self.goodput, list) else dict(self.goodput)

    def validate(self) -> None:
        """Raises ValueError with a one-line message for any bad setting; normalises `goodput`."""
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if self.workload not in ("trace", "poisson"):
            raise ValueError(f"workload must be trace or poisson, got {self.workload!r}")
        checks = [("speedup", self.speedup, 0), ("rate", self.rate, 0), ("request_timeout", self.request_timeout, 0),
                  ("duration", self.duration, 0)]
        for name, value, low in checks:
            if value is not None and not (value > low and not math.isnan(value)):
                raise ValueError(f"{name} must be > {low}, got {value}")
        for name, value, low in [("start_offset", self.start_offset, 0), ("max_requests", self.max_requests, 1),
                                 ("num_requests", self.num_requests, 1), ("input_len", self.input_len, 1),
                                 ("output_len", self.output_len, 1), ("max_concurrency", self.max_concurrency, 1),
                                 ("max_context", self.max_context, 2)]:
            if value is not None and not value >= low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if isinstance(self.goodput, list):
            self.goodput = parse_goodput(self.goodput)
        else:
            self.goodput = parse_goodput([f"{k}:{v}" for k, v in self.goodput.items()])


def completions_url(url: str) -> str:
    """Accepts a server root, a .../v1 base or the full endpoint."""
    url = url.rstrip("/")
    if url.endswith("/v1/completions"):
        return url
    return url + ("/completions" if url.endswith("/v1") else "/v1/completions")


def build_workload(cfg: ReplayConfig) -> list[Request]:
    if cfg.workload == "poisson":
        return poisson_requests(cfg.rate, cfg.input_len, cfg.output_len, cfg.num_requests, cfg.duration,
                                cfg.max_context, cfg.seed)
    rows = load_trace(resolve_trace(cfg.trace))
    requests = trace_requests(rows, cfg.speedup, cfg.start_offset, cfg.duration, cfg.max_requests, cfg.max_context)
    if not requests:
        raise ValueError(f"no requests selected: start offset {cfg.start_offset:g} s is past the trace's end "
                         f"({rows[-1][0]:.0f} s)")
    return requests


def _resolve_prompt_inputs(cfg: ReplayConfig) -> tuple[str, str | None]:
    prompts = cfg.prompts
    if prompts == "auto":
        prompts = "sharegpt" if SHAREGPT_PATH.is_file() else "synthetic"
    tokenizer = cfg.tokenizer
    if tokenizer is None and has_tokenizer(cfg.model):
        tokenizer = cfg.model  # serving a local model dir: its tokenizer is the server's
    if tokenizer is not None and not has_tokenizer(tokenizer):
        raise FileNotFoundError(f"no tokenizer files in {tokenizer!r}")
    return prompts, tokenizer


def _build_prompts(cfg: ReplayConfig, prompts: str, tokenizer: str | None,
                   requests: list[Request]) -> tuple[list[str], int]:
    builder = make_builder(prompts, tokenizer, cfg.seed, cfg.count_special_tokens)
    texts = [builder.build(r.input_len) for r in requests]
    return texts, builder.inexact


async def arun_replay(cfg: ReplayConfig, stop: asyncio.Event | None = None) -> dict:
    """Runs the benchmark and returns the vLLM-style result dict (also written to cfg.json_path/csv_path/
    plot_path when set). Setting `stop` ends the run early with a partial report (in-flight requests are
    cancelled and counted as `cancelled`); cancelling the calling task cancels every request."""
    cfg.validate()
    requests = build_workload(cfg)
    prompts, tokenizer = _resolve_prompt_inputs(cfg)
    # Tokenizing thousands of prompts takes a while; off the event loop so a hosting server stays responsive.
    texts, inexact = await asyncio.to_thread(_build_prompts, cfg, prompts, tokenizer, requests)
    stop = stop or asyncio.Event()
    url = completions_url(cfg.url)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    # httpx caps a pool at 100 connections by default; a silent cap would queue requests inside the client.
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    pbar = tqdm(total=len(requests), disable=not cfg.progress, unit="req", dynamic_ncols=True)
    state = {"in_flight": 0, "peak": 0}

    async def one(index: int, req: Request, client: httpx.AsyncClient, run_start: float) -> RequestResult:
        result = RequestResult(index, req.arrival_s, req.input_len, req.output_len)
        body = completion_body(cfg.model, texts[index], req.output_len)
        try:
            if sem is not None:
                await sem.acquire()
            try:
                state["in_flight"] += 1
                state["peak"] = max(state["peak"], state["in_flight"])
                await asyncio.wait_for(send_completion(client, url, body, result, run_start, headers),
                                       cfg.request_timeout)
            finally:
                state["in_flight"] -= 1
                if sem is not None:
                    sem.release()
        except asyncio.TimeoutError:
            result.success, result.error = False, f"timeout: no complete response in {cfg.request_timeout:g} s"
        except asyncio.CancelledError:
            result.success, result.error = False, "cancelled"
            if not stop.is_set():
                raise  # our caller was cancelled, not an interrupt: propagate
        pbar.update(1)
        return result

    tasks: list[asyncio.Task] = []
    timeout = httpx.Timeout(cfg.request_timeout)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        run_start = time.perf_counter()
        try:
            for i, req in enumerate(requests):
                delay = run_start + req.arrival_s - time.perf_counter()
                if delay > 0:
                    try:  # sleep until the arrival time, waking early on stop
                        await asyncio.wait_for(stop.wait(), delay)
                    except asyncio.TimeoutError:
                        pass
                if stop.is_set():
                    break
                tasks.append(asyncio.create_task(one(i, req, client, run_start)))
            if tasks:
                gathered: asyncio.Future[Any] = asyncio.gather(*tasks, return_exceptions=True)
                stopper: asyncio.Future[Any] = asyncio.create_task(stop.wait())
                await asyncio.wait([gathered, stopper], return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                if stop.is_set():
                    for t in tasks:
                        t.cancel()
                await asyncio.gather(gathered, return_exceptions=True)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            pbar.close()
            raise
        duration = time.perf_counter() - run_start
    pbar.close()
    results = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
    result = _report(cfg, requests, results, duration, prompts, tokenizer, inexact, stop.is_set(), state["peak"])
    _write_outputs(cfg, result, results)
    return result


def _report(cfg: ReplayConfig, requests: list[Request], results: list[RequestResult], duration: float,
            prompts: str, tokenizer: str | None, inexact: int, interrupted: bool, peak: int) -> dict:
    """Config echo (vLLM's names where it has them) followed by the metrics."""
    head = {
        "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "base_url": cfg.url,
        "model_id": cfg.model,
        "tokenizer_id": tokenizer or "approximate (no tokenizer)",
        "prompts": prompts,
        "workload": cfg.workload,
        "trace": cfg.trace if cfg.workload == "trace" else None,
        "speedup": cfg.speedup if cfg.workload == "trace" else None,
        "start_offset": cfg.start_offset if cfg.workload == "trace" else None,
        "request_rate": cfg.rate if cfg.workload == "poisson" else "trace",
        "duration_limit": cfg.duration,
        "max_requests": cfg.max_requests,
        "max_context": cfg.max_context,
        "max_concurrency": cfg.max_concurrency,
        "goodput_slos_ms": cfg.goodput_slos() or None,
        "num_prompts": len(requests),
        "interrupted": interrupted,
        "max_concurrent_requests": peak,
        "prompts_inexact": inexact,
        "label": cfg.label,
    }
    return head | compute_metrics(results, duration, cfg.goodput_slos())


def _write_outputs(cfg: ReplayConfig, result: dict, results: list[RequestResult]) -> None:
    for path in (cfg.json_path, cfg.csv_path, cfg.plot_path):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if cfg.json_path:
        # One key per line, values (the per-request arrays too) compact: readable and diff-friendly.
        lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in result.items()]
        Path(cfg.json_path).write_text("{\n" + ",\n".join(lines) + "\n}\n")
    if cfg.csv_path:
        write_csv(cfg.csv_path, results)
    if cfg.plot_path:
        from loadgen.plot import plot_cdfs

        name = cfg.trace if cfg.workload == "trace" else f"poisson {cfg.rate:g} req/s"
        title = f"{name}" + (f" x{cfg.speedup:g}" if cfg.workload == "trace" else "")
        plot_cdfs({cfg.label or cfg.model: result}, cfg.plot_path, result["goodput_slos_ms"], title)


def run_replay(cfg: ReplayConfig) -> dict:
    """Blocking wrapper of `arun_replay` (for callers without an event loop)."""
    return asyncio.run(arun_replay(cfg))
