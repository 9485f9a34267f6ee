"""Shared fixtures: tiny random checkpoints of every family (exactness only) and the committed demo model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.engine.embedded_predictor import use_embedded_predictor
from services.predictor.embedded import embedded_service
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


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Engines built in tests run the embedded predictor as under `hintserve` (services/cli.py installs it).
    use_embedded_predictor(embedded_service)
