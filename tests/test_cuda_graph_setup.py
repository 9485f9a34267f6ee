"""CUDA graph setup that runs anywhere: buckets, who may capture, the flag and its environment variable."""

from __future__ import annotations

import pytest

from services.engine.config import EngineConfig
from services.engine.cuda_graphs import BATCH_BUCKETS, buckets_up_to, graphs_supported
from services.engine.llm_engine import LLMEngine
from services.engine.model_runner import ModelRunner


def test_buckets_end_at_the_limit() -> None:
    assert buckets_up_to(32, BATCH_BUCKETS) == [1, 2, 4, 8, 16, 24, 32]
    assert buckets_up_to(20, BATCH_BUCKETS) == [1, 2, 4, 8, 16, 20]
    assert buckets_up_to(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets_up_to(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_cpu_engines_never_capture(tiny_mixtral_dir: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_mixtral_dir, dtype="float32", block_size=4))
    assert not graphs_supported(engine.model) and engine.runner.graphs is None
    # a runner built without the scratch block refuses to capture
    with pytest.raises(ValueError, match="scratch"):
        engine.runner.capture_graphs(4, 4)
    spare = ModelRunner(engine.model, engine.block_manager, engine.eos_ids, 0, "cpu", cuda_graphs=True)
    assert engine.model.k_caches[0].shape[1] == (engine.block_manager.num_blocks + 1) * 4  # one scratch block
    assert spare.graphs is None


def test_enforce_eager_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("HINTSERVE_ENFORCE_EAGER", "1")
    assert EngineConfig.from_env().enforce_eager is True
    monkeypatch.setenv("HINTSERVE_ENFORCE_EAGER", "false")
    assert EngineConfig.from_env().enforce_eager is False
    monkeypatch.setenv("HINTSERVE_ENFORCE_EAGER", "maybe")
    with pytest.raises(ValueError, match="HINTSERVE_ENFORCE_EAGER must be 0, 1, true or false"):
        EngineConfig.from_env()


def test_enforce_eager_flag(tiny_mixtral_dir: str) -> None:
    from services.cli import build_parser
    from services.engine.cli import engine_config

    parser = build_parser()
    assert engine_config(parser.parse_args(["engine", "--model", tiny_mixtral_dir,
                                            "--enforce-eager"])).enforce_eager is True
    assert engine_config(parser.parse_args(["engine", "--model", tiny_mixtral_dir])).enforce_eager is False


class _Rerun:
    """A stand-in for a captured graph on the CPU: replay re-runs the captured function into the same output,
    so everything but the capture itself (static buffers, padding, scratch slot, buckets) runs for real."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.out = fn()

    def replay(self) -> None:
        self.out.copy_(self.fn())


def test_padded_replays_give_the_eager_tokens(tiny_mixtral_dir: str, monkeypatch) -> None:
    import torch

    from services.engine.cuda_graphs import DecodeGraphs
    from services.engine.isolation import StepIsolator
    from services.engine.sampling_params import SamplingParams
    from tests.tiny_models import VOCAB

    def rerun_capture(self, batch: int, blocks: int):
        graph = _Rerun(lambda: self._forward(batch, blocks))
        return graph, graph.out

    monkeypatch.setattr(DecodeGraphs, "_capture", rerun_capture)
    config = EngineConfig(model=tiny_mixtral_dir, dtype="float32", block_size=4, max_num_seqs=8, max_model_len=64)
    eager, graphed = LLMEngine(config), LLMEngine(config)
    runner = ModelRunner(graphed.model, graphed.block_manager, graphed.eos_ids, config.seed, "cpu", cuda_graphs=True)
    graphed.runner, graphed.isolator = runner, StepIsolator(runner.run)
    runner.capture_graphs(config.max_num_seqs, 16)
    assert sorted(runner.graphs.graphs) == [(b, w) for b in (1, 2, 4, 8) for w in (1, 2, 4, 8, 16)]
    replays = []
    replay = DecodeGraphs.replay
    monkeypatch.setattr(DecodeGraphs, "replay", lambda self, *a: replays.append(len(a[0])) or replay(self, *a))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 14)]  # 3 rows: padded to 4
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    scratch = runner.graphs.scratch_slot
    assert scratch == graphed.block_manager.num_blocks * 4  # the block the block manager never hands out
    for cache in graphed.model.kv_cache_tensors:
        cache[:, scratch] = float("nan")  # any read of it by a real sequence would spoil the tokens
    assert graphed.generate(prompts, params) == eager.generate(prompts, params)
    assert replays == [3] * 9  # every decode step replayed; the prefill ran eagerly
    assert not graphed.model.k_caches[0][:, scratch].isnan().any()  # the padded row's KV went there
