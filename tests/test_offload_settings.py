"""OffloadSettings resolve every offload knob once (cache budgets in decimal GB); both model specs are
ExpertGeometry, so the engine's constructors build the simulator's policies from the same settings."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.models.geometry import ExpertGeometry, expert_bytes
from services.engine.models.spec import load_hf_config, spec_from_config
from services.engine.offload.settings import GB, OffloadSettings, PredictorSettings, resolve_slots
from services.simulator.model_specs import MODEL_SPECS, spec_from_model_dir
from services.simulator.sweep import slots_for


@pytest.fixture(scope="module")
def demo_spec(demo_model_dir: str):
    return spec_from_config(load_hf_config(demo_model_dir))


def test_both_model_specs_are_expert_geometry(demo_model_dir: str, demo_spec) -> None:
    sim = spec_from_model_dir(demo_model_dir)
    assert isinstance(demo_spec, ExpertGeometry) and isinstance(sim, ExpertGeometry)
    assert isinstance(MODEL_SPECS["mixtral-8x7b"], ExpertGeometry)
    for name in ("hidden_size", "moe_intermediate_size", "num_layers", "num_experts", "top_k", "moe_layers",
                 "num_moe_layers", "expert_params"):
        assert getattr(sim, name) == getattr(demo_spec, name), name
    # The simulator's fp32 bytes of an expert are the engine's host-store bytes of the same expert.
    assert sim.expert_bytes == expert_bytes(demo_spec, torch.float32) == demo_spec.expert_params * 4


def test_cache_gb_is_decimal_and_resolved_once(demo_model_dir: str, demo_spec) -> None:
    size = expert_bytes(demo_spec, torch.float32)  # 1.57 MB on the demo model
    # 5 experts in GB (1e9) but 5.37 in GiB: a GiB reading would give 5 slots here too, 10.5 GB settles it.
    gb = 10.5 * size / GB
    config = EngineConfig(model=demo_model_dir, offload_policy="lru", expert_cache_gb=gb)
    settings = OffloadSettings.from_config(config)
    assert settings.cache_slots(demo_spec, size) == 10
    assert int(gb * (1 << 30) // size) == 11  # what the binary reading would have given
    # The simulator's sizing for the same budget agrees with the engine's.
    assert slots_for(spec_from_model_dir(demo_model_dir), gb) == 10


def test_settings_resolve_policy_defaults_and_overrides(demo_model_dir: str, demo_spec) -> None:
    base = OffloadSettings.from_config(EngineConfig(model=demo_model_dir, offload_policy="hintserve"))
    assert base.eviction == "hot-set" and base.prefetch_distance == 2 and base.link_ratio == 30.0
    size = expert_bytes(demo_spec, torch.float32)
    assert base.cache_slots(demo_spec, size) == round(0.25 * demo_spec.num_moe_layers * demo_spec.num_experts)
    # A hybrid policy runs no embedded predictor (it would share the host's cores, which bound hybrid
    # decode): hints come from a predictor service over Redis, or from one asked for by name.
    assert base.predictor is None
    for extra in ({"redis_url": "redis://127.0.0.1:6379"}, {"predictor": "expert-map"}):
        hybrid = OffloadSettings.from_config(EngineConfig(model=demo_model_dir, offload_policy="hintserve", **extra))
        assert hybrid.predictor is not None and hybrid.predictor.name == "expert-map"
    transfer = OffloadSettings.from_config(EngineConfig(model=demo_model_dir, offload_policy="hintserve-transfer"))
    assert transfer.predictor == PredictorSettings("expert-map", "demo-moe")
    config = EngineConfig(model=demo_model_dir, offload_policy="hintserve", eviction="lru", prefetch_distance=3,
                          predictor="none", link_gbps=2.5, expert_cache_experts=100)
    s = OffloadSettings.from_config(config)
    assert (s.eviction, s.prefetch_distance, s.predictor) == ("lru", 3, None)
    assert s.link_bytes_per_second == 2.5e9
    assert s.cache_slots(demo_spec, size) == demo_spec.num_moe_layers * demo_spec.num_experts  # capped at every expert
    # Policies without a hints prefetcher never get a predictor link.
    lru = OffloadSettings.from_config(EngineConfig(model=demo_model_dir, offload_policy="lru"))
    assert lru.predictor is None


def test_resolve_slots_rejects_a_cache_below_top_k() -> None:
    spec = MODEL_SPECS["mixtral-8x7b"]
    with pytest.raises(ValueError, match="smaller than one layer's top-k"):
        resolve_slots(spec, spec.expert_bytes, cache_bytes=spec.expert_bytes)
    assert resolve_slots(spec, spec.expert_bytes, fraction=0.5) == 128

