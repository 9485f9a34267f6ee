"""Loaders for the real routing traces in ../shared/data/routing into our in-memory format (TraceSet).

The format is detected from the first record, so any file in one of these layouts loads:
- Mixtral (speculative-moe): one record per (problem, generated token, layer) with top-2 renormalised
  `gating_probs`. Decode only; a token missing any layer is dropped. probs row = the two weights placed in an
  E-vector (the rest of the softmax was not logged). No embeddings. Records with `token_pos` instead of
  `token_idx` (the raw, un-post-processed layout) are split into forward passes where the layer index goes
  back down; a pass with several tokens is the prefill (iteration 0), a one-token pass a decode step.
- Qwen1.5-MoE (vLLM logger): one file per logged layer (0, 8, 12, 18, 23 of 24), rows in forward-batch
  order, no request ids. See `load_qwen_logger` for what is reconstructed and its limits.
- FLAME-MoE (DynaNDE): 64 experts, top-6, layers 2-9, teacher-forced. The decode file has token ids, turned
  into a hashed one-hot embedding (same token -> same key) for semantic search.
"""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict

import numpy as np

from services.common.iteration_context import IterationContext, RequestTrace
from services.predictor.trace_set import TraceSet, iteration_from_routing, merge_traces

QWEN_DUMMY_ROWS = 8192 + 256  # vLLM profiling / CUDA-graph warm-up passes (one constant route each)


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _first_record(path: str) -> dict:
    with open(path) as f:
        for line in f:
            if line.strip():
                return json.loads(line)
    raise ValueError(f"{path}: empty file")


def load_routing_file(path: str) -> TraceSet:
    """Dispatches on the content of `path` (a file, or a directory of one kind of file)."""
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "*_routing.jsonl")))
        if files:
            return merge_traces([load_mixtral_routing(f) for f in files])
        if glob.glob(os.path.join(path, "moe_layer*.jsonl")):
            return load_qwen_logger(path)
        flame = sorted(glob.glob(os.path.join(path, "flame_decode*.jsonl")))
        if flame:
            return load_flame(flame[0])
        raise ValueError(f"{path}: no routing trace found (index.json, *_routing.jsonl, moe_layer*.jsonl, flame_*)")
    try:
        first = _first_record(path)
    except json.JSONDecodeError:
        raise ValueError(f"{path}: not a JSONL routing trace") from None
    if first.get("type") == "meta" or first.get("type") == "route":
        return load_qwen_logger(os.path.dirname(path) or ".")
    if {"problem_id", "layer", "experts", "gating_probs"} <= first.keys():
        return load_mixtral_routing(path)
    if {"layer", "experts", "scores"} <= first.keys() and ("seq" in first or "row" in first):
        return load_flame(path)
    raise ValueError(f"{path}: unknown routing format (first record keys {sorted(first)})")


def load_mixtral_routing(path: str, num_experts: int = 8) -> TraceSet:
    rows = _read_jsonl(path)
    if rows and "token_idx" not in rows[0]:
        return _load_mixtral_raw(rows, path, num_experts)
    num_layers = max(r["layer"] for r in rows) + 1
    top_k = len(rows[0]["experts"])
    cells: dict[tuple[str, int], dict[int, dict]] = defaultdict(dict)
    for r in rows:
        cells[(f"{r.get('dataset', 'problem')}/{r['problem_id']}", r["token_idx"])][r["layer"]] = r
    requests: dict[str, RequestTrace] = {}
    for (rid, token), layers in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if len(layers) < num_layers:
            continue  # incomplete token: some layer was not logged
        experts = np.array([layers[lay]["experts"] for lay in range(num_layers)])
        weights = np.array([layers[lay]["gating_probs"] for lay in range(num_layers)], np.float32)
        request = requests.setdefault(rid, RequestTrace(rid, [], os.path.basename(path)))
        # iteration = generated-token index + 1: these traces have no prefill record (iteration 0).
        request.iterations.append(iteration_from_routing(rid, token + 1, experts, weights, num_experts))
    return TraceSet(list(requests.values()), num_layers, num_experts, top_k, list(range(num_layers)),
                    source=path, notes="mixtral top-2 renormalised weights; decode only; no embeddings")


def _load_mixtral_raw(rows: list[dict], path: str, num_experts: int) -> TraceSet:
    """The raw layout (`token_pos` = row inside the vLLM batch): forward passes split where the layer drops."""
    num_layers = max(r["layer"] for r in rows) + 1
    top_k = len(rows[0]["experts"])
    by_problem: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_problem[f"{r.get('dataset', 'problem')}/{r['problem_id']}"].append(r)
    requests = []
    for rid, records in by_problem.items():
        passes: list[list[dict]] = [[]]
        for r in records:
            if passes[-1] and r["layer"] < passes[-1][-1]["layer"]:
                passes.append([])
            passes[-1].append(r)
        request = RequestTrace(rid, [], os.path.basename(path))
        decode_steps = 0
        for p in passes:
            per_layer: dict[int, list[dict]] = defaultdict(list)
            for r in p:
                per_layer[r["layer"]].append(r)
            sizes = {len(v) for v in per_layer.values()}
            if len(per_layer) < num_layers or len(sizes) != 1:
                continue  # missing cells: the pass cannot be lined up across layers
            n = sizes.pop()
            experts = np.array([[r["experts"] for r in per_layer[lay]] for lay in range(num_layers)])  # [L,n,k]
            weights = np.array([[r["gating_probs"] for r in per_layer[lay]] for lay in range(num_layers)])
            probs = np.zeros((num_layers, n, num_experts), np.float32)
            np.put_along_axis(probs, experts, weights.astype(np.float32), axis=2)
            counts = (probs > 0).sum(1).astype(np.float32)
            decode_steps += n == 1
            iteration = 0 if n > 1 else decode_steps
            request.iterations.append(IterationContext(rid, iteration, probs.mean(1), counts,
                                                       np.zeros(0, np.float32), num_tokens=n))
        if request.iterations:
            requests.append(request)
    if not requests:
        raise ValueError(f"{path}: no complete forward passes (token_pos layout)")
    return TraceSet(requests, num_layers, num_experts, top_k, list(range(num_layers)), source=path,
                    notes="mixtral raw token_pos layout: passes split on layer order; duplicates kept")


def load_qwen_logger(directory: str, num_experts: int = 60) -> TraceSet:
    """Qwen1.5-MoE vLLM logger files moe_layer{N}.jsonl -> decode iterations of pseudo-requests.

    Reconstructed: forward passes (token_idx restarts at 0); the two dummy passes, the 65-row warm-up and the
    batched prefill (1,406 rows, no prompt boundaries) are dropped; the decode steps (25 -> 11 rows) are kept.
    Rows carry no request id, so a pseudo-request is one batch slot within a run of steps of constant batch
    size (vLLM may reorder slots when a request finishes, so runs are cut there).
    Limits: slot identity is only weakly supported by the data (same slot, next step: 2.3 shared experts
    of 20 over 5 layers vs 1.4 for another slot; two steps apart no better than another slot), so history
    features (previous token, request EAM) are measured on a noisy mapping. Only 5 of 24 layers: a distance
    d counts logged layers (d=1 is 4-6 real layers). The 5 files come from 5 separate runs with the same seed
    and identical batch structure; rows are assumed to line up (same tokens) across files.
    """
    files = glob.glob(os.path.join(directory, "moe_layer*.jsonl"))
    if not files:
        raise ValueError(f"{directory}: no moe_layer*.jsonl files")
    layer_files = sorted((int(os.path.basename(f)[9:-6]), f) for f in files)
    per_layer = []
    for _, f in layer_files:
        with open(f) as fh:
            lines = [line for line in fh if line.strip()]
        if not lines or json.loads(lines[0]).get("type") != "meta":
            raise ValueError(f"{f}: expected a vLLM MoE logger file (meta line first)")
        rows = [json.loads(line) for line in lines[1 + QWEN_DUMMY_ROWS:]]  # the dummy rows are never parsed
        passes: list[list[dict]] = []
        for r in rows:
            if r["token_idx"] == 0 or not passes:
                passes.append([])
            passes[-1].append(r)
        per_layer.append(passes[2:])  # drop the warm-up pass and the batched prefill
    shapes = {tuple(len(p) for p in passes) for passes in per_layer}
    if len(shapes) != 1:
        raise ValueError(f"{directory}: layer files have different batch structures; cannot line them up")
    top_k = len(per_layer[0][0][0]["topk_ids"])
    sizes = [len(p) for p in per_layer[0]]
    requests: list[RequestTrace] = []
    step = 0
    while step < len(sizes):
        end = step
        while end < len(sizes) and sizes[end] == sizes[step]:
            end += 1
        run = [RequestTrace(f"run{step:03d}-slot{j:02d}", [], "qwen15moe-vllm-logger") for j in range(sizes[step])]
        for s in range(step, end):
            for j, request in enumerate(run):
                experts = np.array([per_layer[i][s][j]["topk_ids"] for i in range(len(layer_files))])
                weights = np.array([per_layer[i][s][j]["topk_weights"] for i in range(len(layer_files))], np.float32)
                request.iterations.append(
                    iteration_from_routing(request.request_id, s + 1, experts, weights, num_experts))
        requests += run
        step = end
    return TraceSet(requests, len(layer_files), num_experts, top_k, [lay for lay, _ in layer_files],
                    source=directory, notes="qwen1.5-moe: 5 of 24 layers; pseudo-requests = batch slots (see loader)")


def _token_embedding(token_id: int, dim: int = 64) -> np.ndarray:
    """A fixed pseudo-embedding per token id: cosine 1 for the same token, about 0 otherwise."""
    rng = np.random.default_rng(token_id)
    return rng.standard_normal(dim).astype(np.float32)


def load_flame(path: str, num_experts: int = 64) -> TraceSet:
    rows = _read_jsonl(path)
    layer_ids = sorted({r["layer"] for r in rows})
    top_k = len(rows[0]["experts"])
    if "seq" in rows[0]:
        key = [(r["seq"], r["pos"]) for r in rows]
    else:  # prefill file: 4 contiguous 512-token sequences, teacher forced (= per-token decode routing)
        key = [(r["row"] // 512, r["row"] % 512) for r in rows]
    cells: dict[tuple[int, int], dict[int, dict]] = defaultdict(dict)
    for k, r in zip(key, rows):
        cells[k][r["layer"]] = r
    requests: dict[int, RequestTrace] = {}
    for (seq, pos), layers in sorted(cells.items()):
        if len(layers) < len(layer_ids):
            continue
        experts = np.array([layers[lay]["experts"] for lay in layer_ids])
        weights = np.array([layers[lay]["scores"] for lay in layer_ids], np.float32)
        token = layers[layer_ids[0]].get("token_id")
        emb = None if token is None else _token_embedding(int(token))
        request = requests.setdefault(seq, RequestTrace(f"seq{seq:03d}", [], os.path.basename(path)))
        request.iterations.append(iteration_from_routing(request.request_id, pos + 1, experts, weights,
                                                         num_experts, emb))
    return TraceSet(list(requests.values()), len(layer_ids), num_experts, top_k, layer_ids, source=path,
                    notes="flame-moe-290m: layers 2-9, top-6 softmax scores (not renormalised), teacher forced")
