"""A layer's cached experts in one native call: the resident engine's call over the cache's slots.

Once the cache holds every expert a step asks for, an offloaded CPU layer is exactly the resident engine's layer:
one hs_moe call, now reading the slots, each token's experts summed in the router's order. So its logits are the
resident engine's bit for bit, prefill's too where both keep every row (the per-expert path, two calls an expert,
summed them in expert order and differed in the last bits), and the experts a layer still misses add into the
batch's sum."""

from __future__ import annotations

import ctypes

import pytest
import torch

from services.engine import cpu_kernels, model_runner
from services.engine.config import EngineConfig
from services.engine.cpu_kernels import formats, moe_calls
from services.engine.llm_engine import LLMEngine
from services.engine.offload.resident_view import ResidentView
from services.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="native CPU kernels not built")

Key = tuple[str, int]  # (request id, completion tokens before the step)


def _logits(engine: LLMEngine, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> dict[Key, torch.Tensor]:
    """Every sampled row's logits of a greedy run."""
    seen: dict[Key, torch.Tensor] = {}
    original = model_runner.sample

    def recording(logits, seqs, eos_ids, generator):
        for i, seq in enumerate(seqs):
            seen[(seq.request_id, seq.num_completion_tokens)] = logits[i].clone()
        return original(logits, seqs, eos_ids, generator)

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with monkeypatch.context() as patch:
        patch.setattr(model_runner, "sample", recording)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        while engine.has_unfinished():
            engine.step()
    return seen


@pytest.mark.parametrize("view", [True, False], ids=["resident-view", "cached-batch"])
@pytest.mark.parametrize("dtype", ["bf16", "int4"])
def test_a_full_cache_gives_the_resident_engines_logits_bit_for_bit(demo_model_dir, dtype, view, monkeypatch) -> None:
    """A cache with a slot for every expert is filled when built, so nothing misses. Through the resident view
    (offload/resident_view.py) the model decodes each layer in one native call over the slots; without it,
    each layer's hits go through the provider in one hs_moe call: the same logits either way, the same hits."""
    prompts = [list(range(5, 40)), list(range(100, 117))]
    resident = LLMEngine(EngineConfig(model=demo_model_dir, expert_dtype=dtype))
    # A step observer keeps every row of a prefill's last layer, as the offloaded engine does. Pruned to each
    # sequence's last row, that layer summed in another order, and with bf16 activations (a CPU with a bf16 dot
    # product: a Zen 4 guest) the rounding grew to 7e-4 in the prefill's logits.
    resident.runner.step_observers.append(lambda ctx: None)
    try:
        expected = _logits(resident, prompts, monkeypatch)
    finally:
        resident.close()
    if not view:
        monkeypatch.setattr(ResidentView, "refresh", lambda self: None)
    engine = LLMEngine(EngineConfig(model=demo_model_dir, expert_dtype=dtype, offload_policy="lru",
                                    expert_cache_fraction=1.0, link_ratio=30.0))
    engine.runner.step_observers.append(lambda ctx: None)  # the view would prune as the resident engine does
    try:
        experts = engine.model.experts
        assert experts.cache.num_occupied == experts.cache.num_slots  # preloaded, before any request
        got = _logits(engine, prompts, monkeypatch)
        assert sum(experts.stats.misses) == 0 and sum(experts.stats.hits) > 0
        assert experts.stats.slots_occupied == experts.cache.num_slots  # the engine stats' gauge, either way
        assert experts.resident.holding == view
        assert all(slot.pins == 0 for slot in experts.cache.slots)
        HITS[(dtype, view)] = list(experts.stats.hits)
    finally:
        engine.close()
    assert got.keys() == expected.keys()
    different = [key for key in expected if not torch.equal(got[key], expected[key])]
    worst = max((float((got[k] - expected[k]).abs().max()) for k in different), default=0.0)
    assert not different, f"logits differ from the resident engine's at {different[:3]} (prefill: 0 tokens) by {worst}"
    if (dtype, not view) in HITS:  # the view counts each layer's distinct experts, as the provider's lookups
        assert HITS[(dtype, view)] == HITS[(dtype, not view)]


HITS: dict[tuple[str, bool], list[int]] = {}


def test_the_resident_view_lapses_when_a_slot_is_reassigned(demo_model_dir, monkeypatch) -> None:
    """Freeing one slot ends the view at once: the model rebuilds its decode layers without it, the provider
    fetches the expert again on its next use, and the tokens stay the resident engine's. The logits agree to
    rounding, not bit for bit: whether a step finds the freed layer's experts landed (one call over the slots)
    or still missing (added into the batch's sum, in another order) depends on when the link's copies land, and
    the runs differed by up to 5e-6 (1 in 10-20 on a 2-core guest)."""
    prompts = [list(range(5, 40))]
    engine = LLMEngine(EngineConfig(model=demo_model_dir, expert_dtype="int4", offload_policy="lru",
                                    expert_cache_fraction=1.0, link_ratio=30.0))
    engine.runner.step_observers.append(lambda ctx: None)  # every prefill row, with and without the view
    try:
        experts = engine.model.experts
        first = _logits(engine, prompts, monkeypatch)
        assert experts.resident.holding and any(layer is not None for layer in engine.model._decode_layers or [])
        epoch = experts.native_epoch
        routed = [int(e) for e in torch.nonzero(torch.tensor(experts.stats.hits)).flatten()]
        layer = routed[0]
        for expert in range(engine.spec.num_experts):
            slot = experts.cache.lookup((layer, expert))
            assert slot is not None
            experts.cache.release(slot)
        assert experts.native_epoch != epoch and experts.native_experts(layer) is None  # the model's order
        again = _logits(engine, prompts, monkeypatch)
        assert sum(experts.stats.misses) > 0  # the freed layer's experts came back over the link
        # Every expert cached again by a step's end: the view is back, and the decode layers rebuilt on it.
        assert experts.resident.holding and experts.native_epoch == epoch + 2
    finally:
        engine.close()
    assert first.keys() == again.keys()
    for key in first:
        assert int(first[key].argmax()) == int(again[key].argmax())
        torch.testing.assert_close(again[key], first[key], rtol=0.0, atol=1e-4)


def test_left_out_experts_add_nothing_and_slots_are_read_through_matrix_of() -> None:
    hidden, inner, experts = 128, 64, 4
    g = torch.Generator().manual_seed(3)
    mats = [(formats.pack(torch.randn(2 * inner, hidden, generator=g) / 8, "bf16"),
             formats.pack(torch.randn(hidden, inner, generator=g) / 8, "bf16")) for _ in range(experts)]
    slots = list(reversed(mats))  # expert e lives in slot experts - 1 - e
    gate_up = moe_calls.native_array([m[0] for m in slots])
    down = moe_calls.native_array([m[1] for m in slots])
    x = torch.randn(3, hidden, generator=g)
    ids = torch.tensor([[0, 2], [1, 3], [2, 1]])
    weights = torch.rand(3, 2, generator=g)
    matrix_of = (ctypes.c_int64 * experts)(3, -1, 1, 0)  # expert 1 left out
    got = moe_calls.moe(x, ids, weights, gate_up, down, hidden, matrix_of)
    want = torch.zeros(3, hidden)
    for t in range(3):
        for k in range(2):
            e = int(ids[t, k])
            if e != 1:
                want[t] += weights[t, k] * moe_calls.expert(x[t : t + 1], *mats[e])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="out of range"):
        moe_calls.moe(x, ids, weights, gate_up, down, hidden, (ctypes.c_int64 * experts)(3, 2, 1, 4))


@pytest.mark.parametrize(("policy", "cache"), [
    ("lru", {"expert_cache_fraction": 0.25}), ("hintserve", {"expert_cache_fraction": 0.25}),
    ("hintserve-transfer", {"expert_cache_fraction": 0.25}), ("lru", {"expert_cache_experts": 2}),
], ids=["lru", "hintserve", "hintserve-transfer", "lru-top-k-slots"])
def test_a_part_cached_layer_adds_its_other_experts_into_the_batch(demo_model_dir, policy, cache, monkeypatch) -> None:
    """With part of the experts cached, layers mix a batch of hits with fetched (lru), prefetched or
    host-computed (hintserve) experts: the tokens stay the resident engine's, and no slot stays pinned; with
    only top-k slots the late batch waits for what the first one freed."""
    prompts = [list(range(5, 40)), list(range(100, 117))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    resident = LLMEngine(EngineConfig(model=demo_model_dir, expert_dtype="bf16"))
    try:
        expected = resident.generate(prompts, params)
    finally:
        resident.close()
    engine = LLMEngine(EngineConfig(model=demo_model_dir, expert_dtype="bf16", offload_policy=policy,
                                    link_ratio=30.0, **cache))
    provider = engine.model.experts
    sizes: list[tuple[bool, int, int]] = []  # (waits, batched, device experts) of each batch asked for
    cached_batch = provider.cached_batch

    def counting(layer: int, experts: list[int], wait: bool = False):
        batch = cached_batch(layer, experts, wait)
        sizes.append((wait, 0 if batch is None else len(batch.experts), len(experts)))
        return batch

    monkeypatch.setattr(provider, "cached_batch", counting)
    try:
        assert engine.generate(prompts, params) == expected
        assert all(slot.pins == 0 for slot in provider.cache.slots if slot.key not in getattr(provider, "pinned", ()))
    finally:
        engine.close()
    assert any(batched for _, batched, _ in sizes), "no cached batch"
    if policy == "lru":  # demand fetches still on the link at the ready batch: the late one takes them
        assert any(wait and batched for wait, batched, _ in sizes), "no late batch"
        if "expert_cache_fraction" in cache:
            assert any(0 < batched < device for wait, batched, device in sizes if not wait), "no layer mixed hits and fetches"
    if policy == "hintserve":
        assert provider.stats.host_experts > 0, "no expert computed on the host beside the batches"
