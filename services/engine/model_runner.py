"""Prepares a batch's tensors, runs the model and samples one token per sequence."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from services.engine.block_manager import BlockManager
from services.engine.cuda_graphs import DecodeGraphs
from services.engine.models.attention import AttentionMetadata, decode_metadata
from services.engine.models.model import MoECausalLM
from services.engine.sampler import sample
from services.engine.sequence import Sequence
from services.engine.step_context import Phase, StepContext


class ModelRunner:
    def __init__(
        self,
        model: MoECausalLM,
        block_manager: BlockManager,
        eos_ids: tuple[int, ...],
        seed: int,
        device: torch.device | str,
        cuda_graphs: bool = False,
    ) -> None:
        """cuda_graphs: keep one KV block out of the block manager's reach as the padded rows' scratch, for
        `capture_graphs`."""
        self.model = model
        self.block_manager = block_manager
        self.eos_ids = eos_ids
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)
        self.num_steps = 0
        # The one way to watch steps (trace recorder, predictor link, tests); observers must only record or
        # enqueue. Step observers get each step's context after the forward pass; layer observers get it
        # mid-step, right after that layer's routing (the predictor link's partial contexts).
        self.step_observers: list[Callable[[StepContext], None]] = []
        self.layer_observers: dict[int, list[Callable[[int, StepContext], None]]] = {}
        self.keep_layer_inputs = False  # every layer's input stays in the step context (trace recording)
        model.allocate_kv_cache((block_manager.num_blocks + cuda_graphs) * block_manager.block_size)
        self.graphs: DecodeGraphs | None = None
        self._graph_scratch = cuda_graphs

    def capture_graphs(self, max_seqs: int, max_blocks: int) -> None:
        """Decode steps replay CUDA graphs from here on (see cuda_graphs); raises if capture fails."""
        if not self._graph_scratch:
            raise ValueError("the runner was built without cuda_graphs (no scratch KV block)")
        bs = self.block_manager.block_size
        graphs = DecodeGraphs(self.model, max_seqs, max_blocks, bs, self.block_manager.num_blocks * bs)
        graphs.capture()
        self.graphs = graphs

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int | None]:
        """One token per sequence, None for a prompt whose prefill chunk leaves the rest for later steps."""
        step = self.num_steps
        self.num_steps += 1  # counted even if the step fails (the isolator may retry it)
        if is_prefill:
            return self._run_prefill(seqs, step)
        logits = self._replay_decode(seqs)
        if logits is None:
            logits = self._forward(seqs, False, step)
        tokens = cast("list[int | None]", sample(logits.cpu(), seqs, self.eos_ids, self.generator))
        for seq in seqs:
            seq.num_cached_tokens = len(seq)
        return tokens

    def _run_prefill(self, seqs: list[Sequence], step: int) -> list[int | None]:
        """Samples only the sequences whose chunk ends their prompt (every sequence's last row is computed)."""
        ends = [_chunk_end(s) for s in seqs]
        logits = self._forward(seqs, True, step)
        sampled = [i for i, (s, end) in enumerate(zip(seqs, ends)) if end == len(s)]
        if len(sampled) < len(seqs):
            logits = logits[sampled]
        tokens = sample(logits.cpu(), [seqs[i] for i in sampled], self.eos_ids, self.generator)
        for seq, end in zip(seqs, ends):  # only now: a step that raised leaves its chunks to rerun
            seq.num_cached_tokens = end
        out: list[int | None] = [None] * len(seqs)
        for i, token in zip(sampled, tokens):
            out[i] = token
        return out

    def _replay_decode(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """A decode step's logits from a CUDA graph; None where the step must run eagerly (no graphs, an
        observer to call, or a batch or context past the largest bucket)."""
        if self.graphs is None or self.step_observers or self.layer_observers:
            return None
        positions, slots, tables = self._decode_lists(seqs)
        if not self.graphs.fits(len(seqs), max(len(t) for t in tables)):
            return None
        return self.graphs.replay([s.last_token_id for s in seqs], positions, slots, tables)

    def _forward(self, seqs: list[Sequence], is_prefill: bool, step: int) -> torch.Tensor:
        """The step's logits, eagerly: one row per sequence."""
        if is_prefill:
            input_ids, positions, meta, last = self._prepare_prefill(seqs)
        else:
            input_ids, positions, meta, last = self._prepare_decode(seqs)
        ctx = StepContext(
            phase=Phase.PREFILL if is_prefill else Phase.DECODE,
            request_ids=[s.request_id for s in seqs],
            num_tokens=int(input_ids.shape[0]),
            step_index=step,
            seq_lens=meta.seq_lens,
            iterations=[s.num_completion_tokens for s in seqs],
            cached_lens=[s.num_cached_tokens for s in seqs] if is_prefill else [],
            layer_observers=self.layer_observers,
            keep_layer_inputs=self.keep_layer_inputs,
        )
        # A prefill's last layer may skip the rows nobody reads when nothing records the step's full routing.
        hidden = self.model.forward(input_ids, positions, meta, ctx, output_rows=last, prune=not self.step_observers)
        for observe in self.step_observers:
            observe(ctx)
        return self.model.compute_logits(hidden)

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _prepare_prefill(self, seqs: list[Sequence]):
        """Each sequence's scheduled chunk of uncached tokens; where a chunk follows cached ones, the slots of
        its whole context too (attention reads those keys and values from the cache). A mixed step's leading
        one-token rows after a cached context (running sequences' next tokens) get the decode layout instead:
        the paged path reads their context in place, not a gathered copy of it."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        last: list[int] = []
        context_slots: list[int] = []
        ends: list[int] = []
        bm = self.block_manager
        n = 0
        while n < len(seqs) - 1 and 0 < seqs[n].num_cached_tokens == len(seqs[n]) - 1:  # its last token
            n += 1
        chunked = any(seq.num_cached_tokens for seq in seqs[n:])
        for row, seq in enumerate(seqs):
            start, end = seq.num_cached_tokens, _chunk_end(seq)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            chunk_slots = bm.slots(seq, start, end)
            slots.extend(chunk_slots)
            seq_lens.append(end - start)
            last.append(len(input_ids) - 1)
            if chunked and row >= n:  # the cached tokens' slots, then the chunk's
                context_slots.extend(bm.slots(seq, 0, start))
                context_slots.extend(chunk_slots)
                ends.append(end)
        meta = AttentionMetadata(is_prefill=True, slot_mapping=self._tensor(slots), seq_lens=seq_lens)
        if chunked:
            meta.prefill_kv_lens = ends
            meta.prefill_kv_slots = self._tensor(context_slots)
        if n:
            meta.decode_rows = self._decode_layout(seqs[:n])[2]
        return self._tensor(input_ids), self._tensor(positions), meta, self._tensor(last)

    def _prepare_decode(self, seqs: list[Sequence]):
        input_ids, positions, meta = self._decode_layout(seqs)
        return input_ids, positions, meta, None

    def _decode_layout(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's token ids, positions, KV slots, context lengths and block tables as views of one tensor:
        one host-to-device copy, not five tensors built apart (each ~15 us, run cold after the forward pass)."""
        positions, slots, tables = self._decode_lists(seqs)
        batch, max_blocks = len(seqs), max(len(t) for t in tables)
        flat = [s.last_token_id for s in seqs] + positions + slots + [p + 1 for p in positions]
        for table in tables:
            flat += table
            flat += [0] * (max_blocks - len(table))
        values = self._tensor(flat)
        input_ids, position_tensor, slot_tensor, context_lens = values[: 4 * batch].view(4, batch)
        block_tables = values[4 * batch :].view(batch, max_blocks)
        meta = decode_metadata(position_tensor, slot_tensor, block_tables, self.block_manager.block_size,
                               context_lens)
        return input_ids, position_tensor, meta

    def _decode_lists(self, seqs: list[Sequence]) -> tuple[list[int], list[int], list[list[int]]]:
        """Each sequence's new position, its KV slot, and its block table."""
        bs = self.block_manager.block_size
        positions = [len(s) - 1 for s in seqs]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
        return positions, slots, [s.block_table for s in seqs]


def _chunk_end(seq: Sequence) -> int:
    """Where the scheduled prefill chunk of `seq` ends (the whole rest when none was set)."""
    n = seq.num_scheduled_tokens
    return len(seq) if n <= 0 else min(len(seq), seq.num_cached_tokens + n)
