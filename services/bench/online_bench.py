"""`hintserve bench online`: the all-in-one server replaying a slice of the Azure conv trace, once per policy.

Each policy gets a fresh `hintserve serve` process on a loopback port; loadgen replays the same slice (same
arrivals, lengths and prompts) against it and scores goodput at the stated SLOs. Policies that replay a
recorded routing trace (oracle, belady) are left out: online batching is timing-dependent, so no earlier run
is identical.
"""

from __future__ import annotations

import asyncio
import os

from tqdm import tqdm

from services.bench.servers import hintserve_server
from services.common.report import bar_plot, markdown_table, run_header, write_json, write_markdown

_TRACE_POLICIES = ("oracle", "belady")


def _flags(policy: str, cache: float, ratio: float) -> list[str]:
    name, _, eviction = policy.partition("@")
    flags = ["--offload-policy", name, "--expert-cache-fraction", str(cache), "--link-ratio", str(ratio)]
    return flags + ["--eviction", eviction] if eviction else flags


def run_online_bench(
    model: str,
    policies: list[str],
    json_path: str,
    duration: float = 60.0,
    speedup: float = 0.4,
    max_context: int = 256,
    cache: float = 0.25,
    ratio: float = 30.0,
    slos: dict[str, float] | None = None,
    prompts: str = "auto",
) -> dict:
    from loadgen.plot import plot_cdfs
    from loadgen.replay import ReplayConfig, arun_replay

    slos = slos or {"ttft": 300.0, "tpot": 50.0}
    runs: dict[str, dict] = {}
    for policy in tqdm([p for p in policies if p not in _TRACE_POLICIES], desc="bench online", unit="policy"):
        with hintserve_server(model, _flags(policy, cache, ratio), timeout=180.0) as url:
            cfg = ReplayConfig(url=url, model=os.path.basename(os.path.normpath(model)), trace="conv",
                               speedup=speedup, duration=duration, max_context=max_context, goodput=dict(slos),
                               tokenizer=model, seed=0, label=policy, prompts=prompts)
            runs[policy] = asyncio.run(arun_replay(cfg))
    rows = [
        {"policy": p, "completed": r["completed"], "failed": r["failed"], "request_goodput": r["request_goodput"],
         "request_throughput": r["request_throughput"], "output_throughput": r["output_throughput"],
         "median_ttft_ms": r["median_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
         "median_tpot_ms": r["median_tpot_ms"], "p99_tpot_ms": r["p99_tpot_ms"]}
        for p, r in runs.items()
    ]
    result = {**run_header(), "model": os.path.abspath(model), "trace": "conv", "speedup": speedup,
              "duration_s": duration, "max_context": max_context, "cache_fraction": cache, "link_ratio": ratio,
              "slos_ms": slos, "prompts": _prompt_source(runs, prompts), "rows": rows}
    table = markdown_table(
        ("policy", "done", "failed", "goodput req/s", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
         "TPOT p50 ms", "TPOT p99 ms"),
        [tuple(r.values()) for r in rows],
    )
    table += f"\n\nSLOs: {', '.join(f'{k} <= {v:g} ms' for k, v in slos.items())}. Prompts: {result['prompts']}."
    print(table)
    write_json(json_path, result)
    stem = os.path.splitext(json_path)[0]
    write_markdown(stem + ".md", "Online serving: Azure conv replay", result, table)
    plot_cdfs(runs, stem + "_cdf.png", slos=slos, title="Azure conv replay")
    bar_plot(stem + ".png", "Goodput by policy (req/s)", [r["policy"] for r in rows],
             {"goodput": [r["request_goodput"] for r in rows]}, "requests/s meeting SLOs")
    return result


def _prompt_source(runs: dict[str, dict], asked: str) -> str:
    """Where the prompts came from, as loadgen resolved `asked` (auto picks ShareGPT only when ../shared is
    beside the checkout, so two checkouts' runs can differ; the results say which)."""
    return next((run["prompts"] for run in runs.values()), asked)
