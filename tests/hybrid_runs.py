"""The hybrid tests' shared runs: greedy tokens of the tiny Mixtral under an offload policy, against the
resident engine's (the `reference` fixture in conftest.py)."""

from __future__ import annotations

import torch

from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sampling_params import SamplingParams
from tests.tiny_models import VOCAB

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
HYBRID = ("cpu-experts", "n-cpu-moe", "ktransformers", "fiddler", "hintserve")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (6, 17)]


def run_policy(reference, policy: str, **kw):
    """The tokens of `policy` on the reference's model and routing trace, the reference's, the model's experts
    and the engine's stats."""
    model_dir, expected, trace = reference
    engine = LLMEngine(EngineConfig(model=model_dir, offload_policy=policy, routing_trace=trace, **kw))
    try:
        tokens = engine.generate(prompts(), GREEDY)
        return tokens, expected, engine.model.experts, engine.stats()
    finally:
        engine.close()
