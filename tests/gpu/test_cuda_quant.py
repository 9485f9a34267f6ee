"""On a GPU: the CUDA int4/int8 weight-only kernels behind packed_linear, and packed experts offloaded over the
copy engine decoding like resident ones."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.quant.groupwise import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from services.engine.quant.kernels import packed_linear
from services.engine.quant.packed import QuantScheme, pack_matrix
from services.engine.sampling_params import SamplingParams
from tests.tiny_models import VOCAB

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("bits, group", [(4, 32), (4, 64), (4, 128), (8, 64)])
def test_cuda_kernels_match_dequantisation(bits: int, group: int) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g) * 0.05
    x = torch.randn(7, 512, generator=g).bfloat16()
    if bits == 4:
        q, scale, zero = quantize_int4(w, group)
        deq = dequantize_int4(q, scale.bfloat16(), zero.bfloat16(), group)
    else:
        q, scale = quantize_int8(w)
        deq = dequantize_int8(q, scale.bfloat16())
    y = packed_linear(x.cuda(), pack_matrix(w, QuantScheme(bits, group), "cuda")).float().cpu()
    assert torch.allclose(y, x.float() @ deq.T, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_packed_experts_over_the_copy_engine_decode_like_resident(tiny_mixtral_dir: str, dtype: str) -> None:
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kw = dict(model=tiny_mixtral_dir, device="cuda", expert_dtype=dtype, expert_group_size=32)
    resident = LLMEngine(EngineConfig(**kw))
    offloaded = LLMEngine(EngineConfig(offload_policy="lru", expert_cache_experts=3, link="native", **kw))
    try:
        assert offloaded.generate(prompts, params) == resident.generate(prompts, params)
        assert offloaded.model.experts.store.buffers[(0, 0)].is_pinned()
    finally:
        resident.close()
        offloaded.close()
