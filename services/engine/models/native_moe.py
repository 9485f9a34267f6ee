"""A layer's routed experts in one native call (cpu_kernels/moe.c), for resident experts on the CPU in any
weight format (fp32, bf16, int8, int4), on the kernels' thread pool.

Why: a decode step's experts are bound by reading their weights; computing them one at a time from Python
(grouping, gathers, two calls and a scatter per expert) cost as much as reading them. This is the CPU's path
for resident experts wherever the kernels are built; `fused_moe` stays for CUDA and where they are not.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from services.engine import cpu_kernels
from services.engine.cpu_kernels import formats, moe_calls
from services.engine.models.moe import record_routing
from services.engine.models.router import Routing
from services.engine.step_context import StepContext


@dataclass
class NativeExperts:
    """One layer's experts as two C arrays of matrices (gate_up, down), pointing into the experts' tensors."""

    gate_up: ctypes.Array
    down: ctypes.Array
    hidden: int
    matrices: list[formats.CpuMatrix]  # keeps the tensors the arrays point into alive

    @classmethod
    def build(cls, experts: list) -> NativeExperts | None:
        """The layer's experts (ExpertWeights or QuantizedExpertWeights) as the kernels read them in place, or
        None when the kernels are not built or cannot read one of them (then the per-expert path runs)."""
        if cpu_kernels.library() is None:
            return None
        gate_up = [m for w in experts if (m := formats.as_cpu_matrix(w.gate_up)) is not None]
        down = [m for w in experts if (m := formats.as_cpu_matrix(w.down)) is not None]
        matrices = [*gate_up, *down]
        if len(matrices) != 2 * len(experts) or len({(m.format, m.group) for m in matrices}) != 1:
            return None
        return cls(moe_calls.native_array(gate_up), moe_calls.native_array(down), down[0].shape[0], matrices)


def native_moe_forward(
    x: torch.Tensor, layer: int, routing: Routing, experts: NativeExperts, ctx: StepContext
) -> torch.Tensor:
    """x: [tokens, hidden] -> [tokens, hidden]: moe_forward's sum, in one call."""
    weights, ids, _ = routing
    record_routing(layer, routing, ctx)
    return moe_calls.moe(x, ids, weights, experts.gate_up, experts.down, experts.hidden)
