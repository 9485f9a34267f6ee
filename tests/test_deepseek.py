"""DeepSeek in the engine: offloaded routed experts (shared experts and dense layers stay put), FP8 refused."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.models.loader import load_model
from services.engine.sampling_params import SamplingParams
from tests.tiny_models import VOCAB

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (6, 21, 13)]


@pytest.mark.parametrize(
    "family,policy", [("deepseek_v3", "lru"), ("deepseek_v3", "speculative"), ("deepseek_v2_lite", "lru")]
)
def test_offloaded_deepseek_is_token_identical_to_resident(
    tiny_model_dirs: dict[str, str], family: str, policy: str
) -> None:
    model_dir = tiny_model_dirs[family]
    resident = LLMEngine(EngineConfig(model=model_dir))
    expected = resident.generate(_prompts(), GREEDY)
    # As many slots as one layer's top-k: nearly every expert a step needs must come over the link.
    engine = LLMEngine(
        EngineConfig(model=model_dir, offload_policy=policy, expert_cache_experts=2, link_gbps=1.0)
    )
    try:
        assert engine.generate(_prompts(), GREEDY) == expected
        spec, provider = engine.spec, engine.model.experts
        assert not spec.moe_layers[0], "first_k_dense_replace keeps layer 0 dense"
        # Only routed experts are offloadable; the shared experts are part of the resident layer weights.
        assert len(provider.store.buffers) == spec.num_moe_layers * spec.num_experts
        moe_layers = [w for w, moe in zip(engine.model.w.layers, spec.moe_layers) if moe]
        assert all(w.shared_expert is not None for w in moe_layers)
        assert provider.stats.bytes_demand > 0 and provider.stats.evictions > 0
        assert all(s.pins == 0 for s in provider.cache.slots)
    finally:
        engine.close()


def test_fp8_block_quantised_checkpoint_loads_dequantised(tiny_model_dirs: dict[str, str], tmp_path) -> None:
    """DeepSeek-V3's FP8 release layout (weight + weight_scale_inv per 128x128 block), once refused, loads."""
    from tests.quant_checkpoints import fp8_pack, fp8_reference

    model_dir = shutil.copytree(tiny_model_dirs["deepseek_v3"], tmp_path / "fp8")
    path = os.path.join(model_dir, "model.safetensors")
    state = load_file(path)
    name = "model.layers.0.self_attn.o_proj"
    parts = fp8_pack(state[f"{name}.weight"].float())
    state.update({f"{name}.{k}": v for k, v in parts.items()})
    save_file(state, path, metadata={"format": "pt"})
    loaded = load_model(str(model_dir))
    assert torch.equal(loaded.model.w.layers[0].attention.o, fp8_reference(parts))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3"])
def test_skip_gate_uses_the_family_router_rule(tiny_model_dirs: dict[str, str], family: str) -> None:
    """Applied to a layer's own input, the speculative guess must be exactly what the router picked
    (grouped top-k, selection bias and all): the skip-gate differs from the router only in its input."""
    from services.engine.offload.prefetch.speculative import SpeculativePrefetcher

    engine = LLMEngine(EngineConfig(model=tiny_model_dirs[family], offload_policy="speculative"))
    try:
        contexts = []
        engine.runner.step_observers.append(contexts.append)
        engine.runner.keep_layer_inputs = True  # every layer's guess is checked after the step
        engine.generate(_prompts()[:2], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        gate = next(p for p in engine.model.experts.prefetchers if isinstance(p, SpeculativePrefetcher))
        checked = 0
        for ctx in contexts:
            for layer, selected in ctx.selected_experts.items():
                guessed, _ = gate.guess(layer, layer, ctx)
                assert torch.equal(guessed.sort(dim=-1).values, selected.sort(dim=-1).values), (family, layer)
                checked += 1
        assert checked >= engine.spec.num_moe_layers
    finally:
        engine.close()
