"""The native calls that run experts (moe.c's hs_moe): a MoE layer's routed experts in one call, softmax
routing, one expert on its rows (`ExpertCall`, kept beside the weights), and a layer's host jobs in one call.
The matrices are formats.py's."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.engine import cpu_kernels
from services.engine.cpu_kernels.formats import CpuMatrix, NativeMatrix, alone, as_cpu_matrix, f32_rows

if TYPE_CHECKING:
    from services.engine.quant.packed import PackedMatrix


def native_array(matrices: list[CpuMatrix]) -> ctypes.Array:
    """The matrices as one C array (matmul.c's hs_matrix[]): what hs_moe takes per layer."""
    return (NativeMatrix * len(matrices))(*(m.native() for m in matrices))


def moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: ctypes.Array,
        down: ctypes.Array | None, width: int, matrix_of: ctypes.Array | None = None) -> torch.Tensor:
    """Each token's top-k experts (ids, weights [T, k]) on x [T, H], weighted and summed, in one native call
    ([T, width = H]); down None: one expert's SwiGLU activation only ([T, width = I], a split expert's half).
    matrix_of: the matrix index of each expert id, -1 for one left out (adds nothing); None: expert e is
    matrix e."""
    x = f32_rows(x)
    # Checked before converting: each no-op .to()/.contiguous() still costs a dispatch (~0.4 us), and a
    # decode layer's host jobs call this once per expert.
    if ids.dtype != torch.int64 or not ids.is_contiguous():
        ids = ids.to(torch.int64).contiguous()
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        weights = weights.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], width)
    experts = len(gate_up) if matrix_of is None else len(matrix_of)
    status = cpu_kernels.loaded().hs_moe(
        gate_up, down, len(gate_up), matrix_of, experts, x.data_ptr(), x.stride(0), x.shape[0], ids.data_ptr(),
        weights.data_ptr(), ids.shape[1], out.data_ptr())
    if status == -1:
        raise ValueError(f"expert id out of range 0..{experts - 1}, or a matrix index out of 0..{len(gate_up) - 1}")
    if status:
        raise MemoryError("native MoE: out of memory for its scratch")
    return out


def route_softmax(x: torch.Tensor, router: CpuMatrix, top_k: int, renormalize: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax routing in one native call: (top-k weights [T, k], their expert ids [T, k] largest first, the
    softmax over every expert [T, E]), as router.softmax_topk computes them from x @ router^T, up to the
    product's fp32 summation order (ties: the lower expert first)."""
    x = f32_rows(x)
    tokens, experts = x.shape[0], router.shape[0]
    probs = torch.empty(tokens, experts)
    weights = torch.empty(tokens, top_k)
    ids = torch.empty(tokens, top_k, dtype=torch.int64)
    if cpu_kernels.loaded().hs_route_softmax(ctypes.byref(router.native()), x.data_ptr(), x.stride(0), tokens,
                                             top_k, int(renormalize), probs.data_ptr(), weights.data_ptr(),
                                             ids.data_ptr()):
        raise MemoryError("native routing: out of memory for its activation scratch")
    return weights, ids, probs


def expert(x: torch.Tensor, gate_up: CpuMatrix, down: CpuMatrix | None) -> torch.Tensor:
    """One SwiGLU expert on all of x's rows [T, H] -> [T, H] (the one-call MoE with one expert, weight 1); down
    None: its activation [T, I] only."""
    width = gate_up.shape[0] // 2 if down is None else down.shape[0]
    return run_expert(x, ExpertCall(alone(gate_up), None if down is None else alone(down), width))


@dataclass(frozen=True, slots=True)
class ExpertCall:
    """One expert as the native one-expert call takes it: its matrices as one-element C arrays (addresses only:
    whoever made it keeps the tensors alive) and the width it writes."""

    gate_up: ctypes.Array
    down: ctypes.Array | None
    width: int

    @property
    def kind(self) -> tuple[int, int, int, int]:
        """Format, group and shape of its gate/up matrix: calls of one kind can share a native call."""
        g = self.gate_up[0]
        return g.format, g.group, g.N, g.K


def expert_call(gate_up: torch.Tensor | PackedMatrix, down: torch.Tensor | PackedMatrix) -> ExpertCall | None:
    """The call for an expert's two stored matrices, None where the kernels cannot read them in place.
    Callers keep it beside the weights (ExpertWeights.native): one attribute a call instead of two matrix
    checks and two array lookups, whose objects a cold cache made cost ~8 us per expert (Qwen3 int4, one row)."""
    g, d = as_cpu_matrix(gate_up), as_cpu_matrix(down)
    if g is None or d is None or g.format != d.format:
        return None
    return ExpertCall(alone(g), alone(d), d.shape[0])


def run_expert(x: torch.Tensor, call: ExpertCall) -> torch.Tensor:
    """`expert` for a call made beforehand: every row of x [T, H] through it, [T, width]."""
    x = f32_rows(x)
    rows = x.shape[0]
    ids, weights = _one_expert_routing(rows)
    out = torch.empty(rows, call.width)
    if cpu_kernels.loaded().hs_moe(call.gate_up, call.down, 1, None, 1, x.data_ptr(), x.stride(0), rows,
                                   ids.data_ptr(), weights.data_ptr(), 1, out.data_ptr()):
        raise MemoryError("native MoE: out of memory for its scratch")
    return out


def run_experts(x: torch.Tensor, calls: Sequence[ExpertCall], rows: Sequence[int]) -> torch.Tensor:
    """Several experts of one format and shape in one call on the pool, each on its own rows of x (expert i's
    `rows[i]` after expert i-1's) and each output apart, unweighted: [sum(rows), width], each row what
    run_expert gives it (the same kernels and per-row sums; a layer's host jobs, offload/host_executor.py)."""
    if any(c.down is None or c.kind != calls[0].kind for c in calls):
        raise ValueError("run_experts: the experts must be whole and of one format and shape")
    gate_up = (NativeMatrix * len(calls))(*(c.gate_up[0] for c in calls))
    down = (NativeMatrix * len(calls))(*(c.down[0] for c in calls if c.down is not None))
    ids, weights = _each_expert_routing(tuple(rows))
    return moe(x, ids, weights, gate_up, down, calls[0].width)


@functools.lru_cache(maxsize=256)
def _each_expert_routing(rows: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert i's rows to expert i at weight 1 (read only), from a Python list: torch's repeat_interleave
    ran on its intra-op threads, whose spinning afterwards (a CUDA engine keeps several) took the pool's
    cores: one call for 8 experts ran 2.3 times slower than 8 calls (Xeon guest, two threads)."""
    ids = torch.tensor([i for i, n in enumerate(rows) for _ in range(n)], dtype=torch.int64).view(-1, 1)
    return ids, torch.ones(ids.shape[0], 1)


@functools.lru_cache(maxsize=64)
def _one_expert_routing(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row to expert 0 at weight 1: made once per row count, not twice per expert call (read only)."""
    return torch.zeros(rows, 1, dtype=torch.int64), torch.ones(rows, 1)
