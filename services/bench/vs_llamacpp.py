"""`hintserve bench vs-llamacpp`: llama.cpp and HintServe on the same checkpoint, format by format, at batch 1.

Per format pair (FORMATS) and thread count: decode tok/s (greedy tokens after a short prompt, the first token,
which the prefill makes, excluded) and prefill tok/s (one long prompt). Each case runs in a fresh process with
OMP_NUM_THREADS and the system's own thread setting at the case's thread count, so no system inherits the
other's caches, threads or memory; in each round every case runs once per system, the systems' order flipping
each round; the table reports medians and the JSON keeps every round. HintServe runs through LLMEngine, the
core `hintserve generate` drives; its figures are the engine's own step timings (decode and prefill seconds),
llama.cpp's the time around its decode calls and the logits read. Peak RSS per case is recorded too.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from services.bench import llamacpp
from services.common.report import bar_plot, markdown_table, run_header, write_json, write_markdown
from services.engine.demo_model.tokenizer import SPECIAL_TOKENS


@dataclass(frozen=True)
class FormatPair:
    """One llama.cpp file type and the HintServe settings that store the same model at matching bits."""

    gguf: str  # llama.cpp's name of the file type
    outtype: str  # convert_hf_to_gguf.py's --outtype writing it, or writing the file it is quantized from
    quantize_ftype: int | None  # llama_model_quantize's LLAMA_FTYPE_* where the converter cannot write it
    engine: dict = field(default_factory=dict)  # EngineConfig fields


# The one table of matching formats: expert_dtype sets the routed experts', weight_dtype every other matrix's.
FORMATS: dict[str, FormatPair] = {
    # Whole models on both sides: every matrix but the router, norms and embedding table in the format.
    "f32": FormatPair("F32", "f32", None, {"dtype": "float32"}),
    "bf16": FormatPair("BF16", "bf16", None, {"dtype": "float32", "expert_dtype": "bf16", "weight_dtype": "bf16"}),
    "q8_0": FormatPair("Q8_0", "q8_0", None, {"dtype": "float32", "expert_dtype": "int8", "weight_dtype": "int8"}),
    # Q4_0: 32 weights share an fp16 scale, 4.5 bits a weight; our int4 at group 64 (a bf16 scale and zero per
    # group) costs the same 4.5 bits.
    "q4_0": FormatPair("Q4_0", "bf16", 2, {"dtype": "float32", "expert_dtype": "int4", "expert_group_size": 64,
                                           "weight_dtype": "int4", "weight_group_size": 64}),
}
SYSTEMS = ("llama.cpp", "hintserve")


@dataclass(frozen=True)
class Workload:
    prompt_len: int = 32
    new_tokens: int = 64
    prefill_len: int = 512
    seed: int = 0

    def case(self, vocab_size: int) -> dict:
        """Prompt ids drawn past the demo tokenizer's special tokens (its first ids), the same for both."""
        gen = torch.Generator().manual_seed(self.seed)
        draw = torch.randint(len(SPECIAL_TOKENS), vocab_size, (self.prompt_len + self.prefill_len,), generator=gen).tolist()
        n_ctx = max(self.prompt_len + self.new_tokens, self.prefill_len) + 16
        return {"prompt": draw[: self.prompt_len], "prefill_prompt": draw[self.prompt_len :],
                "new_tokens": self.new_tokens, "n_ctx": n_ctx, "n_batch": self.prefill_len}


def gguf_file(model_dir: str, gguf_dir: Path, fmt: str, llama_python: str, src: str | None) -> Path:
    """The GGUF file of `fmt`, converted (and quantized) on first use."""
    pair = FORMATS[fmt]
    name = Path(model_dir.rstrip("/")).name
    base = llamacpp.convert(model_dir, src, pair.outtype, gguf_dir / f"{name}-{pair.outtype.upper()}.gguf")
    if pair.quantize_ftype is None:
        return base
    return llamacpp.quantize(llama_python, base, pair.quantize_ftype, gguf_dir / f"{name}-{pair.gguf}.gguf",
                             os.cpu_count() or 1)


def run_hintserve(model_dir: str, fmt: str, threads: int, case: dict) -> dict:
    """One timed case in a fresh HintServe process (`hintserve_worker` below)."""
    args = json.dumps({"model": model_dir, "engine": FORMATS[fmt].engine, "case": case})
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = llamacpp.run_checked([sys.executable, "-m", "services.bench.vs_llamacpp", args],
                               f"hintserve {fmt} ({threads} threads)", env)
    return json.loads(out.strip().splitlines()[-1])


def hintserve_worker(args: dict) -> dict:
    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine
    from services.engine.sampling_params import SamplingParams

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # what OMP_NUM_THREADS does; said outright
    case = args["case"]
    start_rss_mb = current_rss_mb()  # the interpreter and torch (ru_maxrss starts at the parent's peak)
    start = time.perf_counter()
    config = EngineConfig(model=args["model"], max_num_seqs=1, max_model_len=case["n_ctx"], **args["engine"])
    engine = LLMEngine(config, detokenize=False)
    load_s = time.perf_counter() - start
    tensor_mb = live_tensor_bytes() / 2**20
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=case["new_tokens"], ignore_eos=True)
        engine.generate([case["prompt"][:8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        before = engine.stats()
        tokens = engine.generate([case["prompt"]], greedy)[0]
        mid = engine.stats()
        engine.generate([case["prefill_prompt"]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        after = engine.stats()
    finally:
        engine.close()

    def delta(a: dict, b: dict, key: str) -> float:
        return b[key] - a.get(key, 0.0)

    return {"decode_tok_s": delta(before, mid, "decode_tokens_total") / delta(before, mid, "decode_seconds_total"),
            "prefill_tok_s": delta(mid, after, "prefill_tokens_total") / delta(mid, after, "prefill_seconds_total"),
            "ttft_s": delta(before, mid, "prefill_seconds_total"), "load_s": load_s, "tokens": tokens,
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "tensor_mb": tensor_mb,
            "start_rss_mb": start_rss_mb}


def current_rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))


def live_tensor_bytes() -> int:
    """Bytes of every live CPU tensor storage (each counted once): after the load, the weights in their formats
    plus a KV cache of n_ctx tokens, what peak RSS is held against."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run_vs_llamacpp(model_dir: str, llama_python: str, llama_src: str | None, gguf_dir: str, formats: list[str],
                    threads: list[int], json_path: str, load: Workload = Workload(), rounds: int = 3) -> dict:
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    case = load.case(vocab)
    ggufs = {f: gguf_file(model_dir, Path(gguf_dir), f, llama_python, llama_src) for f in formats}
    runs = {s: {f: {str(t): [] for t in threads} for f in formats} for s in SYSTEMS}
    header = {**run_header(), "model": os.path.abspath(model_dir), "llama_python": llama_python,
              "workload": asdict(load), "formats": {f: asdict(FORMATS[f]) | {"file": str(ggufs[f]),
                                                                             "gguf_bytes": ggufs[f].stat().st_size}
                                                    for f in formats}, "threads": threads, "rounds": rounds}
    with tqdm(total=rounds * len(formats) * len(threads) * 2, desc="bench vs-llamacpp", unit="case") as bar:
        for r in range(rounds):
            for f in formats:
                for t in threads:
                    for system in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
                        bar.set_postfix_str(f"round {r + 1} {f} {t} thread(s) {system}")
                        try:
                            figures = (llamacpp.run_llama(llama_python, ggufs[f], t, case)
                                       if system == "llama.cpp" else run_hintserve(model_dir, f, t, case))
                        except RuntimeError as exc:  # one crashed case is a result too; the others still run
                            figures = {"error": str(exc)}
                        runs[system][f][str(t)].append(figures)
                        bar.update()
            result = _write(json_path, header, runs, formats, threads)
    return result


def _median(rounds: list[dict], key: str) -> float | None:
    values = [r[key] for r in rounds if "error" not in r and r.get(key) is not None]  # some keys are ours only
    return statistics.median(values) if values else None


def _write(json_path: str, header: dict, runs: dict, formats: list[str], threads: list[int]) -> dict:
    """The result so far (rewritten after every round, so an interrupted run keeps what it measured)."""
    keys = ("decode_tok_s", "prefill_tok_s", "max_rss_mb", "load_s", "tensor_mb", "start_rss_mb")
    medians = {s: {f: {t: {k: _median(rs, k) for k in keys} for t, rs in by_t.items()} for f, by_t in by_f.items()}
               for s, by_f in runs.items()}
    result = {**header, "rows": ratio_rows(medians, formats, threads), "medians": medians, "rounds_kept": runs}
    write_json(json_path, result)
    rows = []
    for f in formats:
        for t in map(str, threads):
            ours, theirs = medians["hintserve"][f][t], medians["llama.cpp"][f][t]
            if not runs["hintserve"][f][t]:
                continue
            rows.append((f"{f} / {FORMATS[f].gguf}", t, _fig(ours["decode_tok_s"]), _fig(theirs["decode_tok_s"]),
                         _ratio(ours["decode_tok_s"], theirs["decode_tok_s"]), _fig(ours["prefill_tok_s"]),
                         _fig(theirs["prefill_tok_s"]), _ratio(ours["prefill_tok_s"], theirs["prefill_tok_s"]),
                         f"{_fig(ours['max_rss_mb'], '.0f')} / {_fig(theirs['max_rss_mb'], '.0f')}"))
    done = len(next(iter(next(iter(runs["hintserve"].values())).values())))
    w = header["workload"]
    note = (f"Batch 1; decode: {w['new_tokens']} greedy tokens after a {w['prompt_len']}-token prompt (the first "
            f"token excluded); prefill: one {w['prefill_len']}-token prompt. Medians of {done} round(s), every "
            f"round in the JSON. HintServe settings per format: "
            + "; ".join(f"{f}: {FORMATS[f].engine}" for f in formats) + ".\n\n")
    table = markdown_table(["format (ours / GGUF)", "threads", "HintServe decode tok/s", "llama.cpp decode tok/s",
                            "decode ratio", "HintServe prefill tok/s", "llama.cpp prefill tok/s", "prefill ratio",
                            "peak RSS MB (ours / llama.cpp)"], rows)
    stem = os.path.splitext(json_path)[0]
    write_markdown(stem + ".md", "HintServe vs llama.cpp (CPU, batch 1)", header, note + table + "\n"
                   + _agreement(runs, formats, threads) + _failures(runs))
    labels = [f"{f} t{t}" for f in formats for t in threads]
    bar_plot(stem + ".png", "Decode tok/s at batch 1 (medians)", labels,
             {s: [medians[s][f][str(t)]["decode_tok_s"] or 0.0 for f in formats for t in threads] for s in SYSTEMS},
             "tok/s")
    return result


def ratio_rows(medians: dict, formats: list[str], threads: list[int]) -> list[dict]:
    """One record per (format, threads) with both systems' medians and our ratios (what the docs quote)."""
    rows = []
    for f in formats:
        for t in map(str, threads):
            ours, theirs = medians["hintserve"][f].get(t), medians["llama.cpp"][f].get(t)
            if not ours or not theirs:
                continue
            rows.append({
                "format": f"{f} / {FORMATS[f].gguf}", "threads": int(t),
                "hintserve_decode_tok_s": ours["decode_tok_s"], "llamacpp_decode_tok_s": theirs["decode_tok_s"],
                "decode_ratio": _quotient(ours["decode_tok_s"], theirs["decode_tok_s"]),
                "hintserve_prefill_tok_s": ours["prefill_tok_s"], "llamacpp_prefill_tok_s": theirs["prefill_tok_s"],
                "prefill_ratio": _quotient(ours["prefill_tok_s"], theirs["prefill_tok_s"]),
                "hintserve_rss_mb": ours["max_rss_mb"], "llamacpp_rss_mb": theirs["max_rss_mb"],
                "hintserve_tensor_mb": ours["tensor_mb"],
                "rss_over_tensors": _quotient(ours["max_rss_mb"], ours["tensor_mb"]),
                "rss_over_tensors_less_interpreter": _quotient(
                    None if ours["max_rss_mb"] is None or ours["start_rss_mb"] is None
                    else ours["max_rss_mb"] - ours["start_rss_mb"], ours["tensor_mb"])})
    return rows


def _quotient(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _agreement(runs: dict, formats: list[str], threads: list[int]) -> str:
    """Greedy tokens of the two systems in the first round, position by position (same math: f32)."""
    lines = []
    for f in formats:
        ours, theirs = runs["hintserve"][f][str(threads[0])], runs["llama.cpp"][f][str(threads[0])]
        if ours and theirs and "tokens" in ours[0] and "tokens" in theirs[0]:
            a, b = ours[0]["tokens"], theirs[0]["tokens"]
            same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            lines.append(f"{f}: first {same} of {len(a)} greedy tokens identical")
    return "\nGreedy tokens, HintServe vs llama.cpp: " + "; ".join(lines) + ".\n" if lines else ""


def _failures(runs: dict) -> str:
    """One line per failed case (the first failure's message, cut): a crash shows in the report, not only in
    the JSON."""
    lines = [f"- {s} {f}, {t} thread(s), {sum('error' in r for r in rs)} of {len(rs)} round(s): "
             f"{next(r['error'] for r in rs if 'error' in r)[:300]}"
             for s, by_f in runs.items() for f, by_t in by_f.items() for t, rs in by_t.items()
             if any("error" in r for r in rs)]
    return "\nFailed cases (n/a above):\n\n" + "\n".join(lines) + "\n" if lines else ""


def _fig(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> float | str:
    return round(a / b, 2) if a and b else "n/a"


if __name__ == "__main__":  # one HintServe case (run_hintserve's subprocess): its figures on the last line
    print(json.dumps(hintserve_worker(json.loads(sys.argv[1]))))
