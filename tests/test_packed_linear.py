"""oneDNN-prepacked linears (CPU fp32) against F.linear, on both sides of the row threshold."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.models.packed_linear import PackedLinear, packing_supported


@pytest.mark.parametrize("rows", [1, 3, 4, 17, 65, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    layer = PackedLinear(w, b, pack=packing_supported("cpu", torch.float32))
    torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert layer.extra_bytes == (w.numel() * 4 if layer.packed is not None else 0)


def test_packing_only_where_it_pays() -> None:
    assert not packing_supported("cpu", torch.bfloat16)
    assert not packing_supported("cuda", torch.float32)
    assert PackedLinear(torch.zeros(4, 4), None, pack=False).packed is None


def test_rows_pad_to_few_shapes() -> None:
    from services.engine.models.packed_linear import bucket_sizes, padded_rows

    assert [padded_rows(r) for r in (1, 8, 9, 64, 65, 500, 2000)] == [1, 8, 9, 64, 72, 512, 2048]
    assert all(padded_rows(r) >= r and padded_rows(r) <= r * 1.125 + 1 for r in range(1, 8193))
    assert len(bucket_sizes(2048)) == 72  # oneDNN caches 1024 kernel shapes
    layer = PackedLinear(torch.randn(8, 8), None, pack=packing_supported("cpu", torch.float32))
    layer.warm_up(100)  # every bucket up to 100 rows runs once


@pytest.fixture
def without_native_kernels(monkeypatch):
    """oneDNN's path is the dense layers' path where the native kernels are not built (no compiler)."""
    from services.engine import cpu_kernels

    monkeypatch.setenv("HINTSERVE_CPU_KERNELS", "0")
    cpu_kernels.forget_library()
    yield
    monkeypatch.delenv("HINTSERVE_CPU_KERNELS")
    cpu_kernels.forget_library()


def test_engine_generates_the_same_tokens_packed_or_not(tiny_mixtral_dir: str, without_native_kernels) -> None:
    """The serving core's packed path (a core left free) against the plain one (a thread on every core)."""
    import os

    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine
    from services.engine.sampling_params import SamplingParams

    cores = len(os.sched_getaffinity(0))
    if cores < 2 or not packing_supported("cpu", torch.float32):
        pytest.skip("packing needs oneDNN and a second core")
    prompts = [[5 + i, 17, 42 + 3 * i, 99, 7] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = torch.get_num_threads()
    try:
        plain = LLMEngine(EngineConfig(model=tiny_mixtral_dir, max_num_seqs=8, threads=cores))
        packed = LLMEngine(EngineConfig(model=tiny_mixtral_dir, max_num_seqs=8, threads=1))
        torch.set_num_threads(1)  # the packed engine's setting (each engine sets it as it loads)
        assert plain.model.lm_head.packed is None and packed.model.lm_head.packed is not None
        assert packed.model.experts.stacked_experts(0).packed
        packed.model.warm_up(64, 8)
        packed_tokens = packed.generate(prompts, params)
        torch.set_num_threads(cores)
        assert packed_tokens == plain.generate(prompts, params)
    finally:
        torch.set_num_threads(before)


def test_one_row_takes_mkl_on_the_in_out_layout(monkeypatch) -> None:
    """One row of any size (an LM head's too) goes to MKL on the weight stored [in, out]; two rows to oneDNN."""
    if not packing_supported("cpu", torch.float32):
        pytest.skip("no oneDNN here")
    calls: list[int] = []
    kernel = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: (calls.append(x.shape[0]), kernel(x, *a))[1])
    w = torch.randn(96, 40)
    layer = PackedLinear(w, None, pack=True)
    assert torch.equal(layer.weight, w) and layer.weight.t().is_contiguous()  # the same values, laid [in, out]
    x = torch.randn(1, 40)
    torch.testing.assert_close(layer(x), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert calls == []
    layer(torch.randn(2, 40))
    assert calls == [2]
    head = PackedLinear(torch.randn(8000, 256), None, pack=True)  # the demo model's LM head
    head(torch.randn(1, 256))
    assert calls == [2]
    expert_view = torch.randn(40, 96).t()  # experts are stacked [in, out] already: no second copy
    assert PackedLinear(expert_view, None, pack=True).weight.data_ptr() == expert_view.data_ptr()
    assert PackedLinear(w, None, pack=False).weight is w  # unpacked layers keep the weight as given


def test_model_keeps_one_plain_copy_of_relaid_weights(tiny_mixtral_dir: str, without_native_kernels) -> None:
    """The packed LM head and o projections are relaid [in, out]; the model's weights then point at those."""
    from services.engine.config import EngineConfig
    from services.engine.cpu_threads import intra_op_threads
    from services.engine.llm_engine import LLMEngine

    with intra_op_threads(1):
        engine = LLMEngine(EngineConfig(model=tiny_mixtral_dir, max_num_seqs=2, threads=1))
    model = engine.model
    if model.lm_head.packed is None:
        pytest.skip("packing needs oneDNN and a second core")
    assert model.w.lm_head is model.lm_head.weight
    assert all(layer.attention.o is o.weight for layer, o in zip(model.w.layers, model.o))
