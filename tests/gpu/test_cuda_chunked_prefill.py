"""On a real GPU: chunked prefill and prefix caching (attention over keys and values read back from the CUDA
KV cache; in the batch of three, the prompts done first decode inside the later ones' chunk steps, mixed
steps, and by CUDA graphs once none is left) give the one-step engine's tokens."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sampling_params import SamplingParams
from tests.tiny_models import VOCAB

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2_lite"])
def test_chunked_and_cached_prefill_on_cuda_keep_tokens(tiny_model_dirs, family: str) -> None:
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, VOCAB, (21,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 17)]
    config = dict(model=tiny_model_dirs[family], device="cuda", block_size=4, max_num_seqs=8)
    whole = LLMEngine(EngineConfig(**config))
    expected = [whole.generate([p], GREEDY)[0] for p in prompts]
    whole.close()
    engine = LLMEngine(EngineConfig(**config, max_num_batched_tokens=8, enable_prefix_caching=True))
    try:
        assert [engine.generate([p], GREEDY)[0] for p in prompts] == expected
        assert engine.generate(prompts, GREEDY) == expected
        assert engine.stats()["prefix_cache_hits_total"] > 0
    finally:
        engine.close()
    assert engine.block_manager.num_used == 0
