"""Shared fixtures: tiny random checkpoints of every family (exactness only), the committed demo model, and the
hybrid tests' resident reference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.engine.embedded_predictor import use_embedded_predictor
from services.predictor.embedded import embedded_service
from tests.hybrid_runs import GREEDY, prompts
from tests.tiny_models import FAMILIES, build_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL_DIR = REPO_ROOT / "models" / "demo-moe"
SHARED_DIR = REPO_ROOT.parent / "shared"


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {family: build_tiny_model(family, str(root / family)) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tiny_model_dirs: dict[str, str]) -> str:
    return tiny_model_dirs["mixtral"]


@pytest.fixture(scope="session")
def demo_model_dir() -> str:
    if not (DEMO_MODEL_DIR / "model.safetensors").is_file():
        pytest.skip("models/demo-moe not built")
    return str(DEMO_MODEL_DIR)


@pytest.fixture(scope="session")
def reference(tiny_mixtral_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list, str]:
    """The tiny Mixtral's resident greedy tokens for the hybrid tests' prompts, and its routing trace's file."""
    from services.engine.config import EngineConfig
    from services.engine.llm_engine import LLMEngine
    from services.engine.offload.routing_trace import RoutingTrace

    engine = LLMEngine(EngineConfig(model=tiny_mixtral_dir))
    trace = RoutingTrace(engine.spec.num_layers)
    engine.runner.step_observers.append(trace)
    expected = engine.generate(prompts(), GREEDY)
    engine.close()
    path = str(tmp_path_factory.mktemp("trace") / "trace.json")
    trace.save(path)
    return tiny_mixtral_dir, expected, path


@pytest.fixture
def separate_memories(monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulated host and link each with a memory of its own: on one DRAM, which the host's GEMV alone fills,
    a split never beats the host (memory_bus.py), and the split mechanics would go untested."""
    from services.engine.offload import memory_bus

    monkeypatch.setattr(memory_bus, "EMULATED_DRAM_OVER_HOST", float("inf"))


@pytest.fixture
def splits_despite_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging whenever some decode miss would split, whatever the cache slots it takes are worth: the tiny
    model's budgets are a handful of slots, each worth more than its splits (split_experts.split_pays), and the
    split mechanics would go untested."""
    from services.engine.offload import hybrid_setup

    pays = hybrid_setup.split_pays
    monkeypatch.setattr(hybrid_setup, "split_pays", lambda *args: pays(*args[:5]))


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Engines built in tests run the embedded predictor as under `hintserve` (services/cli.py installs it).
    use_embedded_predictor(embedded_service)
