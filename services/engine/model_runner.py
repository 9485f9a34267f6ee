"""Prepares a batch's tensors, runs the model and samples one token per sequence."""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.engine.block_manager import BlockManager
from services.engine.models.attention import AttentionMetadata
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
    ) -> None:
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
        model.allocate_kv_cache(block_manager.num_blocks * block_manager.block_size)

    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        if is_prefill:
            input_ids, positions, meta, last = self._prepare_prefill(seqs)
        else:
            input_ids, positions, meta, last = self._prepare_decode(seqs)
        ctx = StepContext(
            phase=Phase.PREFILL if is_prefill else Phase.DECODE,
            request_ids=[s.request_id for s in seqs],
            num_tokens=int(input_ids.shape[0]),
            step_index=self.num_steps,
            seq_lens=meta.seq_lens,
            iterations=[s.num_completion_tokens for s in seqs],
            layer_observers=self.layer_observers,
        )
        self.num_steps += 1
        # A prefill's last layer may skip the rows nobody reads when nothing records the step's full routing.
        hidden = self.model.forward(input_ids, positions, meta, ctx, output_rows=last, prune=not self.step_observers)
        for observe in self.step_observers:
            observe(ctx)
        logits = self.model.compute_logits(hidden)
        for seq in seqs:
            seq.num_cached_tokens = len(seq)
        return sample(logits.cpu(), seqs, self.eos_ids, self.generator)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _prepare_prefill(self, seqs: list[Sequence]):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        last: list[int] = []
        bm = self.block_manager
        for seq in seqs:
            n = len(seq)
            input_ids.extend(seq.token_ids)
            positions.extend(range(n))
            slots.extend(bm.slot(seq, p) for p in range(n))
            seq_lens.append(n)
            last.append(len(input_ids) - 1)
        meta = AttentionMetadata(is_prefill=True, slot_mapping=self._tensor(slots), seq_lens=seq_lens)
        return self._tensor(input_ids), self._tensor(positions), meta, self._tensor(last)

    def _prepare_decode(self, seqs: list[Sequence]):
        bs = self.block_manager.block_size
        positions = [len(s) - 1 for s in seqs]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = self._tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs])
        offsets = torch.arange(max_blocks * bs, device=self.device)
        context_slots = (tables[:, :, None] * bs + offsets[:bs]).view(len(seqs), -1)
        position_tensor = self._tensor(positions)
        mask = (offsets[None, :] <= position_tensor[:, None])[:, None, None, :]
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self._tensor(slots),
            seq_lens=[1] * len(seqs),
            block_tables=tables,
            block_size=bs,
            context_slots=context_slots,
            context_mask=mask,
            context_lens=position_tensor + 1,
        )
        input_ids = self._tensor([s.last_token_id for s in seqs])
        return input_ids, position_tensor, meta, None
