"""Chunked prefill: prompts longer than a step's token budget prefill over several steps, token-identical to
one step, with the running sequences decoding between the chunks and nothing leaked on abort or failure."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence
from services.engine.trace_recorder import TraceRecorder
from tests.tiny_models import VOCAB

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BUDGET = 8  # prompt tokens a step computes at most


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _engine(model_dir: str, **overrides: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, block_size=4, max_num_batched_tokens=BUDGET, **overrides))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v2_lite"])
def test_chunked_prefill_is_token_identical_to_one_step(tiny_model_dirs: dict[str, str], family: str) -> None:
    prompts = _prompts((3, 8, 9, 21, 37))
    whole = LLMEngine(EngineConfig(model=tiny_model_dirs[family], block_size=4))
    expected = [whole.generate([p], GREEDY)[0] for p in prompts]
    engine = _engine(tiny_model_dirs[family])
    try:
        assert [engine.generate([p], GREEDY)[0] for p in prompts] == expected
        assert engine.generate(prompts, GREEDY) == expected  # chunks beside whole prompts in one step
        stats = engine.stats()
    finally:
        engine.close()
        whole.close()
    # Every prompt token computed once, in steps of at most BUDGET tokens.
    assert stats["prefill_tokens_total"] == 2 * sum(len(p) for p in prompts)
    assert stats["prefill_steps_total"] >= 2 * sum(len(p) for p in prompts) / BUDGET
    assert engine.block_manager.num_used == 0


@pytest.mark.parametrize("policy,extra", [("lru", {"expert_cache_experts": 2, "link_gbps": 1.0}),
                                          ("cpu-experts", {"link_ratio": 100.0, "host_ratio": 2.0})])
def test_chunked_prefill_with_offloaded_or_host_experts_keeps_tokens(
    tiny_mixtral_dir: str, policy: str, extra: dict[str, float]
) -> None:
    prompts = _prompts((9, 30))
    whole = LLMEngine(EngineConfig(model=tiny_mixtral_dir, block_size=4))
    expected = whole.generate(prompts, GREEDY)
    whole.close()
    engine = _engine(tiny_mixtral_dir, offload_policy=policy, **extra)
    try:
        assert engine.generate(prompts, GREEDY) == expected
    finally:
        engine.close()
    assert engine.block_manager.num_used == 0


def test_a_prompt_longer_than_the_step_budget_is_served(tiny_mixtral_dir: str) -> None:
    engine = _engine(tiny_mixtral_dir)
    try:
        out = engine.generate(_prompts((5 * BUDGET + 3,)), GREEDY)
    finally:
        engine.close()
    assert len(out[0]) == GREEDY.max_tokens


def test_running_sequences_decode_inside_a_long_prompts_chunk_steps(tiny_mixtral_dir: str) -> None:
    short, long = _prompts((4, 4 * BUDGET))
    engine = _engine(tiny_mixtral_dir)
    try:
        first = engine.add_request("first", short, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        engine.step()  # its prefill
        second = engine.add_request("second", long, GREEDY)
        before = engine.stats()
        steps = []
        layouts = []
        prepare = engine.runner._prepare_prefill

        def recording(seqs: list[Sequence]):  # each step's attention layout, beside its length then
            prepared = prepare(seqs)
            layouts.append((prepared[2], list(first.block_table), len(first), second.num_cached_tokens))
            return prepared

        engine.runner._prepare_prefill = recording  # type: ignore[method-assign]
        while second.num_completion_tokens == 0:
            tokens, cached = first.num_completion_tokens, second.num_cached_tokens
            engine.step()
            steps.append((first.num_completion_tokens - tokens, second.num_cached_tokens - cached))
        after = engine.stats()
        engine.abort_request("first")
        engine.abort_request("second")
    finally:
        engine.close()
    # Four chunks of the prompt, each step also the running sequence's next token: no decode step between.
    assert steps == [(1, BUDGET)] * 4
    assert after["prefill_steps_total"] - before["prefill_steps_total"] == 4
    assert after.get("decode_steps_total", 0.0) == before.get("decode_steps_total", 0.0)
    assert after["prefill_tokens_total"] - before["prefill_tokens_total"] == 4 * BUDGET  # prompt tokens only
    assert after["prefill_step_decode_tokens_total"] - before.get("prefill_step_decode_tokens_total", 0.0) == 4
    assert engine.block_manager.num_used == 0
    # The running sequence's row reads its context through the paged decode path (its block table, its length);
    # only the prompt's chunks gather keys and values: the cached part of the prompt and the chunk.
    for meta, first_table, first_len, cached in layouts:
        assert meta.num_decode_rows() == 1
        assert meta.decode_rows.context_lens.tolist() == [first_len]
        assert meta.decode_rows.block_tables[0].tolist() == first_table
        if cached:
            assert meta.prefill_kv_lens == [cached + BUDGET] and meta.prefill_kv_slots.numel() == cached + BUDGET
        else:
            assert meta.prefill_kv_slots is None


def test_mixed_steps_give_every_request_the_tokens_it_has_alone(tiny_model_dirs: dict[str, str]) -> None:
    """Prompts arriving while others decode (chunks beside one-token rows in one step), for each family."""
    prompts = _prompts((5, 30, 3, 19, 12))
    for family, model_dir in tiny_model_dirs.items():
        alone = _engine(model_dir)
        expected = [alone.generate([p], GREEDY)[0] for p in prompts]
        alone.close()
        engine = _engine(model_dir)
        try:
            seqs = []
            for p in prompts:  # one arrival per step: each later prompt prefills beside the running ones
                seqs.append(engine.add_request(f"r{len(seqs)}", p, GREEDY))
                engine.step()
            while engine.has_unfinished():
                engine.step()
            stats = engine.stats()
        finally:
            engine.close()
        assert [s.completion_token_ids for s in seqs] == expected, family
        assert stats["prefill_step_decode_tokens_total"] > 0 and engine.block_manager.num_used == 0


def test_aborting_a_prompt_between_its_chunks_frees_its_blocks(tiny_mixtral_dir: str) -> None:
    engine = _engine(tiny_mixtral_dir)
    try:
        seq = engine.add_request("long", _prompts((3 * BUDGET,))[0], GREEDY)
        engine.step()
        assert seq.num_cached_tokens == BUDGET and engine.block_manager.num_used == len(seq.block_table) > 0
        assert engine.abort_request("long") is not None
        assert engine.block_manager.num_used == 0 and not engine.has_unfinished()
    finally:
        engine.close()


def test_a_failing_chunk_fails_its_request_alone(tiny_mixtral_dir: str) -> None:
    """The isolator's path: the request whose chunk raises ends with an error, its blocks freed; the queue
    goes on."""
    engine = _engine(tiny_mixtral_dir)
    real_run = engine.isolator.run

    def run(seqs: list[Sequence], is_prefill: bool) -> list[int | None]:
        if any(s.request_id == "bad" and s.num_cached_tokens > 0 for s in seqs):
            raise RuntimeError("injected")
        return real_run(seqs, is_prefill)

    engine.isolator.run = run
    try:
        bad = engine.add_request("bad", _prompts((3 * BUDGET,))[0], GREEDY)
        good = engine.add_request("good", _prompts((5,))[0], GREEDY)
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
    finally:
        engine.close()
    errors = [o for o in outputs if o.finish_reason == "error"]
    assert [o.request_id for o in errors] == ["bad"] and "injected" in (errors[0].error or "")
    assert bad.is_finished and good.num_completion_tokens == GREEDY.max_tokens
    assert engine.block_manager.num_used == 0


def test_a_preempted_sequence_queues_behind_a_prompt_midway_through_its_prefill() -> None:
    """The prompt holds blocks for its whole length; the preempted one could not get in before it finishes."""
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=4, block_manager=BlockManager(8, 4))
    params = SamplingParams(max_tokens=4)
    long = Sequence("long", list(range(3, 15)), params, 4)
    scheduler.add(long)
    batch, is_prefill, _ = scheduler.schedule()
    assert is_prefill and batch == [long] and long.num_scheduled_tokens == 4 and scheduler.waiting[0] is long
    victim = Sequence("victim", [3, 4], params, 4)
    scheduler._preempt(victim)
    assert list(scheduler.waiting) == [long, victim]


def test_traces_of_a_chunked_prefill_add_up_to_one_iteration(tiny_mixtral_dir: str) -> None:
    prompt = _prompts((3 * BUDGET + 1,))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    traces = []
    for budget in (2048, BUDGET):
        engine = LLMEngine(EngineConfig(model=tiny_mixtral_dir, block_size=4, max_num_batched_tokens=budget))
        recorder = TraceRecorder(engine.spec.num_experts)
        engine.runner.step_observers.append(recorder)
        try:
            engine.generate(prompt, params)
        finally:
            engine.close()
        traces.append(next(iter(recorder.iterations.values())))
    whole, chunked = traces
    assert sorted(chunked) == sorted(whole) == [0, 1, 2]
    assert chunked[0].num_tokens == whole[0].num_tokens == len(prompt[0])
    np.testing.assert_array_equal(chunked[0].counts, whole[0].counts)
    np.testing.assert_allclose(chunked[0].probs, whole[0].probs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(chunked[0].embedding, whole[0].embedding, rtol=1e-5, atol=1e-6)


def test_block_slots_are_each_positions_block_and_offset() -> None:
    """BlockManager.slots (a range per block) gives position p the slot table[p // size] * size + p % size."""
    bm = BlockManager(16, 4)
    seq = Sequence("s", list(range(3, 17)), SamplingParams(max_tokens=4), 4)
    bm.allocate(seq)
    seq.block_table = [9, 2, 14, 5]  # out of order, as blocks come back
    for start in range(15):
        for end in range(start, 15):
            assert bm.slots(seq, start, end) == [seq.block_table[p // 4] * 4 + p % 4 for p in range(start, end)]
