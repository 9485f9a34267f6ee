"""A routing trace as the engine would have run it: steps of a continuous batch, each as a StepContext.

The schedule mirrors the engine's scheduler (services/engine/scheduler.py): up to `batch` requests run at
once, first come first served; new requests' prefills go in a step of their own, then every running request
decodes one token per step. Each step's StepContext is filled layer by layer from the trace with what the
engine's router would have written (probabilities, selected experts, MoE-block inputs when recorded).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from services.common.iteration_context import IterationContext
from services.engine.offload.routing_trace import RoutingTrace
from services.engine.step_context import Phase, StepContext
from services.predictor.traces import TraceSet
from services.simulator.hardware import StepShape
from services.simulator.model_specs import MoEModelSpec


@dataclass
class SimStep:
    index: int
    phase: Phase
    iterations: list[IterationContext]  # one per request, in batch order
    contexts: list[int]  # per request: KV positions before this step
    admitted: list[str] = field(default_factory=list)  # requests that joined the batch at this step

    @property
    def tokens(self) -> int:
        return sum(it.num_tokens for it in self.iterations)

    @property
    def shape(self) -> StepShape:
        kv = attended = 0
        for it, before in zip(self.iterations, self.contexts):
            n = it.num_tokens
            kv += before + n
            attended += n * before + n * (n + 1) // 2
        return StepShape(self.tokens, len(self.iterations), kv, attended)


class Workload:
    def __init__(self, trace: TraceSet, spec: MoEModelSpec, batch: int = 1, prompt_tokens: int = 128) -> None:
        check_trace_fits(trace, spec)
        self.trace = trace
        self.spec = spec
        self.batch = batch
        self.prompt_tokens = prompt_tokens  # assumed prompt length of requests the trace holds no prefill for
        self.steps = schedule(trace, batch, prompt_tokens)
        self.has_prefill = any(s.phase is Phase.PREFILL for s in self.steps)
        self.decode_tokens = sum(len(s.iterations) for s in self.steps if s.phase is Phase.DECODE)
        self.has_layer_inputs = trace.has_layer_inputs
        self._moe_layers = [i for i, moe in enumerate(spec.moe_layers) if moe]
        # model layer -> the trace's column for it
        self._position = {layer: pos for pos, layer in enumerate(self._moe_layers)}

    @property
    def has_token_routing(self) -> bool:
        """Per-token expert choices for every multi-token iteration (prefills), not just per-expert counts."""
        return all(
            getattr(it, "token_experts", None) is not None or it.num_tokens == 1
            for s in self.steps
            for it in s.iterations
        )

    def routing_trace(self) -> RoutingTrace:
        """What the engine's recorder would write for this run: per step and layer, the experts used."""
        steps = []
        for step in self.steps:
            per_layer: list[list[int]] = [[] for _ in range(self.spec.num_layers)]
            for pos, layer in enumerate(self._moe_layers):
                used = set().union(*(np.flatnonzero(it.counts[pos] > 0).tolist() for it in step.iterations))
                per_layer[layer] = sorted(used)
            steps.append(per_layer)
        return RoutingTrace(self.spec.num_layers, steps)

    def context(self, step: SimStep) -> StepContext:
        its = step.iterations
        ctx = StepContext(
            phase=step.phase,
            request_ids=[it.request_id for it in its],
            num_tokens=step.tokens,
            step_index=step.index,
            seq_lens=[it.num_tokens for it in its],
            iterations=[it.iteration for it in its],
        )
        if all(it.embedding.size for it in its):
            ctx.embeddings = _per_token(its, [it.embedding for it in its])
        return ctx

    def route(self, step: SimStep, layer: int, ctx: StepContext) -> dict[int, int]:
        """Writes `layer`'s routing into ctx as the router would; returns tokens per selected expert."""
        pos = self._position[layer]
        its = step.iterations
        ctx.router_probs[layer] = _per_token(its, [it.probs[pos] for it in its])
        ctx.selected_experts[layer] = torch.cat([_token_choices(it, pos, self.spec.top_k) for it in its])
        if self.has_layer_inputs:
            inputs = [it.layer_inputs[:, pos] for it in its]  # type: ignore[attr-defined]  # traces.py attaches it
            ctx.layer_inputs[layer] = torch.cat([torch.from_numpy(x.astype(np.float32)) for x in inputs])
        counts = sum(it.counts[pos] for it in its)
        return {int(e): int(counts[e]) for e in np.flatnonzero(counts > 0)}


def check_trace_fits(trace: TraceSet, spec: MoEModelSpec) -> None:
    moe = [i for i, m in enumerate(spec.moe_layers) if m]
    if (trace.num_experts, trace.top_k) != (spec.num_experts, spec.top_k):
        raise ValueError(
            f"trace routes top-{trace.top_k} of {trace.num_experts} experts; model spec {spec.name} "
            f"has top-{spec.top_k} of {spec.num_experts}"
        )
    if list(trace.layer_ids or range(trace.num_layers)) != moe:
        raise ValueError(
            f"trace covers layers {trace.layer_ids} but {spec.name} has MoE layers {moe[0]}-{moe[-1]} "
            f"({len(moe)}); the simulator needs every MoE layer's routing (partial traces: "
            "hintserve predictor eval)"
        )


def schedule(trace: TraceSet, batch: int, prompt_tokens: int) -> list[SimStep]:
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    waiting = deque(r for r in trace.requests if r.iterations)
    running: list[list] = []  # [request, next iteration index, KV positions so far]
    steps: list[SimStep] = []
    while waiting or running:
        admitted = []
        while waiting and len(running) < batch:
            request = waiting.popleft()
            starts_with_prefill = request.iterations[0].iteration == 0
            running.append([request, 0, 0 if starts_with_prefill else prompt_tokens])
            admitted.append(request.request_id)
        prefills = [r for r in running if r[0].iterations[r[1]].iteration == 0]
        batch_now = prefills or running
        phase = Phase.PREFILL if prefills else Phase.DECODE
        steps.append(
            SimStep(
                len(steps),
                phase,
                [r[0].iterations[r[1]] for r in batch_now],
                [r[2] for r in batch_now],
                admitted,
            )
        )
        for r in batch_now:
            r[2] += r[0].iterations[r[1]].num_tokens
            r[1] += 1
        running = [r for r in running if r[1] < len(r[0].iterations)]
    return steps


def _per_token(its: list[IterationContext], rows: list[np.ndarray]) -> torch.Tensor:
    """One row per token: each request's (token-mean) row repeated over its tokens."""
    return torch.cat(
        [
            torch.from_numpy(np.asarray(row, np.float32)).expand(it.num_tokens, -1)
            for it, row in zip(its, rows)
        ]
    )


def _token_choices(it: IterationContext, pos: int, top_k: int) -> torch.Tensor:
    """[tokens, top_k] expert ids: recorded per token when the trace has them; else laid out from the counts
    (exact for one-token iterations; for a prefill the per-expert counts are right, the pairing is not)."""
    recorded = getattr(it, "token_experts", None)
    if recorded is not None:
        return torch.from_numpy(recorded[:, pos].astype(np.int64))
    counts = it.counts[pos].astype(np.int64)
    flat = np.repeat(np.arange(len(counts)), counts)
    if flat.size != it.num_tokens * top_k:
        raise ValueError(
            f"{it.request_id} iteration {it.iteration}: {flat.size} expert choices at layer {pos}, "
            f"expected {it.num_tokens} tokens x top-{top_k}"
        )
    return torch.from_numpy(flat.reshape(top_k, it.num_tokens).T.copy())
