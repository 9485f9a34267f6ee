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

from services.engine.offload.host_store import ExpertLayout
from services.engine.offload.placement import SplitPrices


def split_prices(chunk_bytes: tuple[int, ...], dense: bool) -> SplitPrices | None:
    """Each side's share of a split expert, by bytes (all memory-bound at decode): None if it cannot split."""
    if not dense or len(chunk_bytes) != 2:
        return None
    gate_up, down = chunk_bytes
    return SplitPrices(host=gate_up / (gate_up + down), link=down / (gate_up + down), device=down / (gate_up + down))


def staging_buffers(top_k: int, split: SplitPrices | None) -> int:
    """Down-matrix buffers for one layer's split experts: top-k (what one token splits), rounded up to as
    many as the whole cache slots they cost hold, since a batch splits more experts a layer."""
    if split is None:
        return 0
    return max(top_k, int(staging_slots(top_k, split) / split.link + 1e-9))


def staging_slots(buffers: int, split: SplitPrices) -> int:
    """Cache slots `buffers` down matrices take out of the budget."""
    return math.ceil(buffers * split.link - 1e-9)


def layout_split_prices(layout: ExpertLayout) -> SplitPrices | None:
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
        self.fences: list[object | None] = [None] * capacity  # CUDA: compute done reading the buffer
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError(f"more split experts in one layer than {len(self.buffers)} staging buffers")
        return self._free.pop()

    def release(self, index: int, fence: object | None) -> None:
        self.fences[index] = fence
        self._free.append(index)

    def down(self, index: int) -> torch.Tensor:
        return self.buffers[index].view(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)
