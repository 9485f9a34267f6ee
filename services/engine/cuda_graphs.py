"""CUDA graphs for decode steps: the forward pass and logits captured once per (batch, context) bucket and
replayed, so a decode step is one launch instead of one per op (what vLLM does unless --enforce-eager).

A step is padded up to its buckets: extra rows decode token 0 at position 0 into a scratch KV slot that no
sequence owns (the model runner allocates one block more than the block manager hands out), and table
columns past a sequence's blocks are masked as in eager steps. Capture needs a forward pass that never reads
a tensor back to the host: resident experts on the fused path (`torch._grouped_mm`) and no observers, whose
Python callbacks would run once, at capture. Everything else (prefill, the CPU, offload providers, observed
steps, batches or contexts past the largest bucket) runs eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.engine.models.attention import decode_metadata
from services.engine.models.model import MoECausalLM
from services.engine.step_context import Phase, StepContext

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # torch's own name for a graph memory pool's handle

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def buckets_up_to(limit: int, steps: tuple[int, ...] | None = None) -> list[int]:
    """Bucket sizes below `limit`, then `limit` itself (powers of two when no steps are given)."""
    if steps is None:
        steps = tuple(1 << i for i in range(limit.bit_length()))
    return [s for s in steps if s < limit] + [limit]


def graphs_supported(model: MoECausalLM) -> bool:
    """A CUDA model whose decode forward has no host reads: every MoE layer's experts stacked (resident)."""
    device = model.w.embed.device
    return device.type == "cuda" and all(
        model.experts.stacked_experts(i) is not None for i, moe in enumerate(model.spec.moe_layers) if moe)


class DecodeGraphs:
    def __init__(self, model: MoECausalLM, max_seqs: int, max_blocks: int, block_size: int, scratch_slot: int):
        device = model.w.embed.device
        self.model = model
        self.block_size = block_size
        self.batch_sizes = buckets_up_to(max_seqs, BATCH_BUCKETS)
        self.block_counts = buckets_up_to(max_blocks)
        # Static inputs: replays read these, so a step copies its own values in first.
        self.input_ids = torch.zeros(max_seqs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_seqs, dtype=torch.long, device=device)
        self.slots = torch.full((max_seqs,), scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.zeros(max_seqs, max_blocks, dtype=torch.long, device=device)
        self.scratch_slot = scratch_slot
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: _POOL_HANDLE | None = None  # the first (largest) graph's memory, shared by the rest

    def capture(self) -> None:
        """Every bucket pair, largest first so the smaller graphs reuse its memory pool."""
        for blocks in reversed(self.block_counts):
            for batch in reversed(self.batch_sizes):
                self.graphs[(batch, blocks)] = self._capture(batch, blocks)

    def _capture(self, batch: int, blocks: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The one CUDA-only step: a graph of `_forward` for these buckets, and its static logits."""
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):  # lazy initialisation (cuBLAS handles, workspaces) stays out of the graph
            self._forward(batch, blocks)
        torch.cuda.current_stream().wait_stream(warm)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(batch, blocks)
        self._pool = graph.pool()
        torch.cuda.synchronize()
        return graph, logits

    def _forward(self, batch: int, blocks: int) -> torch.Tensor:
        meta = decode_metadata(self.positions[:batch], self.slots[:batch], self.tables[:batch, :blocks],
                               self.block_size)
        ctx = StepContext(Phase.DECODE, [""] * batch, batch)
        hidden = self.model.forward(self.input_ids[:batch], self.positions[:batch], meta, ctx)
        return self.model.compute_logits(hidden)

    def fits(self, batch: int, blocks: int) -> bool:
        return batch <= self.batch_sizes[-1] and blocks <= self.block_counts[-1]

    def replay(self, input_ids: list[int], positions: list[int], slots: list[int],
               tables: list[list[int]]) -> torch.Tensor:
        """One decode step's logits [batch, vocab] from the smallest graph that holds it."""
        batch, blocks = len(input_ids), max(len(t) for t in tables)
        size = next(b for b in self.batch_sizes if b >= batch)
        width = next(w for w in self.block_counts if w >= blocks)
        graph, logits = self.graphs[(size, width)]
        pad = size - batch
        padded = [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad
        self.input_ids[:size].copy_(torch.tensor(input_ids + [0] * pad))
        self.positions[:size].copy_(torch.tensor(positions + [0] * pad))
        self.slots[:size].copy_(torch.tensor(slots + [self.scratch_slot] * pad))
        self.tables[:size, :width].copy_(torch.tensor(padded))
        graph.replay()
        return logits[:batch]
