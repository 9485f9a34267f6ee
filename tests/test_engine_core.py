"""Scheduler, KV blocks, sampling, stopping and streaming, on the real engine."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.engine.async_engine import AsyncLLMEngine
from services.engine.config import EngineConfig
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.errors import ContextLengthExceededError, InvalidRequestError
from services.engine.llm_engine import LLMEngine
from services.engine.sampling_params import SamplingParams
from tests.tiny_models import VOCAB

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (count,), generator=g)]


@pytest.fixture(scope="module")
def engine(tiny_mixtral_dir: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_mixtral_dir, block_size=4, max_num_seqs=16))


def test_concurrent_greedy_equals_alone(engine: LLMEngine) -> None:
    prompts = _prompts(12)
    alone = [engine.generate([p], GREEDY)[0] for p in prompts]
    together = engine.generate(prompts, GREEDY)
    assert together == alone
    assert engine.block_manager.num_used == 0


def test_requests_join_and_leave_between_steps(engine: LLMEngine) -> None:
    prompts = _prompts(6)
    alone = [engine.generate([p], GREEDY)[0] for p in prompts]
    seqs = [engine.add_request(f"join-{i}", p, GREEDY) for i, p in enumerate(prompts[:3])]
    for _ in range(5):
        engine.step()
    seqs += [engine.add_request(f"join-{i}", p, GREEDY) for i, p in enumerate(prompts[3:], start=3)]
    while engine.has_unfinished():
        engine.step()
    assert [s.completion_token_ids for s in seqs] == alone


def test_preemption_under_a_small_kv_cache_keeps_outputs(tiny_mixtral_dir: str, engine: LLMEngine) -> None:
    prompts = _prompts(8)
    expected = engine.generate(prompts, GREEDY)
    small = LLMEngine(EngineConfig(model=tiny_mixtral_dir, block_size=4, max_num_seqs=8, kv_cache_mb=1))
    small.block_manager.__init__(40, 4)  # 160 token slots for 8 requests of up to ~63 tokens: forces preemption
    assert small.generate(prompts, GREEDY) == expected
    assert small.scheduler.num_preemptions > 0
    assert small.block_manager.num_used == 0


def test_abort_frees_blocks(engine: LLMEngine) -> None:
    engine.add_request("to-abort", _prompts(1)[0], GREEDY)
    engine.step()
    assert engine.block_manager.num_used > 0
    out = engine.abort_request("to-abort")
    assert out is not None and out.finish_reason == "abort" and out.finished
    assert engine.block_manager.num_used == 0 and not engine.has_unfinished()
    assert engine.abort_request("to-abort") is None


def test_seeded_sampling_is_reproducible_and_batch_independent(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = _prompts(1)[0]
    first = engine.generate([prompt], params)[0]
    batched = engine.generate([prompt] + _prompts(4), params)[0]
    assert first == batched
    other_seed = SamplingParams(temperature=0.9, seed=99, max_tokens=16, ignore_eos=True)
    assert engine.generate([prompt], other_seed)[0] != first


def test_top_k_one_is_greedy(engine: LLMEngine) -> None:
    prompt = _prompts(1)[0]
    params = SamplingParams(temperature=1.0, top_k=1, seed=5, max_tokens=12, ignore_eos=True)
    assert engine.generate([prompt], params)[0] == engine.generate([prompt], GREEDY)[0][:12]


def test_a_stop_string_found_after_the_core_ended_at_max_tokens_is_counted_as_a_stop(engine: LLMEngine) -> None:
    """The frontend finds stop strings; when the core has already ended that request at max_tokens (it ran
    past the frontend's abort), the finish is counted as the stop the client was given, once."""
    finished_stop, finished_length = 'requests_finished_total{reason="stop"}', 'requests_finished_total{reason="length"}'
    before = engine.stats()
    seq = engine.add_request("ran-past", _prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    ended = engine.stats()
    assert ended[finished_length] == before.get(finished_length, 0) + 1
    assert engine.abort_request("ran-past", seq.serial + 1, "stop") is None  # another admission: not this one
    assert engine.abort_request("ran-past", seq.serial, "stop") is None
    assert engine.abort_request("ran-past", seq.serial, "stop") is None  # a second abort moves nothing
    after = engine.stats()
    assert after[finished_length] == before.get(finished_length, 0)
    assert after[finished_stop] == before.get(finished_stop, 0) + 1


def test_stop_token_ids_and_max_tokens(engine: LLMEngine) -> None:
    prompt = _prompts(1)[0]
    full = engine.generate([prompt], GREEDY)[0]
    stop_at = full[5]
    seq = engine.add_request("stop-id", prompt, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_at]))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].finish_reason == "stop"
    assert seq.completion_token_ids == full[: full.index(stop_at) + 1]
    seq = engine.add_request("len", prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    last = None
    while engine.has_unfinished():
        last = engine.step()[-1]
    assert last.finish_reason == "length" and last.completion_tokens == 3


def test_min_tokens_suppresses_stop_tokens(engine: LLMEngine) -> None:
    prompt = _prompts(1)[0]
    first = engine.generate([prompt], GREEDY)[0][0]
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, stop_token_ids=[first])
    tokens = engine.generate([prompt], params)[0]
    assert len(tokens) >= 4 and first not in tokens[:3]


def test_stop_string_truncates_text(engine: LLMEngine) -> None:
    prompt = _prompts(1)[0]
    seq = engine.add_request("probe", prompt, GREEDY)
    text = ""
    while engine.has_unfinished():
        text += "".join(o.delta_text for o in engine.step())
    assert len(text) > 6, "the tiny model should produce some text"
    stop = text[4:6]
    engine.add_request("stop-str", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))
    streamed, reason = "", None
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.delta_text
            reason = out.finish_reason or reason
    assert reason == "stop"
    assert streamed == text[: text.index(stop)]
    assert seq.is_finished


def test_bad_requests_are_rejected(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="temperature"):
        engine.add_request("bad", "hello", SamplingParams(temperature=-1))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.add_request("bad", "hello", SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("bad", "", SamplingParams())
    with pytest.raises(InvalidRequestError, match="out of range"):
        engine.add_request("bad", [VOCAB + 5], SamplingParams())
    with pytest.raises(ContextLengthExceededError, match="maximum context length"):
        engine.add_request("bad", [5] * (engine.max_model_len - 3), SamplingParams(max_tokens=10))
    assert not engine.has_unfinished()


def test_incremental_detokenizer_never_breaks_utf8(engine: LLMEngine) -> None:
    tok = engine.tokenizer
    text = "héllo wörld ✓ 你好 — naïve café"
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("say:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.step(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


async def test_async_engine_streams_and_aborts(tiny_mixtral_dir: str) -> None:
    engine = AsyncLLMEngine(EngineConfig(model=tiny_mixtral_dir, block_size=4))
    await engine.start()
    try:
        prompt = _prompts(1)[0]
        tokens: list[int] = []
        async for out in engine.generate("a", prompt, GREEDY):
            tokens += out.delta_token_ids
        assert out.finished and out.finish_reason == "length" and out.completion_tokens == len(tokens) == 24

        many = await asyncio.gather(*[_collect(engine, f"c{i}", prompt) for i in range(8)])
        assert all(m == tokens for m in many)

        stream = engine.generate("early-exit", prompt, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        await stream.aclose()  # the client went away: the request must be aborted and its blocks freed
        # Stats come from the core process as it reports them: wait for the report that counts the abort.
        aborted = 'requests_finished_total{reason="abort"}'
        await _until(lambda: engine.stats().get(aborted, 0) >= 1)
        assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["num_running"] == 0

        # Reusing an id right after its stream was closed: the stale abort must not reach the new stream.
        stream = engine.generate("reused", prompt, GREEDY)
        await stream.__anext__()
        await stream.aclose()
        assert await _collect(engine, "reused", prompt) == tokens
    finally:
        await engine.shutdown()


async def _collect(engine: AsyncLLMEngine, rid: str, prompt: list[int]) -> list[int]:
    return [t async for out in engine.generate(rid, prompt, GREEDY) for t in out.delta_token_ids]


async def _until(predicate, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_the_engine_thread_makes_an_indexed_cuda_device_current(monkeypatch) -> None:
    from services.engine.llm_engine import make_current

    made: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    for device in ("cpu", "cuda", "cuda:1", "cuda:0"):
        make_current(device)  # a bare "cuda" is the current device: set_device would raise without an index
    assert made == [1, 0]
