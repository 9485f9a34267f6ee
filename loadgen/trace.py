"""Workloads: Azure LLM inference traces (and CSVs in their format) and Poisson arrivals.

A workload is a list of `Request`s: an arrival time in seconds (already scaled by the speedup, relative to the
run's start), an input length and an output length in tokens.
"""

from __future__ import annotations

import csv
import math
import os
import random
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# The copies committed in data/azure/ (with their CC-BY licence); LOADGEN_TRACE_DIR overrides, e.g. in a container.
TRACE_DIR = Path(os.environ.get("LOADGEN_TRACE_DIR") or REPO_ROOT / "data" / "azure")
NAMED_TRACES = {
    "conv": "AzureLLMInferenceTrace_conv.csv",
    "code": "AzureLLMInferenceTrace_code.csv",
}
TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class Request:
    """One request to send: when (s after the run's start), and its input/output lengths in tokens."""

    arrival_s: float
    input_len: int
    output_len: int


def resolve_trace(trace: str) -> Path:
    """`conv`/`code` name the Azure 2023 traces under data/azure/; anything else is a CSV path."""
    if trace in NAMED_TRACES:
        path = TRACE_DIR / NAMED_TRACES[trace]
        if not path.is_file():
            raise FileNotFoundError(
                f"trace {trace!r} not found at {path}; copy AzureLLMInferenceTrace_{trace}.csv from "
                "github.com/Azure/AzurePublicDataset (data/) into data/azure/, or pass --trace FILE"
            )
        return path
    path = Path(trace)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {trace} (use conv, code or a CSV path)")
    return path


def _parse_timestamp(text: str) -> tuple[float, float]:
    """(whole seconds, fraction) for 'YYYY-MM-DD HH:MM:SS.fffffff' (any number of fractional digits), or a
    plain number of seconds (handy for hand-written traces). Kept apart so differences stay exact to 100 ns."""
    text = text.strip()
    try:
        return 0.0, float(text)
    except ValueError:
        pass
    # datetime only takes 6 fractional digits; the Azure traces carry 7, so the fraction is parsed separately.
    base, _, frac = text.partition(".")
    whole = datetime.fromisoformat(base).replace(tzinfo=timezone.utc).timestamp()  # UTC: no DST jumps
    return whole, (float("0." + frac) if frac else 0.0)


def load_trace(path: str | Path) -> list[tuple[float, int, int]]:
    """Rows (seconds since the first row, context tokens, generated tokens) of a trace CSV, sorted by time."""
    rows: list[tuple[tuple[float, float], int, int]] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(missing)}; expected {','.join(TRACE_COLUMNS)}")
        for lineno, row in enumerate(reader, start=2):
            try:
                rows.append((_parse_timestamp(row["TIMESTAMP"]), int(row["ContextTokens"]),
                             int(row["GeneratedTokens"])))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: bad row {row}: {exc}") from None
    if not rows:
        raise ValueError(f"{path}: no requests in trace")
    rows.sort(key=lambda r: r[0])
    (w0, f0) = rows[0][0]
    return [((w - w0) + (f - f0), ctx, gen) for (w, f), ctx, gen in rows]


def clip_lengths(input_len: int, output_len: int, max_context: int | None) -> tuple[int, int]:
    """Fits input+output into max_context: the input is cut first (down to 1 token) because the output length
    drives the decode work an offloading server is measured on; the output is cut only when it alone does not
    fit, keeping at least 1 input and 1 output token. Lengths below 1 are raised to 1."""
    input_len, output_len = max(1, input_len), max(1, output_len)
    if max_context is None or input_len + output_len <= max_context:
        return input_len, output_len
    if max_context < 2:
        raise ValueError(f"max_context must be >= 2, got {max_context}")
    output_len = min(output_len, max_context - 1)
    return max_context - output_len, output_len


def trace_requests(
    rows: list[tuple[float, int, int]],
    speedup: float = 1.0,
    start_offset_s: float = 0.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    max_context: int | None = None,
) -> list[Request]:
    """Selects the trace slice to replay: rows from start_offset_s (trace seconds), re-based so the first one is
    sent at 0, times divided by speedup, cut at duration_s (run seconds) and max_requests, lengths clipped."""
    if speedup <= 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    out: list[Request] = []
    base: float | None = None
    for t, ctx, gen in rows:
        if t < start_offset_s:
            continue
        base = t if base is None else base
        arrival = (t - base) / speedup
        if duration_s is not None and arrival >= duration_s:
            break
        if max_requests is not None and len(out) >= max_requests:
            break
        out.append(Request(arrival, *clip_lengths(ctx, gen, max_context)))
    return out


def poisson_requests(
    rate: float,
    input_len: int,
    output_len: int,
    num_requests: int | None = None,
    duration_s: float | None = None,
    max_context: int | None = None,
    seed: int = 0,
) -> list[Request]:
    """Poisson arrivals at `rate` req/s (inf: all at once) with fixed lengths, up to num_requests and/or
    duration_s (one of them is required; with only a duration and rate inf there would be no bound)."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if num_requests is None and (duration_s is None or math.isinf(rate)):
        raise ValueError("poisson needs --num-requests (or --duration with a finite rate)")
    rng = random.Random(seed)
    lengths = clip_lengths(input_len, output_len, max_context)
    out: list[Request] = []
    t = 0.0
    while num_requests is None or len(out) < num_requests:
        if duration_s is not None and t >= duration_s:
            break
        out.append(Request(t, *lengths))
        if not math.isinf(rate):
            t += rng.expovariate(rate)
    return out
