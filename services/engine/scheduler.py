"""Continuous batching: waiting and running queues, one batch per step (nano-vllm style).

Chunked prefill: a step computes at most max_num_batched_tokens prompt tokens. A prompt longer than what is
left of that budget prefills a chunk, keeps its KV blocks and stays at the head of the queue; it joins the
running sequences once its last chunk samples its first token.

Mixed steps: a step that prefills also carries each running sequence's next token, as a one-token chunk
after its cached context (vLLM's chunked prefill does the same). So a long prompt delays the others' next
token by one chunk's step, not by its whole prefill, and the weights (experts: from host memory or over
the link) are read once for both. A step with no prompt to start is a plain decode step. With a chunk sizer
(--itl-target-ms, chunk_sizer.py) a mixed step's prompt tokens are sized so the step takes about the target.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from services.engine.block_manager import BlockManager
from services.engine.chunk_sizer import ChunkSizer
from services.engine.sequence import Sequence, SequenceStatus


class Batch(NamedTuple):
    """A step's sequences; a prefill step's first num_decodes are running sequences' one-token rows."""

    seqs: list[Sequence]
    is_prefill: bool
    num_decodes: int = 0


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, block_manager: BlockManager,
                 chunk_sizer: ChunkSizer | None = None) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = block_manager
        self.chunk_sizer = chunk_sizer
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        """The next batch and whether it runs as a prefill step: the running sequences' next tokens first (their
        slots taken before any new prompt's blocks, so a newcomer never preempts them), then what prompts the
        budget admits (module docstring). Each sequence's num_scheduled_tokens says how many of its uncached
        tokens the step computes: one for a running sequence."""
        decodes = self._schedule_decode()
        sizer = self.chunk_sizer
        prefills = self._schedule_prefill(sizer.budget() if sizer and decodes else self.max_num_batched_tokens)
        if not prefills:
            return Batch(decodes, False)
        for seq in decodes:
            seq.num_scheduled_tokens = 1
        self.running.extend(s for s in prefills if not self.is_partial(s))
        return Batch(decodes + prefills, True, len(decodes))

    def _schedule_prefill(self, budget: int) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) + len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:  # a new (or preempted) sequence: blocks for its whole prompt up front
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
            seq.num_scheduled_tokens = min(seq.num_uncached_tokens, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if self.is_partial(seq):
                break  # it stays at the head, holding its blocks, for the next prefill step
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
        return scheduled

    @staticmethod
    def is_partial(seq: Sequence) -> bool:
        """Whether the scheduled prefill chunk leaves prompt tokens for a later step."""
        return seq.num_scheduled_tokens < seq.num_uncached_tokens

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.append_slot(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        """Frees the sequence's blocks; it is recomputed from its tokens when blocks free up. It queues behind
        a prompt halfway through its prefill, which holds blocks for the rest and must finish first."""
        self.num_preemptions += 1
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.insert(1 if self.waiting and self.waiting[0].block_table else 0, seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        for queue in (self.running, self.waiting):  # waiting: a prompt whose prefill chunk failed
            if seq in queue:
                queue.remove(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = "abort"
                    self.block_manager.free(seq)
                    return seq
        return None
