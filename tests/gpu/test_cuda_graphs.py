"""On a real GPU: decode steps replayed from CUDA graphs give the eager engine's tokens."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.cuda_graphs import DecodeGraphs
from services.engine.llm_engine import LLMEngine
from services.engine.sampling_params import SamplingParams
from tests.tiny_models import VOCAB

pytestmark = pytest.mark.gpu


def _prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(3, VOCAB, (5 + 3 * i,), generator=g).tolist() for i in range(batch)]


@pytest.fixture(scope="module")
def engines(tiny_model_dirs):
    # bf16: the fused expert path (torch._grouped_mm) runs on CUDA for bf16 on sm90+, and graphs need it.
    config = dict(model=tiny_model_dirs["mixtral"], device="cuda", dtype="bfloat16", max_num_seqs=32)
    eager = LLMEngine(EngineConfig(**config, enforce_eager=True))
    graphs = LLMEngine(EngineConfig(**config))
    yield eager, graphs
    eager.close()
    graphs.close()


@pytest.mark.parametrize("batch", [1, 3, 4, 17])
def test_graph_decode_gives_the_eager_tokens(engines, batch: int, monkeypatch) -> None:
    eager, graphs = engines
    assert eager.runner.graphs is None
    if graphs.runner.graphs is None:
        pytest.skip("no graphs here (torch._grouped_mm needs bf16 on sm90+)")
    replays = []
    replay = DecodeGraphs.replay
    monkeypatch.setattr(DecodeGraphs, "replay", lambda self, *a: replays.append(len(a[0])) or replay(self, *a))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert graphs.generate(_prompts(batch), params) == eager.generate(_prompts(batch), params)
    assert replays and max(replays) == batch  # every decode step replayed (3 and 17 padded to 4 and 24)


def test_an_observed_engine_decodes_eagerly(engines, monkeypatch) -> None:
    _, graphs = engines
    if graphs.runner.graphs is None:
        pytest.skip("no graphs here")
    replays = []
    monkeypatch.setattr(DecodeGraphs, "replay", lambda self, *a: replays.append(1))
    seen = []
    graphs.runner.step_observers.append(seen.append)
    try:
        graphs.generate(_prompts(2), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    finally:
        graphs.runner.step_observers.clear()
    assert not replays and len(seen) == 4  # the prefill and three decode steps, all eager and observed
