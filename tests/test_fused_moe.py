"""The fused MoE path (grouped GEMMs over stacked resident experts) against the per-expert path."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.expert_provider import ExpertWeights, ResidentExpertProvider
from services.engine.llm_engine import LLMEngine
from services.engine.models.fused_moe import StackedExperts, fused_moe_forward, stackable
from services.engine.models.moe import moe_forward
from services.engine.models.packed_linear import packing_supported
from services.engine.models.router import softmax_topk
from services.engine.sampling_params import SamplingParams
from services.engine.step_context import Phase, StepContext

EXPERTS, HIDDEN, INTER, TOP_K = 8, 32, 48, 2


def _experts(dtype: torch.dtype) -> list[ExpertWeights]:
    g = torch.Generator().manual_seed(0)
    return [
        ExpertWeights(
            (torch.randn(2 * INTER, HIDDEN, generator=g) * 0.1).to(dtype),
            (torch.randn(HIDDEN, INTER, generator=g) * 0.1).to(dtype),
        )
        for _ in range(EXPERTS)
    ]


@pytest.mark.parametrize(("dtype", "pack"), [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("tokens", [1, 3, 16, 33, 200])
def test_fused_matches_per_expert(dtype: torch.dtype, pack: bool, tokens: int) -> None:
    """Grouped GEMMs, and (CPU fp32) the oneDNN-prepacked experts, against one matmul pair per expert."""
    experts = _experts(dtype)
    stacked = StackedExperts.stack(experts, pack=pack and packing_supported("cpu", dtype))
    assert bool(stacked.packed) == (pack and packing_supported("cpu", dtype))
    provider = ResidentExpertProvider([[stacked.expert(e) for e in range(EXPERTS)]])
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    routing = softmax_topk(torch.randn(tokens, EXPERTS, generator=g).to(dtype), TOP_K, True)
    ctx_a, ctx_b = (StepContext(Phase.DECODE, ["r"], tokens) for _ in range(2))
    want = moe_forward(x, 0, routing, provider, ctx_a)
    got = fused_moe_forward(x, 0, routing, stacked, ctx_b)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert got.dtype == x.dtype
    assert torch.equal(ctx_b.selected_experts[0], ctx_a.selected_experts[0])  # what predictors record


def test_views_share_the_stack_and_odd_formats_are_not_stacked() -> None:
    experts = _experts(torch.float32)
    stacked = StackedExperts.stack(experts)
    view = stacked.expert(3)
    assert torch.equal(view.gate_up, experts[3].gate_up) and torch.equal(view.down, experts[3].down)
    assert view.gate_up.data_ptr() == stacked.w13[3].data_ptr()  # no second copy of the weights
    assert stackable(experts)
    assert not stackable([*experts[:-1], ExpertWeights(experts[0].gate_up.to(torch.int8), experts[0].down)])


def test_engine_generates_the_same_tokens_fused_or_per_expert(tiny_mixtral_dir: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_mixtral_dir, max_num_seqs=8))
    provider = engine.model.experts
    assert all(provider.stacked_experts(i) is not None for i in range(engine.spec.num_layers))
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 7] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    fused = engine.generate(prompts, params)
    provider._stacked = [None] * len(provider._stacked)  # the per-expert path, on the same weights
    assert engine.generate(prompts, params) == fused


def test_packed_groups_padding_would_grow_much_run_as_a_bucket_and_the_rest(monkeypatch) -> None:
    from services.engine.models import fused_moe
    from services.engine.models.packed_linear import bucket_floor, padded_rows

    if not packing_supported("cpu", torch.float32):
        pytest.skip("no oneDNN packing here")
    assert all(padded_rows(bucket_floor(r)) == bucket_floor(r) <= r < padded_rows(bucket_floor(r) + 1)
               or bucket_floor(r) == r for r in range(1, 4097))
    stacked = StackedExperts.stack(_experts(torch.float32), pack=True)
    rows = torch.randn(260 + 5 + 300, HIDDEN, generator=torch.Generator().manual_seed(0))
    ends = torch.tensor([260, 265, 265, 565, 565, 565, 565, 565])  # 260 pads to 288, 300 to 320: both split
    calls = []
    swiglu = fused_moe._packed_swiglu
    monkeypatch.setattr(fused_moe, "_packed_swiglu", lambda e, x: calls.append(x.shape[0]) or swiglu(e, x))
    got = fused_moe._packed_experts(rows, ends, stacked.packed)
    assert calls == [256, 4, 5, 288, 12]
    for expert, (start, end) in zip((0, 1, 3), ((0, 260), (260, 265), (265, 565))):
        w = stacked.expert(expert)
        gate, up = (rows[start:end] @ w.gate_up.t()).chunk(2, dim=-1)
        torch.testing.assert_close(got[start:end], (torch.nn.functional.silu(gate) * up) @ w.down.t(),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 16])
def test_a_large_fp32_expert_runs_on_the_kernels_pool(monkeypatch, rows: int) -> None:
    """At Qwen3-30B-A3B's expert size the single-threaded expert_rows streamed half the two-thread probe: a
    large fp32 expert goes to the pool's one-call kernel instead, with the same result as torch's."""
    from services.engine import cpu_kernels
    from services.engine.models import moe

    if cpu_kernels.library() is None:
        pytest.skip("native CPU kernels not built")
    gen = torch.Generator().manual_seed(0)
    hidden, width = 1024, 512  # 2 * 512 * 1024 gate/up weights: the pooled size
    assert 2 * width * hidden >= moe.POOLED_EXPERT_PARAMS
    w = ExpertWeights(torch.randn(2 * width, hidden, generator=gen) / hidden**0.5,
                      torch.randn(hidden, width, generator=gen) / width**0.5)
    x = torch.randn(rows, hidden, generator=gen)

    def single_threaded(*args, **kwargs):
        raise AssertionError("a large expert ran on expert_rows")

    monkeypatch.setattr(cpu_kernels, "expert_rows", single_threaded)
    torch.testing.assert_close(moe.expert_forward(x, w), moe.swiglu(x, w.gate_up, w.down), rtol=1e-4, atol=1e-4)


def test_a_torch_without_grouped_mm_takes_the_per_expert_path(monkeypatch) -> None:
    """torch>=2.4 admits releases before _grouped_mm (2.8): the check says no instead of raising at load."""
    from services.engine.models import fused_moe

    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    fused_moe.grouped_mm_supported.cache_clear()
    try:
        assert not fused_moe.grouped_mm_supported("cpu", torch.float32)
    finally:
        fused_moe.grouped_mm_supported.cache_clear()
