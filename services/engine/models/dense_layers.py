"""The dense layers of a model (each layer's fused q/k/v and o projections, the LM head) built once, right as
the non-expert weights load and before the experts do, so their float copies are gone before the experts'
memory is taken (peak RSS: the weights in their final formats, not those plus a float copy of the rest)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine import cpu_kernels
from services.engine.cpu_kernels.formats import Allocator, packed_nbytes
from services.engine.host_allocator import HugePageArena
from services.engine.models.native_linear import NativeLinear
from services.engine.models.packed_linear import PackedLinear, should_pack
from services.engine.models.weights import AttentionWeights, NonExpertWeights

Linear = PackedLinear | NativeLinear

# What a float matrix becomes once its layer holds it in its own format (the float copy is not kept).
_RELEASED = torch.empty(0)


@dataclass
class DenseLayers:
    lm_head: Linear
    qkv: list[Linear | None]  # q, k and v as one GEMM (split by views after); None for MLA layers
    o: list[Linear | None]


def dense_layers(weights: NonExpertWeights, dense_format: str | None, group_size: int = 64) -> DenseLayers:
    """dense_format (a CPU weight format, see native_linear): the layers run on the native kernels in that
    format; None, or no kernels built: torch's (oneDNN-packed) path. The weights' float matrices are released
    (or pointed at the layer's own copy), so each matrix is held once."""
    device, dtype = weights.embed.device, weights.embed.dtype
    native = device.type == "cpu" and cpu_kernels.library() is not None
    native_format = dense_format if native else None
    pack = should_pack(str(device), dtype)
    tied = weights.lm_head is weights.embed
    arena = _native_arena(weights, native_format, group_size, tied) if native_format is not None else None
    take = arena.take if arena is not None else None

    def linear(weight: torch.Tensor, bias: torch.Tensor | None, alloc: Allocator | None = None) -> Linear:
        if native_format is not None:
            return NativeLinear(weight, bias, native_format, group_size, alloc)
        return PackedLinear(weight, bias, pack)

    # A tied head stays out of the arena: already in its format, it keeps sharing the embedding table.
    layers = DenseLayers(linear(weights.lm_head, None, None if tied else take), [], [])
    for layer in weights.layers:
        a = layer.attention
        if not isinstance(a, AttentionWeights):
            layers.qkv.append(None)
            layers.o.append(None)
            continue
        layers.qkv.append(linear(torch.cat((a.q, a.k, a.v)), _cat_biases(a), take))
        o = linear(a.o, a.o_bias, take)
        layers.o.append(o)
        a.q = a.k = a.v = _RELEASED
        a.o = _RELEASED if o.weight is None else o.weight
    if not tied:  # a tied head stays row-major for the embedding's lookups
        weights.lm_head = _RELEASED if layers.lm_head.weight is None else layers.lm_head.weight
    return layers


def _native_arena(weights: NonExpertWeights, fmt: str, group_size: int, tied: bool) -> HugePageArena:
    """One huge-page buffer for every dense matrix the native kernels stream (host_allocator.HugePageArena)."""
    shapes: list[tuple[int, int]] = [] if tied else [(weights.lm_head.shape[0], weights.lm_head.shape[1])]
    for layer in weights.layers:
        a = layer.attention
        if isinstance(a, AttentionWeights):
            shapes += [(a.q.shape[0] + a.k.shape[0] + a.v.shape[0], a.q.shape[1]), (a.o.shape[0], a.o.shape[1])]
    return HugePageArena(HugePageArena.bytes_for([packed_nbytes(s, fmt, group_size) for s in shapes]))


def _cat_biases(a: AttentionWeights) -> torch.Tensor | None:
    """q, k and v biases as one (zeros for any a family leaves out), or None when none has one."""
    if a.q_bias is None and a.k_bias is None and a.v_bias is None:
        return None
    parts = [b if b is not None else w.new_zeros(w.shape[0]) for w, b in ((a.q, a.q_bias), (a.k, a.k_bias),
                                                                        (a.v, a.v_bias))]
    return torch.cat(parts)
