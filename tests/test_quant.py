"""Quantized experts: packing and kernels against dequantisation, the flat buffer, the engine end to end."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.expert_provider import ExpertWeights
from services.engine.llm_engine import LLMEngine
from services.engine.models.moe import expert_forward, swiglu
from services.engine.quant.groupwise import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from services.engine.quant.kernels import packed_linear
from services.engine.quant.layout import QuantizedExpertLayout, expert_layout
from services.engine.quant.packed import QuantizedExpertWeights, QuantScheme, pack_matrix
from services.engine.sampling_params import SamplingParams
from tests.tiny_models import VOCAB


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_kernel_matches_its_dequantisation(group: int) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g) * 0.05
    x = torch.randn(5, 256, generator=g)
    q, scale, zero = quantize_int4(w, group)
    deq = dequantize_int4(q, scale.bfloat16(), zero.bfloat16(), group)  # the kernel holds bf16 scales
    assert (deq - w).abs().max() <= scale.max() * 0.51 + 1e-3  # round to nearest: half a step (+bf16 scales)
    y = packed_linear(x, pack_matrix(w, QuantScheme(4, group), "cpu"))
    expected = x.bfloat16().float() @ deq.T
    assert torch.allclose(y, expected, atol=2e-2, rtol=2e-2)


def test_int8_kernel_matches_its_dequantisation() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=g) * 0.05
    x = torch.randn(3, 96, generator=g)
    q, scale = quantize_int8(w)
    assert (dequantize_int8(q, scale) - w).abs().max() <= scale.max() * 0.51
    y = packed_linear(x, pack_matrix(w, QuantScheme(8, 64), "cpu"))
    expected = x.bfloat16().float() @ dequantize_int8(q, scale.bfloat16()).T
    assert torch.allclose(y, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_flat_buffer_holds_the_packed_expert_and_is_smaller(dtype: str) -> None:
    g = torch.Generator().manual_seed(2)
    w = ExpertWeights(torch.randn(192, 64, generator=g) * 0.05, torch.randn(64, 96, generator=g) * 0.05)
    layout = expert_layout(64, 96, dtype, 32, torch.float32, "cpu")
    assert isinstance(layout, QuantizedExpertLayout)
    flat = torch.empty(layout.numel, dtype=layout.dtype)
    layout.pack(w, flat)
    packed = layout.views(flat)
    assert isinstance(packed, QuantizedExpertWeights)
    bf16_bytes = 2 * (192 * 64 + 64 * 96)
    assert flat.numel() <= bf16_bytes * (0.56 if dtype == "int8" else 0.36)
    assert sum(c.numel() for c in layout.chunks(flat)) == flat.numel()  # two chunks cover the buffer
    x = torch.randn(4, 64, generator=g)
    y = expert_forward(x, packed)
    # A copy of the bytes (what a transfer does) computes the same thing.
    assert torch.equal(expert_forward(x, layout.views(flat.clone())), y)
    reference = swiglu(x, w.gate_up, w.down)
    # Relative error of the whole expert: int4's step is (max - min) / 15 of a group, int8's max / 127 of a row.
    assert (y - reference).norm() / reference.norm() < (0.02 if dtype == "int8" else 0.2)


def test_bf16_experts_under_fp32_activations() -> None:
    g = torch.Generator().manual_seed(3)
    w = ExpertWeights(torch.randn(32, 16, generator=g) * 0.2, torch.randn(16, 16, generator=g) * 0.2)
    x = torch.randn(2, 16, generator=g)
    w16 = ExpertWeights(w.gate_up.bfloat16(), w.down.bfloat16())
    y = expert_forward(x, w16)
    assert y.dtype == torch.float32
    reference = swiglu(x, w.gate_up, w.down)
    assert (y - reference).norm() / reference.norm() < 0.02  # bf16 keeps 8 significant bits


def test_group_that_does_not_divide_the_input_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of the quantization group size 64"):
        expert_layout(64, 96, "int4", 64, torch.float32, "cpu")


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_offloaded_quantized_experts_decode_like_resident_ones(tiny_mixtral_dir: str, dtype: str) -> None:
    """The packed bytes move through host store, link and cache unchanged: same tokens as resident."""
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 19)]
    kw = dict(model=tiny_mixtral_dir, expert_dtype=dtype, expert_group_size=32)
    resident = LLMEngine(EngineConfig(**kw))
    offloaded = LLMEngine(EngineConfig(offload_policy="lru", expert_cache_experts=3, link_gbps=2.0, **kw))
    try:
        assert offloaded.generate(prompts, GREEDY) == resident.generate(prompts, GREEDY)
        store = offloaded.model.experts.store
        stats = offloaded.model.experts.stats
        assert stats.bytes_demand % store.expert_bytes == 0 and stats.bytes_demand > 0
        dense = 4 * 3 * 64 * 96  # one fp32 expert of the tiny model (gate, up, down)
        assert store.expert_bytes < dense / (1.9 if dtype == "bf16" else 3.5 if dtype == "int8" else 6.0)
        assert offloaded.model.experts.cache.storage.dtype == store.dtype
    finally:
        resident.close()
        offloaded.close()


def test_agreement_counts_positions_and_identical_prompts() -> None:
    from services.bench.quant_bench import agreement

    assert agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [4, 5, 6]]) == (5 / 6, 1)


@pytest.mark.parametrize("argv", [
    ["bench", "quant", "--expert-dtypes", "int3"],
    ["bench", "quant", "--group-sizes", "48"],
    ["bench", "offload", "--expert-dtypes", "fp4"],
    ["generate", "--model", "models/demo-moe", "--prompt", "x", "--expert-group-size", "48"],
])
def test_bad_quant_flags_exit_2(argv: list[str]) -> None:
    from services import cli

    if "--expert-group-size" in argv:  # an argparse choice: argparse itself exits 2
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
    else:
        assert cli.main(argv) == 2
