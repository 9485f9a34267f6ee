"""Split experts: one miss computed by both sides at once.

The host runs the expert's gate/up half where its weights live (two thirds of the bytes) while the down
matrix (the other third) crosses the link; the device applies down to the host's activation. A miss then
costs max(2/3 of the host's time, 1/3 of the link's) instead of all of one side's: on an A5000 + DDR4
Mixtral that is 6.1 ms against 9.2 on the host or 14.1 over the link. The ops are the expert's own
(models/moe.py: expert_activation, expert_down), so outputs do not change. Dense experts only: a packed
expert's fused kernel does not split.
"""

from __future__ import annotations

import math

import torch

from services.engine.expert_format import ExpertLayout
from services.engine.offload.cost_model import PlacementCosts
from services.engine.offload.placement import CostPlacement, SplitPrices
from services.engine.quant.layout import StoredLayout
from services.engine.step_context import Phase, StepContext


def split_prices(chunk_bytes: tuple[int, ...], dense: bool) -> SplitPrices | None:
    """Each side's share of a split expert, by bytes (all memory-bound at decode): None if it cannot split."""
    if not dense or len(chunk_bytes) != 2:
        return None
    gate_up, down = chunk_bytes
    return SplitPrices(host=gate_up / (gate_up + down), link=down / (gate_up + down), device=down / (gate_up + down))


def split_pays(
    split: SplitPrices | None, costs: PlacementCosts, max_tokens: int, top_k: int, num_experts: int,
    moe_layers: int = 1, slots: int | None = None,
) -> bool:
    """Whether splitting is worth the cache slots its staging takes: the cost placement must split some decode
    step's miss (a layer missing 1 to top_k x `max_tokens` of its experts, at most all of them, 1 or
    `max_tokens` tokens each, both sides idle as the layer starts; at ratio 100 and batch 1 the down matrix
    alone takes 1.7 ms here, two whole experts on the host 1.6, so none splits), and, given the `slots` of the
    budget (None: not weighed), a step of `max_tokens` sequences must save more by its splits than the staging's
    slots would by holding experts. Both from the placement's own prices, on routing spread evenly over the
    `moe_layers` x `num_experts` experts. On an emulated one-DRAM host the second weighs most: its math alone
    draws the whole DRAM, so a split gains only where a few tokens make the host compute-bound, while a slot
    saves a miss in every step that routes to its expert (demo model, bf16, batch 4 and 16, 10-50% cache: 2-7%
    faster without the staging in 8 of 9 cells). Prefill is not counted: one step a request."""
    if split is None or (slots is not None and slots >= moe_layers * num_experts):
        return False  # a budget for every expert misses nothing, so it has nothing to split
    placement = CostPlacement(costs, stream_prefill=False, split=split)
    decode = StepContext(Phase.DECODE, [], 0)
    splits = any(
        placement.place(list(range(misses)), dict.fromkeys(range(misses), tokens), decode, 0.0,
                        split_room=misses).split
        for misses in range(1, min(top_k * max_tokens, num_experts) + 1) for tokens in {1, max_tokens}
    )
    if not splits or slots is None:
        return splits
    routed = 1.0 - (1.0 - top_k / num_experts) ** max_tokens  # an expert's chance to be routed in a step
    tokens = max(1, round(max_tokens * top_k / num_experts / routed))  # its tokens when it is
    experts = moe_layers * num_experts
    buffers = staging_buffers(top_k, split)
    kept = max(0, slots - staging_slots(buffers, split))
    misses = dict.fromkeys(range(max(1, round(num_experts * routed * (1.0 - min(1.0, kept / experts))))), tokens)
    whole = placement.place(list(misses), misses, decode, 0.0)
    parted = placement.place(list(misses), misses, decode, 0.0, split_room=buffers)
    saved = moe_layers * (placement.layer_seconds(whole, misses) - placement.layer_seconds(parted, misses))
    per_hit = min(costs.host(tokens), costs.link + costs.device(tokens)) - costs.device(tokens)
    return saved > routed * (min(slots, experts) - min(kept, experts)) * per_hit  # the hits the slots would give


def staging_buffers(top_k: int, split: SplitPrices | None) -> int:
    """Down-matrix buffers for one layer's split experts: top-k (what one token splits), rounded up to as
    many as the whole cache slots they cost hold, since a batch splits more experts a layer."""
    if split is None:
        return 0
    return max(top_k, int(staging_slots(top_k, split) / split.link + 1e-9))


def staging_slots(buffers: int, split: SplitPrices) -> int:
    """Cache slots `buffers` down matrices take out of the budget."""
    return math.ceil(buffers * split.link - 1e-9)


def layout_split_prices(layout: StoredLayout) -> SplitPrices | None:
    """The engine's: the dense layout splits, a packed one (quant/layout.py) does not."""
    down = layout.numel - layout.gate_up_numel
    return split_prices((layout.gate_up_numel, down), type(layout) is ExpertLayout)


class DownStaging:
    """Device buffers for the down matrices of a layer's split experts, reused layer after layer (as many as
    `staging_buffers` gives), so the budget gives up little; the placement splits no more than are free."""

    def __init__(self, layout: ExpertLayout, device: torch.device | str, capacity: int) -> None:
        self.shape = layout.down_shape
        numel = layout.numel - layout.gate_up_numel
        self.buffers = [torch.empty(numel, dtype=layout.dtype, device=device) for _ in range(capacity)]
        self.fences: list[torch.cuda.Event | None] = [None] * capacity  # CUDA: compute done reading the buffer
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError(f"more split experts in one layer than {len(self.buffers)} staging buffers")
        return self._free.pop()

    def release(self, index: int, fence: torch.cuda.Event | None) -> None:
        self.fences[index] = fence
        self._free.append(index)

    def down(self, index: int) -> torch.Tensor:
        return self.buffers[index].view(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)
