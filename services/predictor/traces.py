"""Routing traces: record them from our engine, save/load our compact format, load any supported trace.

On disk a trace is a directory with `index.json` (model shape, layer ids, one entry per request) and
`trace.npz` (all iterations concatenated: probs [N,L,E] f32, counts [N,L,E] u16, embedding [N,H] f16,
iteration/num_tokens/request index [N]). With `--layer-inputs` it also holds every token's residual stream
entering each MoE block ([T,L,H] f16) and its selected experts ([T,L,k] u8), with per-iteration token
offsets, for the learned gate and the skip-gate. `load_traces(path)` reads this format or any real routing
trace the loaders in `trace_loaders.py` understand.
"""

from __future__ import annotations

import json
import os

import numpy as np

from services.common.iteration_context import RequestTrace, TracedIteration
from services.predictor.trace_loaders import load_routing_file
from services.predictor.trace_set import TraceSet
from services.predictor.trace_set import (
    iteration_from_routing as iteration_from_routing,  # re-exported for callers
)

FORMAT = "hintserve-trace-v1"


def save_traces(trace: TraceSet, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    its = [it for r in trace.requests for it in r.iterations]
    if not its:
        raise ValueError("no iterations to save")
    arrays: dict[str, np.ndarray] = {
        "probs": np.stack([it.probs for it in its]).astype(np.float32),
        "counts": np.stack([it.counts for it in its]).astype(np.uint16),
        "embedding": np.stack([it.embedding for it in its]).astype(np.float16),
        "iteration": np.array([it.iteration for it in its], np.int32),
        "num_tokens": np.array([it.num_tokens for it in its], np.int32),
        "request": np.repeat(np.arange(len(trace.requests)), [len(r.iterations) for r in trace.requests]),
    }
    if trace.has_layer_inputs:
        sizes = [0 if getattr(it, "layer_inputs", None) is None else len(it.layer_inputs) for it in its]
        arrays["token_offsets"] = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        arrays["layer_inputs"] = np.concatenate([it.layer_inputs for it in its if it.layer_inputs is not None])
        arrays["token_experts"] = np.concatenate([it.token_experts for it in its if it.token_experts is not None])
    np.savez(os.path.join(out_dir, "trace.npz"), **arrays)
    index = {
        "format": FORMAT,
        "model": trace.model,
        "model_hash": trace.model_hash,
        "source": trace.source,
        "notes": trace.notes,
        "num_layers": trace.num_layers,
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "layer_ids": list(trace.layer_ids),
        "hidden_size": int(arrays["embedding"].shape[1]),
        "num_iterations": len(its),
        "requests": [{"id": r.request_id, "source": r.source, "iterations": len(r.iterations)}
                     for r in trace.requests],
    }
    with open(os.path.join(out_dir, "index.json"), "w") as f:
        json.dump(index, f, indent=1)


def load_hintserve_trace(path: str) -> TraceSet:
    with open(os.path.join(path, "index.json")) as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} trace (format {index.get('format')!r})")
    data = np.load(os.path.join(path, "trace.npz"))
    probs, counts, emb = data["probs"], data["counts"].astype(np.float32), data["embedding"].astype(np.float32)
    iteration, num_tokens, req = data["iteration"], data["num_tokens"], data["request"]
    offsets = data["token_offsets"] if "token_offsets" in data else None
    inputs = data["layer_inputs"] if offsets is not None else None
    experts = data["token_experts"] if offsets is not None else None
    requests = [RequestTrace(r["id"], [], r.get("source", "")) for r in index["requests"]]
    for n in range(len(probs)):
        request = requests[int(req[n])]
        it = TracedIteration(request.request_id, int(iteration[n]), probs[n], counts[n], emb[n],
                             num_tokens=int(num_tokens[n]))
        if offsets is not None and inputs is not None and experts is not None and offsets[n + 1] > offsets[n]:
            it.layer_inputs = inputs[offsets[n]:offsets[n + 1]]
            it.token_experts = experts[offsets[n]:offsets[n + 1]]
        request.iterations.append(it)
    return TraceSet(requests, index["num_layers"], index["num_experts"], index["top_k"], index["layer_ids"],
                    index.get("source", path), index.get("model", ""), index.get("notes", ""),
                    index.get("model_hash", ""))


def load_traces(path: str) -> TraceSet:
    """Our trace directory, or any real routing trace file/directory (format detected from the content)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"trace not found: {path}")
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "index.json")):
        return load_hintserve_trace(path)
    return load_routing_file(path)


def read_prompts(path: str, limit: int | None = None) -> list[str]:
    """Prompts from jsonl (GSM8K `question`, HumanEval `prompt`, or {"prompt": ...}) or a text file (one a line)."""
    prompts: list[str] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.endswith(".jsonl") or line.lstrip().startswith("{"):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
                text = record.get("prompt") or record.get("question") if isinstance(record, dict) else None
                if not isinstance(text, str) or not text:
                    raise ValueError(f"{path}:{n}: expected a 'prompt' or 'question' string field")
                prompts.append(text)
            else:
                prompts.append(line)
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


def collect_traces(model: str, prompts: list[str], max_tokens: int = 32, batch: int = 8,
                   layer_inputs: bool = False, progress: bool = True) -> TraceSet:
    """Greedy-decodes `prompts` with our engine (exactly max_tokens each) and records every iteration."""
    from tqdm import tqdm

    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine
    from services.engine.sampling_params import SamplingParams
    from services.engine.trace_recorder import TraceRecorder

    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=batch))
    try:
        recorder = TraceRecorder(engine.spec.num_experts, layer_inputs)
        engine.runner.step_observers.append(recorder)
        engine.runner.keep_layer_inputs = layer_inputs
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        ids = [f"req-{i:04d}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        with tqdm(total=len(prompts) * max_tokens, unit="tok", desc="trace collect", disable=not progress) as bar:
            while engine.has_unfinished():
                bar.update(len(engine.step()))
        spec = engine.spec
    finally:
        engine.close()
    return TraceSet(recorder.requests(ids), len(recorder.layer_ids), spec.num_experts, spec.top_k,
                    recorder.layer_ids, source=f"engine:{os.path.basename(os.path.normpath(model))}",
                    model=os.path.abspath(model), notes=f"greedy, {max_tokens} tokens per prompt, ignore_eos",
                    model_hash=model_fingerprint(model))


def model_fingerprint(model_dir: str) -> str:
    """sha256 (16 hex digits) of the model's weight files: a trace is only valid with the same weights."""
    import glob
    import hashlib

    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()[:16]
