"""`hintserve bench all` (`make bench`): every benchmark the docs quote, then bench/results/REPORT.md.

Each step is the same `hintserve ...` command a user would type (listed in REPORT.md), so every figure can be
reproduced one table at a time. The offload grid runs once per case; the headline case (25% cache, link ratio
30) runs `repeats` times and reports medians.
"""

from __future__ import annotations

import datetime as dt
import os
import shlex
import tempfile
from collections.abc import Callable

from services.common.report import machine_description

SHARED = os.environ.get("HINTSERVE_SHARED", os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared"))
PROMPTS = ("data/prompts/gsm8k_humaneval/gsm8k_test.jsonl", "data/prompts/gsm8k_humaneval/humaneval.jsonl")
ROUTING = {
    "mixtral": "data/routing/mixtral-speculative-moe/humaneval_2_routing.jsonl",
    "qwen": "data/routing/qwen15moe-weiran-vllm-logger",
}

SECTIONS = (  # (title, markdown file written by the benchmark)
    ("Engine throughput", "engine.md"),
    ("Offload policies: 25% cache, link ratio 30 (medians)", "offload.md"),
    ("Offload policies: cache x link x batch grid", "offload_grid.md"),
    ("Gateway overhead", "gateway.md"),
    ("Predictors on the demo model", "predictor_demo.md"),
    ("Predictors on real Mixtral routing", "predictor_mixtral.md"),
    ("Predictors on real Qwen routing", "predictor_qwen.md"),
    ("Hint delivery latency", "hints.md"),
    ("Online serving (Azure conv replay)", "online.md"),
    ("Simulated Mixtral-8x7B on an RTX A5000", "simulate_mixtral_a5000.md"),
)


def suite_commands(model: str, out: str, quick: bool = False) -> list[list[str]]:
    """The `hintserve` argument lists `bench all` runs, in order."""
    path = lambda name: os.path.join(out, name)  # noqa: E731
    repeats = "1" if quick else "3"
    cmds = [
        ["bench", "engine", "--model", model, "--json", path("engine.json"), "--repeats", "1" if quick else "2"],
        ["bench", "offload", "--model", model, "--policies", "all,lru@next-use,speculative@next-use",
         "--cache", "25%", "--link-ratio", "30", "--batch", "1,4,16", "--repeats", repeats,
         "--json", path("offload.json")],
    ]
    if not quick:
        cmds.append(["bench", "offload", "--model", model, "--cache", "10%,25%,50%", "--link-ratio", "10,30,100",
                     "--batch", "1,4,16", "--json", path("offload_grid.json")])
    cmds.append(["bench", "gateway", "--model", model, "--json", path("gateway.json"), "--rounds", repeats])
    cmds += _predictor_commands(model, out, quick)
    cmds.append(["bench", "hints", "--json", path("hints.json"), "--steps", "200" if quick else "1000"])
    cmds.append(["bench", "online", "--model", model, "--json", path("online.json"),
                 "--duration", "20" if quick else "60"])
    mixtral = os.path.join(SHARED, ROUTING["mixtral"])
    if os.path.exists(mixtral):
        cmds.append(["simulate", "--model-spec", "mixtral-8x7b", "--hardware", "a5000-pcie4", "--trace", mixtral,
                     "--policies", "all", "--json", path("simulate_mixtral_a5000.json"), "--quiet"])
    return cmds


def _predictor_commands(model: str, out: str, quick: bool) -> list[list[str]]:
    prompts = [os.path.join(SHARED, p) for p in PROMPTS]
    if not all(os.path.isfile(p) for p in prompts):
        return []
    traces = os.path.join(tempfile.gettempdir(), "hintserve-traces", os.path.basename(os.path.normpath(model)))
    collect = ["trace", "collect", "--model", model, "--layer-inputs", "--limit", "5" if quick else "20",
               "--max-tokens", "32", "--out", traces]
    for p in prompts:
        collect += ["--prompts", p]
    cmds = [collect]
    tests = {"demo": traces, **{k: os.path.join(SHARED, v) for k, v in ROUTING.items()}}
    for name, trace in tests.items():
        if os.path.exists(trace):
            cmds.append(["predictor", "eval", "--train", trace, "--test", trace, "--predictors", "all",
                         "--distance", "1,2,3,4", "--folds", "2", "--json", os.path.join(out, f"predictor_{name}.json")])
    return cmds


def run_all(model: str, out_dir: str, run: Callable[[list[str]], int], quick: bool = False) -> str:
    """Runs every suite command through `run` (the `hintserve` dispatcher, services.cli.main, a layer above)."""
    commands = suite_commands(model, out_dir, quick)
    for argv in commands:
        print(f"\n$ hintserve {shlex.join(argv)}", flush=True)
        code = run(argv)
        if code:
            raise RuntimeError(f"`hintserve {shlex.join(argv)}` exited with {code}")
    return write_report(out_dir, commands)


def write_report(out_dir: str, commands: list[list[str]] | None = None) -> str:
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
    if commands:
        listing = "\n".join(f"hintserve {shlex.join(c)}" for c in commands)
        parts.append(f"## Commands\n\n```\n{listing}\n```\n")
    report = os.path.join(out_dir, "REPORT.md")
    with open(report, "w") as f:
        f.write("\n".join(parts))
    return report
