"""Records routing traces from our engine: a model runner step observer (`hintserve trace collect`)."""

from __future__ import annotations

import numpy as np
import torch

from services.common.iteration_context import RequestTrace, TracedIteration
from services.engine.step_context import StepContext
from services.engine.step_records import step_records


class TraceRecorder:
    """Engine step observer: one TracedIteration per (request, iteration) from each step's context."""

    def __init__(self, num_experts: int, keep_layer_inputs: bool = False) -> None:
        self.num_experts = num_experts
        self.keep_layer_inputs = keep_layer_inputs
        self.iterations: dict[str, dict[int, TracedIteration]] = {}
        self.layer_ids: list[int] = []

    def __call__(self, ctx: StepContext) -> None:
        rec = step_records(ctx)
        self.layer_ids = rec.layers
        selected = inputs = None
        if self.keep_layer_inputs:
            selected = torch.stack([ctx.selected_experts[lay] for lay in rec.layers], 1).cpu().numpy()  # [T, L, k]
            inputs = torch.stack([ctx.layer_inputs[lay] for lay in rec.layers], 1).to(torch.float16).cpu().numpy()
        for i, (rid, iteration) in enumerate(zip(ctx.request_ids, ctx.iterations)):
            n = int(rec.num_tokens[i])
            it = TracedIteration(rid, int(iteration), rec.probs[i], rec.counts[i], rec.embeddings[i], num_tokens=n)
            if inputs is not None:
                s = slice(rec.token_offsets[i], rec.token_offsets[i + 1])
                it.layer_inputs = inputs[s]
                it.token_experts = selected[s].astype(np.uint8)
            # A preempted request recomputes its prefix: the later record of an iteration replaces the earlier;
            # a chunked prefill's later chunks (after cached tokens) add to it.
            records = self.iterations.setdefault(rid, {})
            earlier = records.get(int(iteration))
            chunk = bool(ctx.cached_lens) and ctx.cached_lens[i] > 0
            records[int(iteration)] = merge_chunks(earlier, it) if chunk and earlier is not None else it

    def requests(self, order: list[str]) -> list[RequestTrace]:
        out = []
        for rid in order:
            its = self.iterations.get(rid, {})
            out.append(RequestTrace(rid, [its[i] for i in sorted(its)], "engine"))
        return out


def merge_chunks(first: TracedIteration, then: TracedIteration) -> TracedIteration:
    """One iteration from two chunks of its tokens: counts add, token means weigh by each chunk's tokens."""
    n, m = first.num_tokens, then.num_tokens
    out = TracedIteration(
        first.request_id, first.iteration, (first.probs * n + then.probs * m) / (n + m), first.counts + then.counts,
        (first.embedding * n + then.embedding * m) / (n + m), num_tokens=n + m,
    )
    if first.layer_inputs is not None and then.layer_inputs is not None:
        out.layer_inputs = np.concatenate([first.layer_inputs, then.layer_inputs])
    if first.token_experts is not None and then.token_experts is not None:
        out.token_experts = np.concatenate([first.token_experts, then.token_experts])
    return out
