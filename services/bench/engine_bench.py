"""`hintserve bench engine`: our engine's decode and prefill throughput next to transformers' generate()."""

from __future__ import annotations

import os
import statistics
import time

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from services.common.report import bar_plot, markdown_table, run_header, write_json, write_markdown
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sampling_params import SamplingParams

_TEXT = (
    "The transfer engine moves expert weights from host memory to the device while the previous layer computes. "
    "def schedule(requests):\n    for request in sorted(requests, key=lambda r: r.arrival):\n        yield request\n"
)


def _prompt_ids(engine: LLMEngine, length: int, offset: int) -> list[int]:
    ids = engine.tokenizer.encode(_TEXT * 40, add_special_tokens=False)
    start = (offset * 37) % max(1, len(ids) - length)
    return ids[start : start + length]


def _decode_throughput(engine: LLMEngine, concurrency: int, prompt_len: int, new_tokens: int) -> float:
    """Decode tokens per second over decode steps only, with `concurrency` requests in flight."""
    before = engine.stats()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate([_prompt_ids(engine, prompt_len, i) for i in range(concurrency)], params)
    after = engine.stats()
    tokens = after["decode_tokens_total"] - before.get("decode_tokens_total", 0.0)
    seconds = after["decode_seconds_total"] - before.get("decode_seconds_total", 0.0)
    return tokens / seconds


def _prefill_throughput(engine: LLMEngine, prompt_len: int, batch: int) -> float:
    before = engine.stats()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.generate([_prompt_ids(engine, prompt_len, i) for i in range(batch)], params)
    after = engine.stats()
    return (after["prefill_tokens_total"] - before.get("prefill_tokens_total", 0.0)) / (
        after["prefill_seconds_total"] - before.get("prefill_seconds_total", 0.0)
    )


@torch.inference_mode()
def _hf_figures(model_dir: str, prompt: list[int], new_tokens: int, prefill_len: int, dtype: torch.dtype):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, pad_token_id=model.config.eos_token_id)

    def timed(n: int) -> float:
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        return time.perf_counter() - start

    timed(4)  # warm-up
    decode = (new_tokens - 1) / (timed(new_tokens) - timed(1))
    long_ids = torch.tensor([(prompt * (prefill_len // len(prompt) + 1))[:prefill_len]])
    model(long_ids)
    start = time.perf_counter()
    model(long_ids)
    prefill = prefill_len / (time.perf_counter() - start)
    return decode, prefill


def run_engine_bench(
    model_dir: str,
    json_path: str,
    repeats: int = 3,
    new_tokens: int = 64,
    prompt_len: int = 64,
    prefill_len: int = 256,
    dtype: str = "float32",
) -> dict:
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=dtype, max_num_seqs=32))
    engine.generate([_prompt_ids(engine, prompt_len, 0)], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    figures: dict[str, list[float]] = {k: [] for k in ("single", "agg8", "agg32", "prefill", "hf_single", "hf_prefill")}
    for _ in tqdm(range(repeats), desc="bench engine", unit="round"):
        figures["single"].append(_decode_throughput(engine, 1, prompt_len, new_tokens))
        figures["agg8"].append(_decode_throughput(engine, 8, prompt_len, new_tokens))
        figures["agg32"].append(_decode_throughput(engine, 32, prompt_len, new_tokens))
        figures["prefill"].append(_prefill_throughput(engine, prefill_len, 4))
        hf_decode, hf_prefill = _hf_figures(
            model_dir, _prompt_ids(engine, prompt_len, 0), new_tokens, prefill_len, engine.dtype
        )
        figures["hf_single"].append(hf_decode)
        figures["hf_prefill"].append(hf_prefill)
    med = {k: statistics.median(v) for k, v in figures.items()}
    result = {
        **run_header(),
        "model": os.path.abspath(model_dir),
        "dtype": dtype,
        "repeats": repeats,
        "new_tokens": new_tokens,
        "prompt_len": prompt_len,
        "prefill_len": prefill_len,
        "single_decode_tok_s": med["single"],
        "aggregate_decode_tok_s_8": med["agg8"],
        "aggregate_decode_tok_s_32": med["agg32"],
        "prefill_tok_s": med["prefill"],
        "hf_single_decode_tok_s": med["hf_single"],
        "hf_prefill_tok_s": med["hf_prefill"],
        "aggregate_32_over_single": med["agg32"] / med["single"],
        "single_over_hf": med["single"] / med["hf_single"],
        "samples": figures,
    }
    rows = [
        ("decode, 1 request", med["single"], med["hf_single"]),
        ("decode, 8 concurrent (aggregate)", med["agg8"], float("nan")),
        ("decode, 32 concurrent (aggregate)", med["agg32"], float("nan")),
        (f"prefill ({prefill_len}-token prompts)", med["prefill"], med["hf_prefill"]),
    ]
    table = markdown_table(("tokens/s (median)", "hintserve", "transformers"), rows)
    table += (
        f"\n\n32-concurrent aggregate / single-stream: {result['aggregate_32_over_single']:.1f}x; "
        f"single-stream hintserve / transformers: {result['single_over_hf']:.2f}x."
    )
    print(table)
    write_json(json_path, result)
    stem = os.path.splitext(json_path)[0]
    write_markdown(stem + ".md", "Engine throughput", result, table)
    bar_plot(
        stem + ".png",
        "Engine throughput (tokens/s)",
        ["decode x1", "decode x8", "decode x32", "prefill"],
        {
            "hintserve": [med["single"], med["agg8"], med["agg32"], med["prefill"]],
            "transformers": [med["hf_single"], 0.0, 0.0, med["hf_prefill"]],
        },
        "tokens/s",
    )
    return result
