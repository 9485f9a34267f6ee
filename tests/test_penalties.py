"""Frequency, presence and repetition penalties: the math by hand, then on the real engine."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.errors import InvalidRequestError
from services.engine.llm_engine import LLMEngine
from services.engine.sampler import apply_penalties
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import Sequence
from tests.tiny_models import VOCAB

LOGITS = [2.0, -1.0, 3.0, 0.5, -2.0, 1.0]


def _sequence(prompt: list[int], generated: list[int], **params: float) -> Sequence:
    seq = Sequence("r", prompt, SamplingParams(**params), block_size=4)
    for token in generated:
        seq.append_token(token)
    return seq


def test_penalty_math_by_hand() -> None:
    # prompt [0, 1], generated [2, 2, 3]: ids 0-3 are seen, output counts are {2: 2, 3: 1}.
    seq = _sequence([0, 1], [2, 2, 3], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    plain = _sequence([0, 1], [2, 2, 3])
    logits = torch.tensor([LOGITS, LOGITS])
    apply_penalties(logits, [plain, seq])
    assert logits[0].tolist() == LOGITS
    assert plain.penalty_state is None  # unpenalised sequences get no state at all
    # repetition on ids 0-3: 2/2, -1*2, 3/2, 0.5/2 -> [1, -2, 1.5, 0.25, -2, 1]
    # then id 2: -(0.5*2 + 0.25), id 3: -(0.5*1 + 0.25)
    assert logits[1].tolist() == [1.0, -2.0, 0.25, -0.5, -2.0, 1.0]


def test_penalties_each_alone_and_banned_tokens_stay_banned() -> None:
    cases = [
        ({"frequency_penalty": 1.0}, [2.0, -1.0, 1.0, -0.5, -2.0, 1.0]),
        ({"presence_penalty": -2.0}, [2.0, -1.0, 5.0, 2.5, -2.0, 1.0]),  # negative: encourages repeats
        ({"repetition_penalty": 0.5}, [4.0, -0.5, 6.0, 1.0, -2.0, 1.0]),  # below 1: encourages repeats
    ]
    for params, expected in cases:
        logits = torch.tensor([LOGITS])
        apply_penalties(logits, [_sequence([0, 1], [2, 2, 3], **params)])
        assert logits[0].tolist() == expected, params
    batch = [_sequence([0, 1], [2, 2, 3], **params) for params, _ in cases] + [_sequence([0, 1], [2, 2, 3])]
    logits = torch.tensor([LOGITS] * len(batch))
    apply_penalties(logits, batch)  # one batch mixing the three kinds and an unpenalised row
    assert logits.tolist() == [expected for _, expected in cases] + [LOGITS]
    logits = torch.tensor([[float("-inf")] * 6])  # min_tokens bans (-inf) survive every penalty
    apply_penalties(logits, [_sequence([0], [2], repetition_penalty=3.0, presence_penalty=-2.0)])
    assert logits.isneginf().all()


def test_penalty_state_follows_appended_tokens_incrementally() -> None:
    seq = _sequence([0, 1], [2], frequency_penalty=1.0, repetition_penalty=1.5)
    apply_penalties(torch.tensor([LOGITS]), [seq])  # first penalised step: counts built from all tokens
    for token in (3, 2, 5):
        seq.append_token(token)
        step = torch.tensor([LOGITS])
        apply_penalties(step, [seq])  # later steps: only the appended token is counted
        fresh = _sequence([0, 1], seq.completion_token_ids, frequency_penalty=1.0, repetition_penalty=1.5)
        rebuilt = torch.tensor([LOGITS])
        apply_penalties(rebuilt, [fresh])  # built in one go from the prompt and every generated token
        assert torch.equal(step, rebuilt)
    assert seq.penalty_state is not None and seq.penalty_state.generated_counts == {2: 2, 3: 1, 5: 1}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ],
)
def test_out_of_range_penalties_are_rejected(params: dict[str, float], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**params).validate()
    SamplingParams(frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=1e-3).validate()


# ---- on the engine ----

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
MIXED = [
    GREEDY,
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=0.8),
    SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=1.5, repetition_penalty=0.9
    ),
    SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True, frequency_penalty=-0.5),
    SamplingParams(temperature=0.8, top_k=40, seed=8, max_tokens=24, ignore_eos=True, repetition_penalty=1.2),
]


def _prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(23)
    lengths = torch.randint(3, 40, (count,), generator=g)
    return [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in lengths]


def _run(engine: LLMEngine, jobs: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    seqs = [engine.add_request(f"penalty-{i}", prompt, params) for i, (prompt, params) in enumerate(jobs)]
    while engine.has_unfinished():
        engine.step()
    return [seq.completion_token_ids for seq in seqs]


@pytest.fixture(scope="module")
def engine(tiny_mixtral_dir: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_mixtral_dir, block_size=4, max_num_seqs=16))


def test_strong_repetition_penalty_stops_greedy_repeats(engine: LLMEngine) -> None:
    prompts = _prompts(4)
    plain = engine.generate(prompts, GREEDY)
    assert any(len(set(out)) < len(out) for out in plain), "the unpenalised runs should repeat tokens"
    strong = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=50.0)
    penalised = engine.generate(prompts, strong)
    assert penalised == engine.generate(prompts, strong)  # greedy stays deterministic
    for prompt, out in zip(prompts, penalised):
        assert len(set(out)) == len(out)  # no generated token twice
        assert not set(out) & set(prompt)  # nor a prompt token


def test_frequency_and_presence_penalties_reduce_repeats(engine: LLMEngine) -> None:
    prompts = _prompts(4)
    repeats = lambda outs: sum(len(out) - len(set(out)) for out in outs)  # noqa: E731
    plain = repeats(engine.generate(prompts, GREEDY))
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **penalty)
        assert repeats(engine.generate(prompts, params)) < plain, penalty


def test_mixed_penalties_batched_equal_alone(engine: LLMEngine) -> None:
    prompts = _prompts(12)
    jobs = [(prompt, MIXED[i % len(MIXED)]) for i, prompt in enumerate(prompts)]
    alone = [_run(engine, [job])[0] for job in jobs]
    assert _run(engine, jobs) == alone
    plain = engine.generate(prompts, GREEDY)
    assert all(alone[i] != plain[i] for i in (1, 2, 3)), "the penalties should change the greedy outputs"
    assert engine.block_manager.num_used == 0


def test_penalties_survive_preemption(tiny_mixtral_dir: str, engine: LLMEngine) -> None:
    prompts = _prompts(8)
    jobs = [(prompt, MIXED[i % len(MIXED)]) for i, prompt in enumerate(prompts)]
    expected = _run(engine, jobs)
    small = LLMEngine(EngineConfig(model=tiny_mixtral_dir, block_size=4, max_num_seqs=8, kv_cache_mb=1))
    small.block_manager.__init__(40, 4)  # 160 token slots for 8 requests of up to ~63 tokens: preemption
    assert _run(small, jobs) == expected
    assert small.scheduler.num_preemptions > 0
