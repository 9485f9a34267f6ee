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
    split: SplitPrices | None, costs: PlacementCosts, max_tokens: int, top_k: int, num_experts: int
) -> bool:
    """Whether the cost placement would ever split a decode step's miss: a layer missing 1 to top_k x
    `max_tokens` of its experts (at most all of them), 1 or `max_tokens` tokens each (one a sequence), both
    sides idle as the layer starts. Where it would not (a slow link and few misses a layer: at ratio 100
    and batch 1 the down matrix alone takes 1.7 ms here, two whole experts on the host 1.6), the staging's
    cache slot is worth more holding an expert: 4.15 against 3.82 ms a token with the slot back. A busy
    host makes splits pay at a fast one (a quad-channel Mixtral host: the second miss of a token splits).
    Prefill is not counted: one step a request, against every decode step's slot."""
    if split is None:
        return False
    placement = CostPlacement(costs, stream_prefill=False, split=split)
    decode = StepContext(Phase.DECODE, [], 0)
    for misses in range(1, min(top_k * max_tokens, num_experts) + 1):
        for tokens in {1, max_tokens}:
            placed = placement.place(list(range(misses)), dict.fromkeys(range(misses), tokens), decode, 0.0,
                                     split_room=misses)
            if placed.split:
                return True
    return False


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
