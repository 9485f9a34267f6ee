"""step_records: one per-request summary of a step's routing for the predictor link, the trace recorder and
the simulator; and the runner's observers, the one way to watch steps (layer and step observers)."""

from __future__ import annotations

import numpy as np
import torch

from services.common.messages import Shape, to_context
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sampling_params import SamplingParams
from services.engine.step_context import Phase, StepContext
from services.engine.step_records import encode_step, step_records
from services.engine.trace_recorder import TraceRecorder


def _prefill() -> StepContext:
    """Two requests of 3 and 2 tokens; layer 1 is dense (never routed)."""
    ctx = StepContext(Phase.PREFILL, ["a", "b"], 5, seq_lens=[3, 2], iterations=[0, 0])
    gen = torch.Generator().manual_seed(0)
    ctx.embeddings = torch.randn(5, 4, generator=gen)
    for layer in (0, 2):
        ctx.router_probs[layer] = torch.softmax(torch.randn(5, 6, generator=gen), -1)
        ctx.selected_experts[layer] = torch.topk(ctx.router_probs[layer], 2, -1).indices
    return ctx


def test_records_are_token_means_and_exact_counts() -> None:
    ctx = _prefill()
    rec = step_records(ctx)
    assert rec.layers == [0, 2] and rec.num_tokens.tolist() == [3, 2]
    a = slice(0, 3)
    np.testing.assert_allclose(rec.probs[0, 1], ctx.router_probs[2][a].mean(0).numpy(), rtol=1e-6)
    np.testing.assert_allclose(rec.embeddings[1], ctx.embeddings[3:].mean(0).numpy(), rtol=1e-6)
    assert rec.counts.sum(axis=2).tolist() == [[6.0, 6.0], [4.0, 4.0]]  # tokens x top-k, exactly
    assert step_records(ctx, layers_seen=1).layers == [0]
    # The wire form spans every model layer, dense ones zero; the predictor reads back the same records.
    shape = Shape("m", 3, 6, 2, 4)
    wire = [to_context(c, shape) for c in encode_step(ctx, 3, shape)]
    np.testing.assert_array_equal(wire[0].counts[[0, 2]], rec.counts[0])
    assert not wire[0].probs[1].any() and wire[1].num_tokens == 2
    # The trace recorder stores the same records.
    recorder = TraceRecorder(6)
    recorder(ctx)
    traced = recorder.iterations["b"][0]
    np.testing.assert_array_equal(traced.counts, rec.counts[1])
    assert recorder.layer_ids == [0, 2]


def test_runner_observers_see_each_layer_and_step(tiny_mixtral_dir: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_mixtral_dir))
    seen: list[tuple[str, int, int]] = []
    engine.runner.layer_observers[1] = [lambda layer, ctx: seen.append(("layer", layer, len(ctx.router_probs)))]
    engine.runner.step_observers.append(lambda ctx: seen.append(("step", ctx.step_index, len(ctx.router_probs))))
    try:
        engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    finally:
        engine.close()
    layers = engine.spec.num_moe_layers
    # Mid-step: layer 1's routing is in (layers 0 and 1), later layers not yet; then the whole step.
    assert seen == [("layer", 1, 2), ("step", 0, layers), ("layer", 1, 2), ("step", 1, layers)]


def test_a_step_holds_every_layers_input_only_for_an_observer_that_keeps_them(tiny_mixtral_dir: str) -> None:
    """Each layer's residual stream lives for that layer only (48 of them would hold 805 MB through a
    2048-token Qwen3-30B-A3B prefill); a runner told to keep them (trace recording) holds every layer's."""
    engine = LLMEngine(EngineConfig(model=tiny_mixtral_dir))
    held: list[list[int]] = []
    mid_layer: list[list[int]] = []
    engine.runner.layer_observers[1] = [lambda layer, ctx: mid_layer.append(sorted(ctx.layer_inputs))]
    engine.runner.step_observers.append(lambda ctx: held.append(sorted(ctx.layer_inputs)))
    try:
        prompt = [[5, 6, 7]]
        greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        engine.generate(prompt, greedy)
        recorder = TraceRecorder(engine.spec.num_experts, keep_layer_inputs=True)
        engine.runner.step_observers.append(recorder)
        engine.runner.keep_layer_inputs = True
        engine.generate(prompt, greedy)
    finally:
        engine.close()
    last = engine.spec.num_layers - 1
    every = list(range(engine.spec.num_layers))
    assert held == [[last], [last], every, every]
    assert mid_layer[:2] == [[1], [1]]  # a prefetcher reads the layer it plans at
    inputs = next(iter(recorder.iterations.values()))[0].layer_inputs
    assert inputs is not None and inputs.shape[:2] == (3, engine.spec.num_moe_layers)
