"""KV-cache blocks: a free list, per-sequence block tables, admission only when blocks are available."""

from __future__ import annotations

from collections import deque

from services.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, seq: Sequence) -> bool:
        return seq.num_blocks_needed <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Blocks for every token the sequence holds now (its prefill)."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        seq.block_table = [self._free.popleft() for _ in range(seq.num_blocks_needed)]

    def can_append(self, seq: Sequence) -> bool:
        """Room for the sequence's newest token: a new block only when it starts one."""
        return len(seq.block_table) >= seq.num_blocks_needed or len(self._free) >= 1

    def append_slot(self, seq: Sequence) -> None:
        """Ensure the block for the token at position len(seq) - 1 exists (called before a decode step)."""
        if len(seq.block_table) < seq.num_blocks_needed:
            seq.block_table.append(self._free.popleft())

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
