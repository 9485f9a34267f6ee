"""Prefix caching: prompts that start with blocks computed before reuse them, token-identical to computing them,
with reference-counted blocks that are evicted least recently freed first and never leak."""

from __future__ import annotations

import pytest
import torch

from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sampling_params import SamplingParams
from services.engine.sequence import Sequence
from tests.tiny_models import VOCAB

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BS = 4


def _shared_prefix_prompts(count: int, prefix_len: int = 18) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, VOCAB, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
            for n in torch.randint(1, 9, (count,), generator=g)]


def _engine(model_dir: str, caching: bool, **overrides: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, block_size=BS, enable_prefix_caching=caching, **overrides))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v2_lite"])
def test_prompts_sharing_a_prefix_reuse_its_blocks_token_identically(
    tiny_model_dirs: dict[str, str], family: str
) -> None:
    prompts = _shared_prefix_prompts(5)
    plain = _engine(tiny_model_dirs[family], caching=False)
    expected = [plain.generate([p], GREEDY)[0] for p in prompts]
    plain.close()
    engine = _engine(tiny_model_dirs[family], caching=True)
    try:
        assert [engine.generate([p], GREEDY)[0] for p in prompts] == expected
        stats = engine.stats()
        assert engine.generate(prompts, GREEDY) == expected  # together, every prefix now cached
    finally:
        engine.close()
    # The first prompt computes the shared 16 tokens (4 full blocks of the 18); the other four reuse them.
    assert stats["prefix_cache_hits_total"] >= 4 * 16
    assert stats["prefix_cache_queries_total"] == sum(len(p) for p in prompts)
    assert engine.block_manager.num_used == 0 and engine.block_manager.num_registered > 0


def test_a_repeated_prompt_of_whole_blocks_computes_its_last_token(tiny_mixtral_dir: str) -> None:
    prompt = _shared_prefix_prompts(1, prefix_len=4 * BS)[0][: 4 * BS]
    plain = _engine(tiny_mixtral_dir, caching=False)
    expected = plain.generate([prompt], GREEDY)
    plain.close()
    engine = _engine(tiny_mixtral_dir, caching=True)
    try:
        assert engine.generate([prompt], GREEDY) == expected
        assert engine.generate([prompt], GREEDY) == expected
        assert engine.stats()["prefix_cache_hits_total"] == 3 * BS  # the last block is computed again
    finally:
        engine.close()


def test_a_small_cache_evicts_registered_blocks_and_preempts_without_changing_tokens(
    tiny_mixtral_dir: str,
) -> None:
    prompts = _shared_prefix_prompts(8)
    plain = _engine(tiny_mixtral_dir, caching=False)
    expected = plain.generate(prompts, GREEDY)
    plain.close()
    engine = _engine(tiny_mixtral_dir, caching=True, max_num_seqs=8)
    engine.block_manager.__init__(24, BS, prefix_caching=True)  # 96 slots for 8 requests of 27-34 tokens
    try:
        assert engine.generate(prompts, GREEDY) == expected
        assert engine.generate(prompts[::-1], GREEDY) == expected[::-1]
        assert engine.scheduler.num_preemptions > 0
    finally:
        engine.close()
    assert engine.block_manager.num_used == 0


def test_blocks_are_shared_by_reference_and_evicted_least_recently_freed_first() -> None:
    params = SamplingParams(max_tokens=4)
    bm = BlockManager(6, BS, prefix_caching=True)
    first = Sequence("a", list(range(10, 19)), params, BS)  # 9 tokens: two full blocks and one more
    bm.allocate(first)
    assert first.num_cached_tokens == 0 and bm.num_free == 3
    first.num_cached_tokens = len(first)  # its prefill ran
    bm.register_computed(first)
    assert bm.num_registered == 2
    second = Sequence("b", list(range(10, 18)) + [99, 98], params, BS)  # the same two blocks, then its own
    assert bm.can_allocate(second)
    bm.allocate(second)
    assert second.block_table[:2] == first.block_table[:2] and second.num_cached_tokens == 2 * BS
    assert bm.num_free == 2
    bm.free(first)
    bm.free(second)
    assert bm.num_used == 0 and bm.num_registered == 2
    # Six fresh blocks wanted: the unregistered ones go first, then the registered ones, unregistering them.
    third = Sequence("c", list(range(50, 74)), params, BS)
    bm.allocate(third)
    assert third.num_cached_tokens == 0 and bm.num_registered == 0 and bm.num_free == 0
    bm.free(third)
    assert bm.num_free == 6


def test_a_prompt_whose_hits_sit_in_the_free_list_counts_them_once() -> None:
    """Idle registered blocks are both 'free' and the prompt's own: admission must not count them twice."""
    params = SamplingParams(max_tokens=4)
    bm = BlockManager(3, BS, prefix_caching=True)
    seq = Sequence("a", list(range(10, 19)), params, BS)
    bm.allocate(seq)
    seq.num_cached_tokens = len(seq)
    bm.free(seq)
    again = Sequence("b", list(range(10, 19)) + [1, 2, 3, 4], params, BS)  # 4 blocks, 2 of them hits
    assert not bm.can_allocate(again)  # 2 new blocks, but the free list's 3 include the 2 hits
    shorter = Sequence("c", list(range(10, 19)), params, BS)  # 3 blocks, 2 hits, 1 new
    assert bm.can_allocate(shorter)


def test_the_flag_and_its_env_var_reach_the_engine(tiny_mixtral_dir: str, monkeypatch) -> None:
    from services.cli import build_parser
    from services.engine.cli import engine_config

    parse = build_parser().parse_args
    assert engine_config(parse(["generate", "--model", tiny_mixtral_dir, "--prompt", "x",
                                "--enable-prefix-caching"])).enable_prefix_caching
    assert not engine_config(parse(["generate", "--model", tiny_mixtral_dir, "--prompt", "x"])).enable_prefix_caching
    monkeypatch.setenv("HINTSERVE_ENABLE_PREFIX_CACHING", "1")
    assert engine_config(parse(["generate", "--model", tiny_mixtral_dir, "--prompt", "x"])).enable_prefix_caching


async def test_a_multi_turn_chat_through_the_api_reuses_its_history(tiny_mixtral_dir: str) -> None:
    """The real `openai` client against the gateway: each turn's prompt holds the previous ones, prefilled in
    chunks of 8 tokens the first time and taken from the prefix cache after; the answers are the plain
    engine's."""
    from services.gateway.engine_client import InProcessEngineClient
    from tests.test_gateway_support import MODEL, openai_client, running_gateway, started_engine

    async def chat(config: dict[str, object]) -> tuple[list[str], dict[str, float]]:
        async with started_engine(tiny_mixtral_dir, block_size=BS, **config) as engine:
            async with running_gateway([InProcessEngineClient(engine)], tiny_mixtral_dir) as (_, server):
                client = openai_client(server)
                messages: list[dict[str, str]] = []
                answers = []
                for question in ("The quick brown fox", "jumps over the lazy dog", "and runs away"):
                    messages.append({"role": "user", "content": question})
                    r = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                             temperature=0, extra_body={"ignore_eos": True})
                    answer = r.choices[0].message.content or ""
                    answers.append(answer)
                    messages.append({"role": "assistant", "content": answer})
                await client.close()
                return answers, engine.stats()

    plain, _ = await chat({})
    cached, stats = await chat({"enable_prefix_caching": True, "max_num_batched_tokens": 8})
    assert cached == plain
    assert stats["prefix_cache_hits_total"] > 0 and stats["prefill_steps_total"] > 3


def test_random_traffic_with_chunks_cache_preemption_and_aborts_leaks_nothing(tiny_mixtral_dir: str) -> None:
    """Requests arrive, share prefixes, get aborted mid-prefill or mid-decode, under a cache small enough to
    preempt: every finished one has the tokens it has alone, and every block comes back."""
    g = torch.Generator().manual_seed(7)
    prefixes = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in (9, 17, 30)]
    prompts = [prefixes[int(torch.randint(3, (1,), generator=g))]
               + torch.randint(3, VOCAB, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
               for _ in range(24)]
    plain = _engine(tiny_mixtral_dir, caching=False)
    expected = [plain.generate([p], GREEDY)[0] for p in prompts]
    plain.close()
    engine = _engine(tiny_mixtral_dir, caching=True, max_num_seqs=6, max_num_batched_tokens=12)
    engine.block_manager.__init__(28, BS, prefix_caching=True)
    seqs, aborted = {}, set()
    try:
        pending = list(range(len(prompts)))
        step = 0
        while pending or engine.has_unfinished():
            if pending and int(torch.randint(3, (1,), generator=g)) == 0:
                i = pending.pop(0)
                seqs[i] = engine.add_request(f"r{i}", prompts[i], GREEDY)
            live = [i for i, s in seqs.items() if not s.is_finished and i not in aborted]
            if live and int(torch.randint(12, (1,), generator=g)) == 0:
                victim = live[int(torch.randint(len(live), (1,), generator=g))]
                assert engine.abort_request(f"r{victim}") is not None
                aborted.add(victim)
            engine.step()
            step += 1
            assert step < 5000
    finally:
        engine.close()
    assert aborted and engine.scheduler.num_preemptions > 0 and engine.stats()["prefix_cache_hits_total"] > 0
    for i, seq in seqs.items():
        if i not in aborted:
            assert seq.completion_token_ids == expected[i], i
    assert engine.block_manager.num_used == 0 and engine.block_manager.num_free == 28
