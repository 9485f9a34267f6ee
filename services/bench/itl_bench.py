"""`hintserve bench itl-target`: long prompts arriving while others stream, with and without --itl-target-ms.

Each setting gets a fresh `hintserve serve` on a loopback port; loadgen sends the same Poisson arrivals of
long prompts against it. Every prompt's prefill shares steps with the streams already decoding (mixed steps,
scheduler.py), so the streams' inter-token latency (ITL) tail is the longest such step: a whole
--max-num-batched-tokens chunk without a target, a chunk sized to the target with one (chunk_sizer.py),
paid for in time to first token.
"""

from __future__ import annotations

import asyncio
import os
import shlex

from tqdm import tqdm

from services.bench.servers import hintserve_server
from services.common.report import bar_plot, markdown_table, run_header, write_json, write_markdown


def run_itl_bench(model: str, targets: list[float | None], json_path: str, rate: float = 0.2,
                  duration: float = 60.0, input_len: int = 1500, output_len: int = 64, serve_args: str = "") -> dict:
    from loadgen.plot import plot_cdfs
    from loadgen.replay import ReplayConfig, arun_replay

    runs: dict[str, dict] = {}
    for target in tqdm(targets, desc="bench itl-target", unit="setting"):
        label = "none" if target is None else f"{target:g} ms"
        flags = shlex.split(serve_args) + ([] if target is None else ["--itl-target-ms", f"{target:g}"])
        with hintserve_server(model, flags, timeout=300.0) as url:
            cfg = ReplayConfig(url=url, model=os.path.basename(os.path.normpath(model)), workload="poisson",
                               rate=rate, duration=duration, input_len=input_len, output_len=output_len,
                               prompts="synthetic", tokenizer=model, seed=0, label=label)
            runs[label] = asyncio.run(arun_replay(cfg))
    rows = [
        {"itl_target": label, "completed": r["completed"], "failed": r["failed"],
         "output_throughput": r["output_throughput"], "median_ttft_ms": r["median_ttft_ms"],
         "p99_ttft_ms": r["p99_ttft_ms"], "median_itl_ms": r["median_itl_ms"], "p90_itl_ms": r["p90_itl_ms"],
         "p99_itl_ms": r["p99_itl_ms"], "median_tpot_ms": r["median_tpot_ms"]}
        for label, r in runs.items()
    ]
    result = {**run_header(), "model": os.path.abspath(model), "serve_args": serve_args, "rate": rate,
              "duration_s": duration, "input_len": input_len, "output_len": output_len, "rows": rows}
    table = markdown_table(
        ("ITL target", "done", "failed", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p90 ms",
         "ITL p99 ms", "TPOT p50 ms"),
        [tuple(r.values()) for r in rows],
    )
    print(table)
    write_json(json_path, result)
    stem = os.path.splitext(json_path)[0]
    write_markdown(stem + ".md", "Prefill chunks sized to an inter-token latency target", result, table)
    plot_cdfs(runs, stem + "_cdf.png", title=f"{input_len}-token prompts at {rate:g} req/s")
    bar_plot(stem + ".png", "Streams' ITL p99 and TTFT p50 by --itl-target-ms", [r["itl_target"] for r in rows],
             {"ITL p99": [r["p99_itl_ms"] for r in rows], "TTFT p50": [r["median_ttft_ms"] for r in rows]}, "ms")
    return result
