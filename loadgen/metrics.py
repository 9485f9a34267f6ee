"""Benchmark metrics as `vllm bench serve` computes and names them, its table, and the per-request CSV."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import numpy as np

from loadgen.client import RequestResult

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
PERCENTILES = (90, 99)
MAX_ERROR_SAMPLES = 5


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'e2el:2000'] -> {'ttft': 500.0, 'e2el': 2000.0} (SLOs in ms)."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"bad --goodput item {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad --goodput value in {item!r}: not a number") from None
        if not ms >= 0:
            raise ValueError(f"bad --goodput value in {item!r}: must be >= 0")
        slos[key] = ms
    return slos


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    """mean/median/std/p90/p99 in ms; zeros for no values, as vLLM reports them."""
    arr = np.asarray(values_s or [0.0], dtype=float) * 1000.0
    out = {
        f"mean_{name}_ms": float(np.mean(arr)),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(np.std(arr)),
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    ms = {"ttft": r.ttft * 1000, "tpot": r.tpot * 1000, "e2el": r.latency * 1000}
    return all(ms[k] <= v for k, v in slos.items())


def compute_metrics(results: list[RequestResult], duration_s: float, slos: dict[str, float]) -> dict:
    """The vLLM summary keys plus `error_counts`/`error_samples`; `failed` counts requests that were sent and
    did not succeed (ones cancelled by an interrupt are reported as `cancelled`)."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success and r.error != "cancelled"]
    duration = max(duration_s, 1e-9)
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.completion_tokens for r in ok)
    good = sum(meets_slos(r, slos) for r in ok) if slos else 0
    errors = Counter(r.error.split(":")[0] for r in failed)
    samples: list[str] = []
    for r in failed:
        if r.error not in samples and len(samples) < MAX_ERROR_SAMPLES:
            samples.append(r.error)
    out: dict[str, object] = {
        "completed": len(ok),
        "failed": len(failed),
        "cancelled": sum(1 for r in results if r.error == "cancelled"),
        "duration": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if slos else None,
        "goodput_fraction": good / len(ok) if slos and ok else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    out |= _stats("ttft", [r.ttft for r in ok])
    # vLLM's TPOT mean skips single-token outputs (their TPOT is undefined); goodput still counts them as 0.
    out |= _stats("tpot", [r.tpot for r in ok if r.completion_tokens > 1])
    out |= _stats("itl", [gap for r in ok for gap in r.itl])
    out |= _stats("e2el", [r.latency for r in ok])
    out["output_len_mismatches"] = sum(1 for r in ok if r.completion_tokens != r.output_len)
    out["prompt_len_mismatches"] = sum(
        1 for r in ok if r.prompt_tokens is not None and r.prompt_tokens != r.input_len
    )
    out["error_counts"] = dict(errors)
    out["error_samples"] = samples
    # Per-request arrays (seconds, like vLLM's `ttfts`) so reports and CDF plots can be redrawn from the JSON.
    out["input_lens"] = [r.input_len for r in ok]
    out["output_lens"] = [r.completion_tokens for r in ok]
    out["ttfts"] = [r.ttft for r in ok]
    out["tpots"] = [r.tpot for r in ok]
    out["e2els"] = [r.latency for r in ok]
    return out


def format_table(m: dict) -> str:
    """The table `vllm bench serve` prints."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: object, fmt: str = "") -> None:
        lines.append(f"{label:<40} {format(value, fmt) if fmt else value:<10}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    if m.get("cancelled"):
        row("Cancelled requests (interrupted):", m["cancelled"])
    row("Benchmark duration (s):", m["duration"], ".2f")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], ".2f")
    if m.get("request_goodput") is not None:
        row("Request goodput (req/s):", m["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", m["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", m["total_token_throughput"], ".2f")
    sections = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))
    for key, short, title in sections:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        row(f"Mean {short} (ms):", m[f"mean_{key}_ms"], ".2f")
        row(f"Median {short} (ms):", m[f"median_{key}_ms"], ".2f")
        for p in PERCENTILES:
            row(f"P{p} {short} (ms):", m[f"p{p}_{key}_ms"], ".2f")
    lines.append("=" * 50)
    for msg in m.get("error_samples", []):
        lines.append(f"error: {msg}")
    return "\n".join(lines)


CSV_FIELDS = ("index", "arrival_s", "start_s", "input_len", "prompt_tokens", "output_len", "completion_tokens",
              "success", "ttft_ms", "tpot_ms", "e2el_ms", "mean_itl_ms", "error")


def write_csv(path: str | Path, results: list[RequestResult]) -> None:
    """One row per request that was sent."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_FIELDS)
        for r in results:
            w.writerow([r.index, f"{r.arrival_s:.6f}", f"{r.start_s:.6f}", r.input_len, r.prompt_tokens,
                        r.output_len, r.completion_tokens, int(r.success), f"{r.ttft * 1000:.3f}",
                        f"{r.tpot * 1000:.3f}", f"{r.latency * 1000:.3f}",
                        f"{float(np.mean(r.itl)) * 1000:.3f}" if r.itl else "", r.error])
