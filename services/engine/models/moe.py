"""The MoE layer: grouping of tokens by expert, one matmul pair per active expert, weighted sum."""

from __future__ import annotations

import itertools
from typing import TypeGuard

import torch
import torch.nn.functional as F

from services.engine import cpu_kernels
from services.engine.cpu_kernels import formats, moe_calls
from services.engine.expert_provider import ExpertProvider, ExpertWeights, HostSink, StoredWeights
from services.engine.models.router import Routing
from services.engine.quant.kernels import packed_swiglu
from services.engine.quant.packed import QuantizedExpertWeights
from services.engine.step_context import StepContext


def swiglu_activation(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(swiglu_activation(x, gate_up), down)


# From this many gate/up weights an fp32 expert runs on the kernels' pool (moe_calls.expert): at Qwen3-30B-A3B's
# shape one thread's expert_rows streamed half the two-thread probe, and at 16 rows a third of the tiles' rate.
POOLED_EXPERT_PARAMS = 1 << 20


def expert_forward(x: torch.Tensor, w: ExpertWeights | QuantizedExpertWeights, pool_is_host: bool = False
                   ) -> torch.Tensor:
    """One routed expert on the tokens routed to it: the single entry point every executor calls
    (`pool_is_host`: cpu_kernels.usable's)."""
    if cpu_kernels.usable(x, pool_is_host):
        if _runs_alone(w, x):
            # The kernel the device path's fused add runs (moe_forward), here into rows of its own: torch's
            # two linears and silu cost ~10 us more per call on a small expert (a host job's, offload/host_path.py).
            # It runs on the calling thread alone, untiled: a large expert goes to the pool's tiles below.
            out = torch.empty(x.shape[0], w.down.shape[0])
            cpu_kernels.expert_rows(x, w.gate_up, w.down, out, x.shape[0])
            return out
        call = _pool_call(w)
        if call is not None:
            return moe_calls.run_expert(x, call)
    if isinstance(w, QuantizedExpertWeights):
        return packed_swiglu(x, w.gate_up, w.down)
    return expert_down(expert_activation(x, w.gate_up, pool_is_host), w.down, x.dtype, pool_is_host)


def pooled_expert(x: torch.Tensor, w: ExpertWeights | QuantizedExpertWeights) -> moe_calls.ExpertCall | None:
    """The native call expert_forward computes this expert by on the kernels' pool, for rows like x where the
    kernels are usable (the caller's check), None where it takes another path: what several experts share in
    one call (moe_calls.run_experts) to give each row the same sums."""
    return None if _runs_alone(w, x) else _pool_call(w)


def _runs_alone(w: ExpertWeights | QuantizedExpertWeights, x: torch.Tensor) -> TypeGuard[ExpertWeights]:
    return (native_expert(w) and w.gate_up.numel() < POOLED_EXPERT_PARAMS
            and cpu_kernels.widths_supported(x.shape[1]) and x.is_contiguous())


def _pool_call(w: ExpertWeights | QuantizedExpertWeights) -> moe_calls.ExpertCall | None:
    """Any CPU format's call on the pool, made on first use and kept beside the weights (False: none)."""
    call = w.native
    if call is None:
        call = w.native = moe_calls.expert_call(w.gate_up, w.down) or False
    return call or None


def native_expert(w: ExpertWeights | QuantizedExpertWeights) -> TypeGuard[ExpertWeights]:
    """Whether cpu_kernels.expert_rows computes this expert: fp32 weights in torch's layout, contiguous
    (an expert cache slot's or the host store's views), widths in 16s; the activations are the caller's check."""
    return isinstance(w, ExpertWeights) and _native_matrix(w.gate_up) and _native_matrix(w.down)


def _native_matrix(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.float32 and weight.is_contiguous()
            and cpu_kernels.widths_supported(*weight.shape))


# A split expert (offload/split_experts.py) runs the same two halves on two sides: the activation where
# gate/up lives, the down projection where down was fetched to; the ops are expert_forward's own.
def expert_activation(x: torch.Tensor, gate_up: torch.Tensor, pool_is_host: bool = False) -> torch.Tensor:
    """[tokens, intermediate]: the native kernels' on the CPU, else in the weights' dtype (bf16 experts under
    fp32 activations)."""
    matrix = formats.as_cpu_matrix(gate_up) if cpu_kernels.usable(x, pool_is_host) else None
    if matrix is not None:
        return moe_calls.expert(x, matrix, None)
    return swiglu_activation(x if x.dtype == gate_up.dtype else x.to(gate_up.dtype), gate_up)


def expert_down(h: torch.Tensor, down: torch.Tensor, out_dtype: torch.dtype, pool_is_host: bool = False
                ) -> torch.Tensor:
    """The down projection of a split expert's activation: on the CPU the kernels' own (the whole expert's
    second call, so a split bf16 expert gives its tokens exactly; torch's bf16 linear rounded h to bf16)."""
    matrix = formats.as_cpu_matrix(down) if cpu_kernels.usable(h, pool_is_host) else None
    if matrix is not None:
        y = formats.matmul(h, matrix)
    else:
        y = F.linear(h if h.dtype == down.dtype else h.to(down.dtype), down)  # a native host half gives fp32
    return y if y.dtype == out_dtype else y.to(out_dtype)


def record_routing(layer: int, routing: Routing, ctx: StepContext) -> None:
    """Hands the layer's routing to the step context and its observers (prefetchers, the predictor link)."""
    _, experts, probs = routing
    ctx.router_probs[layer] = probs
    ctx.selected_experts[layer] = experts
    ctx.layer_routed(layer)


def _counts(experts: torch.Tensor, num_experts: int) -> list[int]:
    """Tokens routed to each expert: a decode step's few assignments counted in Python (a bincount and its
    tolist were a fifth of a full-cache offload layer's Python time), a prefill's by torch."""
    if experts.numel() > 64:
        return torch.bincount(experts.flatten(), minlength=num_experts).tolist()
    counts = [0] * num_experts
    for token in experts.tolist():
        for expert in token:
            counts[expert] += 1
    return counts


class _Grouped:
    """A layer's (token, expert) assignments grouped by expert, tokens ascending: made only for experts computed
    one at a time (a cached batch and the resident call group their own, in C)."""

    def __init__(self, experts: torch.Tensor, weights: torch.Tensor, counts: list[int], native: bool) -> None:
        self.order = torch.argsort(experts.flatten(), stable=True)
        self.token_of = self.order // experts.shape[1]
        weight_of = weights.flatten().index_select(0, self.order)
        self.weight_of = weight_of.to(torch.float32) if native else weight_of[:, None]
        self.offsets = list(itertools.accumulate(counts, initial=0))


def moe_forward(
    x: torch.Tensor, layer: int, routing: Routing, provider: ExpertProvider, ctx: StepContext
) -> torch.Tensor:
    """x: [tokens, hidden] -> [tokens, hidden], the weighted sum of each token's top-k experts."""
    weights, experts, probs = routing
    record_routing(layer, routing, ctx)
    counts = _counts(experts, probs.shape[-1])
    active = [e for e, c in enumerate(counts) if c]
    # One torch thread on fp32 CPU activations: each expert's rows are gathered, computed and added into
    # `out` by one native call, with no per-expert tensors; otherwise outputs are sorted, then un-sorted.
    native = cpu_kernels.usable(x) and cpu_kernels.widths_supported(x.shape[1]) and x.stride(-1) == 1
    grouped: _Grouped | None = None

    def group() -> _Grouped:
        nonlocal grouped
        if grouped is None:
            grouped = _Grouped(experts, weights, counts, native)
        return grouped

    out: torch.Tensor | None = None  # native: made by the cached batch's call, or zeros at the first add
    outputs: torch.Tensor | None = None

    def add(expert: int, rows_in: torch.Tensor, gate_up: torch.Tensor | None, down: torch.Tensor | None,
            gather: torch.Tensor | None) -> None:
        """Native: the expert's rows (rows_in's own, or x's through gather) through the halves given, into out."""
        nonlocal out
        if out is None:
            out = torch.zeros_like(x)
        g = group()
        start = g.offsets[expert]
        cpu_kernels.expert_rows(rows_in, gate_up, down, out, g.offsets[expert + 1] - start, start, gather,
                                g.token_of, g.weight_of)

    def emit(expert: int, y: torch.Tensor) -> None:
        nonlocal outputs
        if native:
            add(expert, y, None, None, None)
            return
        g = group()
        if outputs is None:
            outputs = torch.empty(len(g.order), x.shape[1], dtype=x.dtype, device=x.device)
        start, end = g.offsets[expert], g.offsets[expert + 1]
        outputs[start:end] = y * g.weight_of[start:end]

    def rows(expert: int) -> torch.Tensor:
        """The expert's tokens; one token (batch-1 decode) is every routed expert's one row: x itself, read
        only, with no copy."""
        if x.shape[0] == 1:
            return x
        g = group()
        return x.index_select(0, g.token_of[g.offsets[expert] : g.offsets[expert + 1]])

    plan = provider.begin_layer(layer, active, ctx, [counts[e] for e in active])
    # Host work first, so its worker threads run while the device computes the rest; split experts' halves
    # first of all, since the device finishes them.
    split = [(e, provider.host_activation(layer, e, rows(e))) for e in plan.split]

    def in_place(expert: int) -> HostSink:
        """A host expert run by this thread goes straight into `out`, as a device expert does: no rows of
        its own and no second call to add them (measured: offload/host_path.py)."""
        def sink(w: StoredWeights) -> bool:
            if not native_expert(w):
                return False
            add(expert, x, w.gate_up, w.down, group().token_of)
            return True
        return sink

    on_host = [(e, provider.host_forward(layer, e, rows(e), in_place(e) if native else None)) for e in plan.host]
    provider.dispatched(layer, ctx)  # prefetch planning after the host's start, not before it
    device = plan.device
    # On the CPU the experts ready in the cache go in one call, the resident engine's (all of a layer's: its very
    # sum), then those that land meanwhile in a second (the link copies far slower than they compute); what has
    # no slot yet goes one by one below.
    for wait in (False, True) if native else ():
        batch = provider.cached_batch(layer, device, wait) if device else None
        if batch is not None:
            summed = moe_calls.moe(x, experts, weights, batch.slots.gate_up, batch.slots.down, x.shape[1],
                                 batch.matrix_of)
            out = summed if out is None else out.add_(summed)
            device = [e for e in device if batch.matrix_of[e] < 0] if len(batch.experts) < len(device) else []
    for expert in device:
        w = provider.get(layer, expert)
        if native and native_expert(w):
            add(expert, x, w.gate_up, w.down, group().token_of)
        else:
            emit(expert, expert_forward(rows(expert), w))
    for expert, future in split:
        h, down = future.result(), provider.get_down(layer, expert)
        assert h is not None  # a split half has no sink
        if native and _native_matrix(down):
            add(expert, h, None, down, None)
        else:
            emit(expert, expert_down(h, down, x.dtype))
    for expert, future in on_host:
        y = future.result()
        if y is not None:
            emit(expert, y)
    provider.end_layer(layer, ctx)
    if native:
        assert out is not None  # every expert was added
        return out
    # Un-sort and add each token's k expert outputs (index_add_ is far slower on CPU for small batches).
    assert outputs is not None  # every expert was emitted
    order = group().order
    return outputs.index_select(0, torch.argsort(order)).view(x.shape[0], experts.shape[1], -1).sum(dim=1)
