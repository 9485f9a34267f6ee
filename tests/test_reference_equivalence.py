"""Our model code against transformers' own, for every supported family and both expert layouts."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.models.attention import AttentionMetadata
from services.engine.models.loader import load_model
from services.engine.sampling_params import SamplingParams
from services.engine.step_context import Phase, StepContext
from tests.tiny_models import FAMILIES, VOCAB, build_tiny_model


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_logits_match_transformers(family: str, fused: bool, tmp_path) -> None:
    model_dir = build_tiny_model(family, str(tmp_path / family), fused=fused)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(_prompt(24, seed=3))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]

    model = load_model(model_dir, dtype=torch.float32).model
    model.allocate_kv_cache(64)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(24), seq_lens=[24])
    hidden = model.forward(ids, torch.arange(24), meta, StepContext(Phase.PREFILL, ["r"], 24))
    ours = model.compute_logits(hidden)
    assert (ours - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers_generate(family: str, tiny_model_dirs: dict[str, str]) -> None:
    model_dir = tiny_model_dirs[family]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", block_size=4))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [_prompt(n, seed=n) for n in (7, 19)]
    ours = engine.generate(prompts, params)
    for prompt, tokens in zip(prompts, ours):
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False
        )[0, len(prompt) :].tolist()
        assert tokens == expected
