"""KV-cache blocks: a free list, per-sequence block tables, admission only when blocks are available.

Prefix caching (`--enable-prefix-caching`, vLLM's automatic prefix caching): a full block whose keys and
values are computed is registered under a key for its whole prefix (a hash chain over the block's tokens and
every block before it). A new sequence whose prompt starts with registered blocks shares them (reference
counts) and prefills from the first block it lacks, as a chunked prefill does after its earlier chunks. A
block nobody holds stays registered in the free list until it is taken for new tokens, least recently freed
first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from services.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # least recently freed first
        self._refs = [0] * num_blocks
        self._block_of: dict[bytes, int] = {}  # prefix key of a registered block -> the block
        self._key_of: dict[int, bytes] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found (their prefill skipped)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_registered(self) -> int:
        return len(self._block_of)

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._hits(seq)
        idle = sum(1 for block in hits if self._refs[block] == 0)  # in the free list, taken by this sequence
        return seq.num_blocks_needed - len(hits) <= len(self._free) - idle

    def allocate(self, seq: Sequence) -> None:
        """Blocks for every token the sequence holds now (its prefill); those its prefix shares with registered
        blocks are reused and count as cached tokens."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        hits = self._hits(seq)
        for block in hits:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        seq.block_table = hits + [self._take() for _ in range(seq.num_blocks_needed - len(hits))]
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        if self.prefix_caching:
            self.prefix_queries += len(seq)
            self.prefix_hits += seq.num_cached_tokens

    def can_append(self, seq: Sequence) -> bool:
        """Room for the sequence's newest token: a new block only when it starts one."""
        return len(seq.block_table) >= seq.num_blocks_needed or len(self._free) >= 1

    def append_slot(self, seq: Sequence) -> None:
        """Ensure the block for the token at position len(seq) - 1 exists (called before a decode step)."""
        if len(seq.block_table) < seq.num_blocks_needed:
            seq.block_table.append(self._take())

    def register_computed(self, seq: Sequence) -> None:
        """Registers the sequence's full blocks whose keys and values are in the cache (prefix caching)."""
        if not self.prefix_caching:
            return
        full = seq.num_cached_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        keys = self._prefix_keys(seq, full)
        for i in range(seq.num_registered_blocks, full):
            block = seq.block_table[i]
            if keys[i] not in self._block_of and block not in self._key_of:  # first computed copy wins
                self._block_of[keys[i]] = block
                self._key_of[block] = keys[i]
        seq.num_registered_blocks = full

    def free(self, seq: Sequence) -> None:
        """Releases the sequence's blocks (its computed full blocks registered first); the last ones go to the
        free list first, so a prefix outlives its tails."""
        self.register_computed(seq)
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_registered_blocks = 0

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """KV-cache slots of positions start..end-1, a range per block (a mixed step's one-token rows bring
        their whole contexts here: no Python division per position)."""
        bs = self.block_size
        out: list[int] = []
        for b in range(start // bs, -(-end // bs)):
            base = seq.block_table[b] * bs
            out.extend(range(base + max(start - b * bs, 0), base + min(end - b * bs, bs)))
        return out

    def _take(self) -> int:
        """The least recently freed block, unregistered if it was."""
        block, _ = self._free.popitem(last=False)
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
        self._refs[block] = 1
        return block

    def _hits(self, seq: Sequence) -> list[int]:
        """Registered blocks the sequence's tokens start with; never all of them (the last token is computed,
        for its logits)."""
        if not self.prefix_caching or not self._block_of:
            return []
        hits = []
        for key in self._prefix_keys(seq, len(seq) // self.block_size):
            block = self._block_of.get(key)
            if block is None:
                break
            hits.append(block)
        if hits and len(hits) * self.block_size == len(seq):
            hits.pop()
        return hits

    def _prefix_keys(self, seq: Sequence, count: int) -> list[bytes]:
        """Keys of the sequence's first `count` full blocks: each hashes its tokens and the key before it."""
        keys, bs = seq.block_keys, self.block_size
        key = keys[-1] if keys else b""
        for i in range(len(keys), count):
            key = hashlib.blake2b(key + array("q", seq.token_ids[i * bs : (i + 1) * bs]).tobytes(),
                                  digest_size=16).digest()
            keys.append(key)
        return keys[:count]
