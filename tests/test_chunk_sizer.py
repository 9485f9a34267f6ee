"""--itl-target-ms: while sequences decode, a prefill step's prompt tokens are sized from measured steps so the
step (the running streams' next token) takes about the target; with no one decoding, whole budgets."""

from __future__ import annotations

import pytest
import torch

from services.engine.block_manager import BlockManager
from services.engine.chunk_sizer import FLOOR_TOKENS, ChunkSizer
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence
from tests.tiny_models import VOCAB


def test_the_chunk_is_what_fits_the_target_at_the_measured_cost_per_token() -> None:
    sizer = ChunkSizer(target_s=0.1, cap=2048)
    assert sizer.budget() == FLOOR_TOKENS  # nothing measured: a small chunk
    sizer.observe(prompt_tokens=1000, seconds=1.0)  # 1 ms a token
    assert sizer.budget() == 100
    sizer.observe(prompt_tokens=0, seconds=0.5)  # a step of no prompt tokens teaches nothing
    assert sizer.budget() == 100
    assert ChunkSizer(target_s=100.0, cap=512).budget() == FLOOR_TOKENS
    big = ChunkSizer(target_s=100.0, cap=512)
    big.observe(1000, 1.0)
    assert big.budget() == 512  # never past --max-num-batched-tokens
    slow = ChunkSizer(target_s=0.01, cap=2048)
    slow.observe(10, 5.0)
    assert slow.budget() == FLOOR_TOKENS  # a step slower than the target even at the floor


@pytest.mark.parametrize(("fixed_s", "per_token_s", "target_s"), [(0.05, 0.001, 0.25), (0.3, 0.002, 0.5)])
def test_steps_of_fixed_plus_per_token_cost_settle_at_the_target(fixed_s: float, per_token_s: float,
                                                                 target_s: float) -> None:
    """A step reads its weights once however few its tokens: a cost per token that includes it still finds
    the chunk whose step takes the target, t = (target - fixed) / per token."""
    sizer = ChunkSizer(target_s, cap=4096)
    sizer.observe(2048, fixed_s + per_token_s * 2048)  # a whole-budget prefill step first
    for _ in range(40):
        tokens = sizer.budget()
        sizer.observe(tokens, fixed_s + per_token_s * tokens)
    assert sizer.budget() == pytest.approx((target_s - fixed_s) / per_token_s, rel=0.03)


def test_the_scheduler_sizes_only_steps_that_carry_running_sequences() -> None:
    sizer = ChunkSizer(target_s=0.01, cap=64)
    sizer.observe(10, 0.001)  # 0.1 ms a token: 100 tokens fit, the cap 64 holds
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, block_manager=BlockManager(128, 4),
                          chunk_sizer=sizer)
    params = SamplingParams(max_tokens=4)
    first = Sequence("first", list(range(3, 103)), params, 4)
    scheduler.add(first)
    batch = scheduler.schedule()
    assert batch.num_decodes == 0 and first.num_scheduled_tokens == 64  # no one decoding: the whole budget
    first.num_cached_tokens = 64  # what the runner records after the chunk
    sizer.observe(64, 0.064)  # 1 ms a token from here: 10 tokens fit the target, the floor is more
    batch = scheduler.schedule()
    assert first.num_scheduled_tokens == 36  # the prompt's rest (still no one decoding)
    first.num_cached_tokens, first.num_scheduled_tokens = len(first), 0
    first.append_token(5)
    second = Sequence("second", list(range(3, 203)), params, 4)
    scheduler.add(second)
    batch = scheduler.schedule()
    assert batch.seqs[: batch.num_decodes] == [first]
    assert second.num_scheduled_tokens == min(FLOOR_TOKENS, 64)


def test_an_engine_with_a_target_gives_the_same_tokens(tiny_mixtral_dir: str) -> None:
    """Chunks change where a prompt's prefill splits, never the tokens; each prefill step is measured."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 90, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = []
    for target in (None, 0.001):  # a microsecond: every mixed step at the floor
        engine = LLMEngine(EngineConfig(model=tiny_mixtral_dir, block_size=4, max_num_batched_tokens=64,
                                        itl_target_ms=target))
        try:
            engine.add_request("a", prompts[0], params)
            engine.step()
            engine.add_request("b", prompts[1], params)
            engine.add_request("c", prompts[2], params)
            outputs: dict[str, list[int]] = {}
            while engine.has_unfinished():
                for out in engine.step():
                    outputs.setdefault(out.request_id, []).extend(out.delta_token_ids)
            runs.append((outputs, engine.stats()["prefill_steps_total"], engine.scheduler.chunk_sizer))
        finally:
            engine.close()
    (whole, whole_steps, none), (sized, sized_steps, sizer) = runs
    assert sized == whole and none is None
    assert sizer is not None and sizer.seconds_per_token is not None
    assert sized_steps > whole_steps  # the prompts went in floor-sized chunks beside "a"'s decoding


@pytest.mark.parametrize("bad", [0.0, -5.0])
def test_a_target_must_be_positive(tiny_mixtral_dir: str, bad: float) -> None:
    with pytest.raises(ValueError, match="itl_target_ms must be positive"):
        EngineConfig(model=tiny_mixtral_dir, itl_target_ms=bad).validate()


@pytest.mark.parametrize("targets", ["0", "250,-1", ",", "fast"])
def test_bench_itl_target_refuses_bad_targets(tiny_mixtral_dir: str, targets: str, tmp_path) -> None:
    from services.cli import main

    assert main(["bench", "itl-target", "--model", tiny_mixtral_dir, "--targets", targets,
                 "--json", str(tmp_path / "x.json")]) == 2


def test_a_target_is_refused_with_offloaded_experts(tiny_mixtral_dir: str) -> None:
    """Each chunk of a prefill moves nearly every offloaded expert again: small chunks would cost the prompt
    a link's worth a step for a step barely shorter."""
    with pytest.raises(ValueError, match="resident experts; with --offload-policy lru"):
        EngineConfig(model=tiny_mixtral_dir, itl_target_ms=250.0, offload_policy="lru").validate()
