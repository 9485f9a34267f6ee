"""`hintserve bench all` (`make bench`): every benchmark the README quotes, then bench/results/REPORT.md."""

from __future__ import annotations

import datetime as dt
import os

from services.bench.report import machine_description

SECTIONS = (  # (title, markdown file written by the benchmark)
    ("Engine throughput", "engine.md"),
    ("Offload policies", "offload.md"),
    ("Gateway overhead", "gateway.md"),
    ("Predictors", "predictor_demo.md"),
    ("Predictors on real Mixtral routing", "predictor_mixtral.md"),
    ("Predictors on real Qwen routing", "predictor_qwen.md"),
    ("Online serving (Azure conv replay)", "online.md"),
)


def run_all(model: str, out_dir: str, quick: bool = False) -> str:
    from services.bench.engine_bench import run_engine_bench
    from services.bench.gateway_bench import run_gateway_bench
    from services.bench.offload_bench import run_offload_bench
    from services.bench.online_bench import run_online_bench
    from services.engine.offload.policies import POLICIES

    policies = list(POLICIES)
    path = lambda name: os.path.join(out_dir, name)  # noqa: E731
    run_engine_bench(model, path("engine.json"), repeats=1 if quick else 3)
    run_offload_bench(
        model, policies,
        [0.25] if quick else [0.10, 0.25, 0.50],
        [30.0] if quick else [10.0, 30.0, 100.0],
        [1, 4] if quick else [1, 4, 16],
        path("offload.json"), repeats=1 if quick else 3,
    )
    run_gateway_bench(model, path("gateway.json"), rounds=1 if quick else 3)
    _predictor_tables(model, out_dir, quick)
    run_online_bench(model, policies, path("online.json"), duration=20.0 if quick else 60.0)
    return write_report(out_dir)


def _predictor_tables(model: str, out_dir: str, quick: bool) -> None:
    try:
        from services.predictor.eval import run_suite  # the predictor issue's evaluation
    except ImportError:
        return
    run_suite(model, out_dir, quick=quick)


def write_report(out_dir: str) -> str:
    parts = [
        "# HintServe benchmark report\n",
        f"Machine: {machine_description()}. Generated {dt.date.today().isoformat()} by `hintserve bench all`.\n",
    ]
    for title, name in SECTIONS:
        md = os.path.join(out_dir, name)
        if not os.path.isfile(md):
            continue
        with open(md) as f:
            body = f.read().split("\n", 1)[1].strip()  # drop the file's own title
        parts.append(f"## {title}\n\n{body}\n")
    report = os.path.join(out_dir, "REPORT.md")
    with open(report, "w") as f:
        f.write("\n".join(parts))
    return report
