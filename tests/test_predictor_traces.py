"""Routing traces: the real-trace loaders, our engine's recorder, the npz format, prompt files."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from services.common.iteration_context import PredictionQuery
from services.common.request_history import RequestHistory
from services.predictor.eval import masked
from services.predictor.predictors.speculative import SpeculativePredictor
from services.predictor.traces import collect_traces, load_traces, read_prompts, save_traces
from tests.conftest import SHARED_DIR

ROUTING = SHARED_DIR / "data" / "routing"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: intra-op threads only add overhead here
    yield
    torch.set_num_threads(threads)


def _need(path) -> str:
    if not path.exists():
        pytest.skip(f"{path} not available")
    return str(path)


def test_mixtral_loader_drops_incomplete_tokens() -> None:
    trace = load_traces(_need(ROUTING / "mixtral-speculative-moe" / "humaneval_2_routing.jsonl"))
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (32, 8, 2)
    assert [r.request_id for r in trace.requests] == ["humaneval/0", "humaneval/1"]
    assert trace.num_iterations == 333  # 338 generated tokens, 5 incomplete
    it = trace.requests[1].iterations[0]
    assert it.iteration >= 1 and it.num_tokens == 1 and it.embedding.size == 0
    np.testing.assert_allclose(it.probs.sum(1), 1.0, atol=1e-5)  # top-2 renormalised weights
    assert (it.counts.sum(1) == 2).all() and ((it.probs > 0) == (it.counts > 0)).all()


def test_qwen_loader_reconstructs_decode_slots() -> None:
    trace = load_traces(_need(ROUTING / "qwen15moe-weiran-vllm-logger"))
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (5, 60, 4)
    assert trace.layer_ids == [0, 8, 12, 18, 23]
    assert trace.num_iterations == 2886  # every decode row, no dummy / warm-up / prefill rows
    assert len(trace.requests) == 235 and len(trace.requests[0].iterations) == 82
    it = trace.requests[0].iterations[0]
    assert (it.counts.sum(1) == 4).all() and (it.probs.sum(1) < 1).all()  # softmax over 60, not renormalised


def test_flame_loader_and_token_embeddings() -> None:
    trace = load_traces(_need(ROUTING / "flame-moe-290m-dynande" / "flame_decode_positions_layers2-9.jsonl"))
    assert (len(trace.requests), trace.num_iterations, trace.top_k, trace.layer_ids[0]) == (64, 640, 6, 2)
    a, b = trace.requests[0].iterations[0], trace.requests[1].iterations[0]
    assert a.embedding.size == 64 and not np.allclose(a.embedding, b.embedding)


def test_unknown_formats_fail_clearly(tmp_path) -> None:
    bad = tmp_path / "x.jsonl"
    bad.write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(ValueError, match="unknown routing format"):
        load_traces(str(bad))
    with pytest.raises(FileNotFoundError):
        load_traces(str(tmp_path / "missing"))


def test_read_prompts_formats(tmp_path) -> None:
    (tmp_path / "p.jsonl").write_text('{"question": "q1"}\n{"prompt": "p2"}\n\n{"task_id": 1, "prompt": "p3"}\n')
    (tmp_path / "p.txt").write_text("one\n\ntwo\n")
    assert read_prompts(str(tmp_path / "p.jsonl")) == ["q1", "p2", "p3"]
    assert read_prompts(str(tmp_path / "p.txt"), limit=1) == ["one"]
    (tmp_path / "bad.jsonl").write_text('{"answer": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_prompts(str(tmp_path / "bad.jsonl"))


def test_collect_save_load_and_skip_gate_on_tiny_model(tiny_mixtral_dir: str, tmp_path) -> None:
    trace = collect_traces(tiny_mixtral_dir, ["The quick brown fox", "def add(a, b):"], max_tokens=3, batch=2,
                           layer_inputs=True, progress=False)
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (3, 8, 2)
    for request in trace.requests:
        assert [it.iteration for it in request.iterations] == [0, 1, 2]  # prefill + 2 decode steps feeding 3 tokens
        prefill, decode = request.iterations[0], request.iterations[1]
        assert prefill.num_tokens > 1 and prefill.layer_inputs.shape[:2] == (prefill.num_tokens, 3)
        assert (decode.counts.sum(1) == 2).all() and (prefill.counts.sum(1) == 2 * prefill.num_tokens).all()
        np.testing.assert_allclose(decode.probs.sum(1), 1.0, atol=1e-5)
    save_traces(trace, str(tmp_path / "t"))
    back = load_traces(str(tmp_path / "t"))
    assert back.has_layer_inputs and back.layer_ids == [0, 1, 2] and os.path.isabs(back.model)
    a, b = trace.requests[1].iterations[2], back.requests[1].iterations[2]
    np.testing.assert_allclose(a.probs, b.probs)
    np.testing.assert_array_equal(a.token_experts, b.token_experts)
    # The skip-gate with the target's own input reproduces the router (weights loaded right).
    spec = SpeculativePredictor.from_trace(back)
    for t in range(3):
        scores = spec.predict_from_hidden(b.layer_inputs[:, t].astype(np.float32), t)
        assert set(np.argsort(-scores)[:2]) == set(np.flatnonzero(b.counts[t]))
    q = PredictionQuery(RequestHistory.of(back.requests[1].iterations[:2]), masked(b, 1), 2)
    assert spec.predict(q).shape == (8,)
    back.model_hash = "0" * 16  # weights changed since recording: the skip-gate refuses the trace
    with pytest.raises(ValueError, match="re-collect"):
        SpeculativePredictor.from_trace(back)
