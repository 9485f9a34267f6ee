"""Random sampling follows the softmax of the logits, batched or per seeded request."""

from __future__ import annotations

import math
from collections import Counter

import torch

from services.engine.sampler import sample
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import Sequence

PROBS = [0.5, 0.3, 0.2, 0.0]
ROWS, DRAWS = 64, 40  # 2560 draws per path


def _frequencies(seed: int | None) -> list[float]:
    logits = torch.tensor([math.log(p) if p > 0 else float("-inf") for p in PROBS]).repeat(ROWS, 1)
    counts: Counter[int] = Counter()
    generator = torch.Generator().manual_seed(0)
    for draw in range(DRAWS):
        seqs = [Sequence(f"r{i}", [1], SamplingParams(temperature=1.0, seed=None if seed is None else seed + i),
                         16) for i in range(ROWS)]
        if seed is not None:  # independent draws: every request reseeded
            for i, seq in enumerate(seqs):
                seq.generator.manual_seed(seed + draw * ROWS + i)  # type: ignore[union-attr]
        counts.update(sample(logits.clone(), seqs, (), generator))
    total = ROWS * DRAWS
    return [counts[t] / total for t in range(len(PROBS))]


def test_shared_draw_follows_the_distribution() -> None:
    freqs = _frequencies(None)
    assert freqs[3] == 0.0  # zero probability: never drawn
    for got, want in zip(freqs, PROBS):
        assert abs(got - want) < 0.04  # ~4 standard errors at 2560 draws


def test_seeded_requests_follow_the_distribution_and_greedy_rows_stay_greedy() -> None:
    freqs = _frequencies(1000)
    assert freqs[3] == 0.0
    for got, want in zip(freqs, PROBS):
        assert abs(got - want) < 0.04
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]] * 3)
    seqs = [Sequence("g", [1], SamplingParams(temperature=0.0), 16),
            Sequence("s", [1], SamplingParams(temperature=1.0), 16),
            Sequence("t", [1], SamplingParams(temperature=1.0, seed=3), 16)]
    assert sample(logits, seqs, (), torch.Generator().manual_seed(0))[0] == 1
