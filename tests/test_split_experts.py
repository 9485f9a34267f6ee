"""Split experts: an expert's rows computed part on the device, part on the host, and the staging slots they take."""

from __future__ import annotations

import pytest
import torch

from services.engine.offload.cost_model import PlacementCosts
from tests.hybrid_runs import run_policy


@pytest.mark.usefixtures("separate_memories", "splits_despite_the_budget")
def test_split_experts_keep_tokens_and_free_their_staging(reference) -> None:
    # Host and link close in price: hintserve splits misses (gate/up on the host, down over the link).
    tokens, expected, provider, stats = run_policy(reference, "hintserve", expert_cache_fraction=0.25, link_ratio=30.0,
                                                   host_ratio=20.0)
    assert tokens == expected
    assert provider.stats.host_split_experts > 0
    assert stats["offload_host_compute_split_experts_total"] == provider.stats.host_split_experts
    assert len(provider.staging._free) == len(provider.staging.buffers)  # every staging buffer back


def test_a_splitting_policy_pays_for_its_staging_out_of_the_cache_budget() -> None:
    from services.engine.offload.hybrid_setup import hybrid_slots
    from services.engine.offload.policies import get_policy
    from services.engine.offload.split_experts import split_prices

    third = split_prices((200, 100), dense=True)
    # Eight down matrices of a third of an expert each: three slots' worth.
    assert hybrid_slots(get_policy("hintserve"), 55, [], third, staging=8) == 52
    assert hybrid_slots(get_policy("fiddler"), 55, [], third, staging=8) == 55
    assert hybrid_slots(get_policy("hintserve"), 55, [], None, staging=8) == 55  # packed: no split


def test_split_staging_fills_the_slots_it_costs() -> None:
    from services.engine.offload.split_experts import split_prices, staging_buffers, staging_slots

    third = split_prices((200, 100), dense=True)
    # Top-2 down matrices cost a whole slot, which holds three: the third is free, and a batch uses it.
    assert staging_buffers(2, third) == 3 and staging_slots(3, third) == 1
    assert staging_buffers(8, third) == 9 and staging_slots(9, third) == 3
    assert staging_buffers(2, None) == 0


def test_no_staging_where_no_decode_miss_would_split() -> None:
    """The staging costs a cache slot: the placement must split some decode step's miss. At a 30x link (this
    machine's unit, 15.6x host) a one-token miss splits; at 100x the down matrix alone outlasts two whole
    experts on the host, so batch 1 (two misses a layer at most) never splits, while batch 4 piles enough on
    the host that its third miss does."""
    from services.engine.offload.split_experts import split_pays, split_prices

    third = split_prices((200, 100), dense=True)
    unit, per_token = 52e-6, 5.7e-6
    costs = lambda link: PlacementCosts(unit, per_token, 15.6 * unit, 15.6 * per_token, link * unit)  # noqa: E731
    assert split_pays(third, costs(30), max_tokens=1, top_k=2, num_experts=8)
    assert not split_pays(third, costs(100), max_tokens=1, top_k=2, num_experts=8)
    assert split_pays(third, costs(100), max_tokens=4, top_k=2, num_experts=8)
    assert not split_pays(None, costs(30), max_tokens=16, top_k=2, num_experts=8)  # a packed expert never splits


def test_a_split_is_staged_only_where_it_saves_more_than_the_slots_it_takes() -> None:
    """The staging's slot against the splits: on one DRAM that the host's math fills alone (the emulated host) a
    split gains little, and a small cache's slot is worth more holding an expert; with memories of their own
    the splits win, until the budget holds every expert and nothing misses."""
    from services.engine.offload.split_experts import split_pays, split_prices

    third = split_prices((200, 100), dense=True)
    unit, per_token, size = 52e-6, 5.7e-6, 786432.0

    def costs(dram: float) -> PlacementCosts:  # host 15.6x, link 30x the device, as the emulated grid prices them
        return PlacementCosts(unit, per_token, 15.6 * unit, 15.6 * per_token, 30 * unit, dram=dram,
                              host_bytes=size, link_bytes=size)

    one_dram = costs(size / (15.6 * unit))
    for batch in (4, 16):
        assert split_pays(third, one_dram, batch, 2, 8)  # some miss would split...
        for slots in (4, 12, 24):  # ...but not enough to pay for a slot of 10-50% of 48 experts
            assert not split_pays(third, one_dram, batch, 2, 8, moe_layers=6, slots=slots)
    for slots in (4, 12, 47):  # a one-token miss splits on memories of their own, and saves more than a slot
        assert split_pays(third, costs(float("inf")), 1, 2, 8, moe_layers=6, slots=slots)
    for slots in (48, 60):  # a budget for every expert never misses: nothing to split, however cheap
        assert not split_pays(third, costs(float("inf")), 1, 2, 8, moe_layers=6, slots=slots)


@pytest.mark.usefixtures("separate_memories", "splits_despite_the_budget")
@pytest.mark.parametrize("host_ratio", [20.0, 12.0])
def test_a_split_experts_longer_half_starts_first(reference, monkeypatch, host_ratio: float) -> None:
    """Each side's clock runs from its own submit, so the longer half of a split is handed over first: at
    20x always the host's gate/up; at 12x against a 30x link the down matrix's transfer for a token or two,
    the host's gate/up for more (its share grows with the tokens, the link's does not)."""
    from services.engine.offload.host_executor import HostExecutor
    from services.engine.offload.transfer_engine import TransferEngine

    order: list[tuple[str, int]] = []
    submit_job, submit_transfer = HostExecutor.submit, TransferEngine.submit

    def job(self, weights, x, activation=False, share=1.0, sink=None):
        if activation:
            order.append(("host", x.shape[0]))
        return submit_job(self, weights, x, activation, share, sink)

    def transfer(self, t):
        if t.chunk_offset == 1:  # a split expert's down matrix
            order.append(("down", 0))
        return submit_transfer(self, t)

    monkeypatch.setattr(HostExecutor, "submit", job)
    monkeypatch.setattr(TransferEngine, "submit", transfer)
    tokens, expected, provider, _ = run_policy(reference, "hintserve", expert_cache_fraction=0.25, link_ratio=30.0,
                                               host_ratio=host_ratio)
    assert tokens == expected
    assert provider.stats.host_split_experts > 0
    part, costs = provider.split_prices, provider.costs
    for pair in (order[i : i + 2] for i in range(0, len(order), 2)):
        (kind, _), n = pair[0], max(n for _, n in pair)
        assert {k for k, _ in pair} == {"host", "down"}
        assert kind == ("host" if part.host * costs.host(n) >= part.link * costs.link else "down")


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_a_split_bf16_expert_computes_what_the_whole_one_does(rows: int) -> None:
    """A split expert's down half runs the kernels' projection of its fp32 activation, as the whole expert does
    (torch's bf16 linear rounded the activation to bf16: the grid's bf16 batch-16 hintserve row changed tokens)."""
    from services.engine import cpu_kernels
    from services.engine.cpu_threads import intra_op_threads
    from services.engine.expert_provider import ExpertWeights
    from services.engine.models.moe import expert_activation, expert_down, expert_forward

    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(256, 128, generator=g) / 12).to(torch.bfloat16)
    down = (torch.randn(128, 128, generator=g) / 12).to(torch.bfloat16)
    x = torch.randn(rows, 128, generator=g)
    with intra_op_threads(1):  # the engine core's setting, under which its CPU experts run the kernels
        if not cpu_kernels.usable(x):
            pytest.skip("no native CPU kernels here")
        whole = expert_forward(x, ExpertWeights(gate_up, down))
        assert torch.equal(expert_down(expert_activation(x, gate_up), down, torch.float32), whole)
