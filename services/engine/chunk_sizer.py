"""Prefill chunks sized to an inter-token latency target (Sarathi-Serve's stall-free batching, from measured steps).

A step that prefills also carries every running sequence's next token (scheduler.py), so a chunk of C prompt
tokens holds those streams for the whole step. On a CPU a 1,500-token chunk of a Qwen3-30B-A3B-shape model (4
layers, int4, one thread) took 2.6 s: the streams' P99 inter-token latency was that step. With a target, a
mixed step takes as many prompt tokens as fit in it at the measured cost per prompt token; a step with no one
waiting on a next token keeps the whole budget (max_num_batched_tokens), the fastest way through a prompt.

The cost per token is each prefill step's seconds over its prompt tokens, averaged over recent steps: fixed
costs included (a step reads its weights once however few its tokens), so the chunk it implies moves toward
the size whose step takes the target (for a step of F + c * t seconds: t = (target - F) / c), and to the floor
when even a small chunk takes longer than the target. A least-squares fit of F and c over recent steps (decay
0.8) did worse in the same benchmark (p99 678 and 323 ms at targets 500 and 250 against 590 and 283, median
first token 19-20% later): a prompt's later chunks attend over more context, so its steps are not one line.
"""

from __future__ import annotations

FLOOR_TOKENS = 32  # a mixed step's prompt tokens at least: smaller chunks read the weights for too little
SMOOTHING = 0.5  # weight of the newest step in the average cost per prompt token


class ChunkSizer:
    def __init__(self, target_s: float, cap: int) -> None:
        self.target_s = target_s
        self.cap = cap
        self.seconds_per_token: float | None = None  # None until a prefill step has been measured

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """A prefill step's prompt tokens (not the running sequences' rows) and its seconds."""
        if prompt_tokens <= 0 or seconds <= 0:
            return
        cost = seconds / prompt_tokens
        last = self.seconds_per_token
        self.seconds_per_token = cost if last is None else SMOOTHING * cost + (1 - SMOOTHING) * last

    def budget(self) -> int:
        """Prompt tokens for a step that carries running sequences' next tokens."""
        if self.seconds_per_token is None:
            return min(self.cap, FLOOR_TOKENS)  # nothing measured yet: a small first chunk
        return max(min(FLOOR_TOKENS, self.cap), min(self.cap, int(self.target_s / self.seconds_per_token)))
