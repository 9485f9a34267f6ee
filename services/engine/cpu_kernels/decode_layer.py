"""A decode step's whole decoder layer in one native call (layer.c): the Python side, its fixed part built once.

The layered path (model.py) calls the same kernels one at a time; this one is for the layers they can all run
(standard attention with its RoPE pass native, softmax routing, resident native experts, no shared expert),
and its results are the layered path's bit for bit.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from services.engine import cpu_kernels
from services.engine.cpu_kernels.formats import CpuMatrix, native_widths

_POINTERS = ("qkv", "o", "router", "gate_up", "down", "post_attention_norm", "next_norm", "q_norm", "k_norm",
             "cos", "sin", "k_cache", "v_cache")
_SIZES = ("experts", "hidden", "q_heads", "kv_heads", "head_dim", "slots", "max_positions", "top_k", "renormalize")


class _Layer(ctypes.Structure):
    """hs.h's hs_layer."""

    _fields_ = ([(name, ctypes.c_void_p) for name in _POINTERS] + [(name, ctypes.c_int64) for name in _SIZES]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)])


@dataclass
class DecodeLayerOutput:
    residual_mid: torch.Tensor  # [B, hidden]: the residual stream entering the experts (StepContext.layer_inputs)
    weights: torch.Tensor  # [B, top_k] routing weights
    experts: torch.Tensor  # [B, top_k] int64 expert ids, largest weight first
    probs: torch.Tensor  # [B, experts] softmax over every expert
    residual: torch.Tensor  # [B, hidden]: the residual stream leaving the layer
    normed: torch.Tensor  # [B, hidden]: its norm, the next layer's input


@dataclass
class NativeDecodeLayer:
    """One layer's fixed part (weights, norms, caches, shapes) as layer.c reads it, and what keeps it alive."""

    layer: _Layer
    keep: tuple[Any, ...]  # the objects whose memory `layer` points into
    work_per_token: int  # floats of scratch a token takes (layer.c's hs_decode_layer_work, linear in tokens)

    @classmethod
    def build(cls, qkv: CpuMatrix, o: CpuMatrix, router: CpuMatrix, gate_up: ctypes.Array, down: ctypes.Array,
              norms: tuple[torch.Tensor, torch.Tensor], head_norms: tuple[torch.Tensor, torch.Tensor] | None,
              rope: tuple[torch.Tensor, torch.Tensor], caches: tuple[torch.Tensor, torch.Tensor],
              heads: tuple[int, int, int], top_k: int, renormalize: bool, eps: float, scale: float,
              ) -> NativeDecodeLayer | None:
        """None when a part is one the kernels do not read (the layered path then runs it)."""
        tensors = [*norms, *rope, *caches, *(head_norms or ())]
        q_heads, kv_heads, head_dim = heads
        if (cpu_kernels.library() is None or not cpu_kernels.widths_supported(head_dim)
                or not all(native_widths(m.format, m.shape[1], m.group) for m in (qkv, o, router))
                or not all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)):
            return None
        k_cache = caches[0]
        hidden = o.shape[0]
        if qkv.shape != ((q_heads + 2 * kv_heads) * head_dim, hidden) or o.shape[1] != q_heads * head_dim:
            return None
        pointers = [ctypes.addressof(qkv.native()), ctypes.addressof(o.native()), ctypes.addressof(router.native()),
                    ctypes.addressof(gate_up), ctypes.addressof(down),
                    *(t.data_ptr() for t in norms), *((t.data_ptr() for t in head_norms) if head_norms else (None,) * 2),
                    *(t.data_ptr() for t in rope), *(t.data_ptr() for t in caches)]
        sizes = [len(gate_up), hidden, q_heads, kv_heads, head_dim, k_cache.shape[1], rope[0].shape[0], top_k,
                 int(renormalize)]
        layer = _Layer(*pointers, *sizes, eps, scale)
        work = cpu_kernels.loaded().hs_decode_layer_work(ctypes.byref(layer), 1)
        return cls(layer, (qkv, o, router, gate_up, down, *tensors), work)

    def __call__(self, h: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> DecodeLayerOutput:
        """h: the residual stream entering the layer, x: its norm ([B, hidden] fp32 contiguous); the step's
        int64 positions, KV slots [B], block tables [B, max_blocks] and context lengths [B], contiguous."""
        layer, batch = self.layer, h.shape[0]
        work, _ = cpu_kernels.scratch(self.work_per_token * batch)
        out = DecodeLayerOutput(torch.empty(batch, layer.hidden), torch.empty(batch, layer.top_k),
                                torch.empty(batch, layer.top_k, dtype=torch.int64),
                                torch.empty(batch, layer.experts), torch.empty(batch, layer.hidden),
                                torch.empty(batch, layer.hidden))
        status = cpu_kernels.loaded().hs_decode_layer(
            ctypes.byref(layer), h.data_ptr(), x.data_ptr(), batch, positions.data_ptr(), slots.data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), block_size, work.data_ptr(),
            out.residual_mid.data_ptr(), out.probs.data_ptr(), out.weights.data_ptr(), out.experts.data_ptr(),
            out.residual.data_ptr(), out.normed.data_ptr())
        if status == -1:
            raise ValueError("a position, KV slot, context length or block id is outside the tables or the cache")
        if status == -3:
            raise ValueError(f"expert id out of range 0..{layer.experts - 1}")
        if status:
            raise MemoryError("native decode layer: out of memory for its scratch")
        return out
