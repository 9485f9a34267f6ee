"""`hintserve bench quant`: quality of int8/int4 experts on the demo model next to its bf16 checkpoint.

Validation perplexity (the demo model's recorded validation split, the windows `demo-model stats` scores) and
greedy-token agreement over `new_tokens` tokens on `prompts` prompts cut from that split, per expert dtype, all
computed by our engine (the quantized kernels included). `auto` is the bf16 checkpoint computed in fp32.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from services.common.report import bar_plot, markdown_table, run_header, write_json, write_markdown
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.models.attention import AttentionMetadata
from services.engine.sampling_params import SamplingParams
from services.engine.step_context import Phase, StepContext


def validation_windows(model_dir: str) -> torch.Tensor:
    from tokenizers import Tokenizer

    from services.engine.demo_model.cli import recorded_split
    from services.engine.demo_model.stats import make_windows
    from services.engine.demo_model.tokenizer import encode_documents

    val, settings = recorded_split(Path(model_dir))
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return make_windows(encode_documents(tokenizer, val), settings.get("seq_len", 256),
                        settings.get("eval_windows", 64))


@torch.inference_mode()
def engine_perplexity(engine: LLMEngine, windows: torch.Tensor) -> float:
    """exp(mean next-token cross-entropy), each window one prefill through our model."""
    model, device = engine.model, engine.runner.device
    total, count = 0.0, 0
    for ids in windows:
        n = len(ids)
        meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n, device=device), seq_lens=[n])
        ctx = StepContext(phase=Phase.PREFILL, request_ids=["ppl"], num_tokens=n, step_index=0, seq_lens=[n],
                          iterations=[0])
        ids = ids.to(device)
        logits = model.compute_logits(model.forward(ids, torch.arange(n, device=device), meta, ctx))
        total += F.cross_entropy(logits[:-1], ids[1:], reduction="sum").item()
        count += n - 1
    return math.exp(total / count)


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[float, int]:
    """(fraction of positions with the reference's token, prompts whose whole continuation matches)."""
    same = sum(a == b for out, ref in zip(tokens, reference, strict=True) for a, b in zip(out, ref, strict=True))
    return same / sum(map(len, reference)), sum(out == ref for out, ref in zip(tokens, reference, strict=True))


def run_quant_bench(model_dir: str, dtypes: list[str], group_sizes: list[int], out_json: str, prompts: int,
                    new_tokens: int, prompt_len: int) -> list[dict]:
    windows = validation_windows(model_dir)
    prompt_ids = [w[:prompt_len].tolist() for w in windows[torch.linspace(0, len(windows) - 1, prompts).long()]]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    cases = [(d, g) for d in dtypes for g in (group_sizes if d == "int4" else [group_sizes[0]])]
    rows, reference = [], None
    for dtype, group in tqdm(cases, desc="expert dtypes", unit="case"):
        engine = LLMEngine(EngineConfig(model=model_dir, expert_dtype=dtype, expert_group_size=group))
        try:
            start = time.perf_counter()
            ppl = engine_perplexity(engine, windows)
            seconds = time.perf_counter() - start
            tokens = engine.generate(prompt_ids, params)
            expert_bytes = engine.model.experts.device_bytes
        finally:
            engine.close()
        reference = reference or tokens
        same, identical = agreement(tokens, reference)
        rows.append({"expert_dtype": dtype, "group_size": group if dtype == "int4" else None,
                     "val_perplexity": ppl, "agreement": same, "identical_prompts": identical,
                     "expert_mb": expert_bytes / 1e6, "ppl_seconds": seconds})
    base = rows[0]["val_perplexity"]
    for row in rows:
        row["ppl_vs_reference"] = row["val_perplexity"] / base - 1
    _write(rows, out_json, windows, prompts, new_tokens)
    return rows


def _label(row: dict) -> str:
    name = "bf16 checkpoint (auto, fp32 compute)" if row["expert_dtype"] == "auto" else row["expert_dtype"]
    return f"{name} g{row['group_size']}" if row["group_size"] else name


def _write(rows: list[dict], out_json: str, windows: torch.Tensor, prompts: int, new_tokens: int) -> None:
    header = run_header()
    meta = {"val_windows": len(windows), "window_tokens": windows.shape[1], "prompts": prompts,
            "new_tokens": new_tokens}
    write_json(out_json, {**header, **meta, "rows": rows})
    table = markdown_table(
        ["experts", "val perplexity", "vs auto", f"greedy agreement ({prompts} x {new_tokens} tok)",
         "identical prompts", "all experts (MB)"],
        [(_label(r), r["val_perplexity"], f"{r['ppl_vs_reference']:+.2%}", f"{r['agreement']:.1%}",
          f"{r['identical_prompts']}/{prompts}", round(r["expert_mb"], 1)) for r in rows],
    )
    note = (f"Validation split of the demo model ({len(windows)} windows of {windows.shape[1]} tokens); "
            "agreement: position-wise equality of greedy continuations with the first row's.")
    write_markdown(out_json[: -len(".json")] + ".md", "Quantized experts: quality on the demo model",
                   header, note + "\n\n" + table)
    bar_plot(out_json[: -len(".json")] + ".png", "Demo model validation perplexity by expert storage",
             [_label(r) for r in rows], {"perplexity": [r["val_perplexity"] for r in rows]}, "perplexity")
