"""A quantized matrix in the layout the compute device's kernels take: torch's weight-only kernels on CUDA,
the native kernels' (cpu_kernels/formats.py) on the CPU.

The layouts differ between CPU and CUDA (each kernel has its own int4 tiling) but their sizes barely do, so
the host store keeps the compute device's layout and a transfer is a plain byte copy; where a CUDA engine's
host computes experts too, the store keeps the CPU's and each copy is repacked on the device
(offload/transcode.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from services.engine.cpu_kernels import formats, moe_calls
from services.engine.expert_format import check_group_size
from services.engine.quant.groupwise import quantize_int4, quantize_int8

SCALE_DTYPE = torch.bfloat16  # what the kernels take (CUDA's int4 kernel accepts nothing else)


@dataclass(frozen=True)
class QuantScheme:
    bits: int  # 4 or 8
    group_size: int  # int4: inputs per (scale, zero); int8 is per output row (one scale per row)

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"quantized experts have 4 or 8 bits, got {self.bits}")
        check_group_size(self.group_size)


@dataclass
class PackedMatrix:
    bits: int
    group_size: int
    shape: tuple[int, int]  # (out, in) of the float matrix
    qweight: torch.Tensor
    scales: torch.Tensor | None  # CUDA int4: [in/g, out, 2] (scale, zero); int8: [out]; CPU: see formats (int4:
    # None, its scales lie among its nibbles)
    on_cpu: bool = False  # in the native CPU kernels' layout (else torch's CUDA one)
    _cpu: formats.CpuMatrix | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales) if t is not None)

    def cpu_matrix(self) -> formats.CpuMatrix:
        """The same bytes as the native kernels' matrix (made once: it holds their pointers)."""
        if self._cpu is None:
            self._cpu = formats.CpuMatrix(f"int{self.bits}", self.shape, self.qweight, self.scales, self.group_size)
        return self._cpu


def int4_inner_k_tiles(k: int) -> int:
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"CUDA int4 kernel needs an input dimension divisible by 32, got {k}")


def pack_matrix(w: torch.Tensor, scheme: QuantScheme, device: torch.device | str,
                into: torch.Tensor | None = None) -> PackedMatrix:
    """Quantizes a float [out, in] matrix (round-to-nearest) into the kernel layout of `device`. into: on the
    CPU, memory of the packed weight's bytes to pack it straight into (an expert buffer's piece)."""
    device = torch.device(device)
    n, k = w.shape
    if device.type == "cpu":
        alloc = None if into is None else formats.placed_in(into)
        m = formats.pack(w, f"int{scheme.bits}", scheme.group_size, alloc=alloc)
        return PackedMatrix(scheme.bits, scheme.group_size, (n, k), m.weight, m.scales, on_cpu=True)
    if scheme.bits == 8:
        q, scale = quantize_int8(w)
        return PackedMatrix(8, scheme.group_size, (n, k), q.to(device), scale.to(device, SCALE_DTYPE))
    q, scale, zero = quantize_int4(w, scheme.group_size)
    return pack_int4(q, scale, zero, scheme.group_size, device)


def pack_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, device: torch.device
) -> PackedMatrix:
    """q int [out, in] in 0..15, scale and zero [out, in/g]: w = (q - 8) * scale + zero."""
    n, k = q.shape
    if device.type == "cpu":
        m = formats.from_int4(q, scale, zero, group_size)
        return PackedMatrix(4, group_size, (n, k), m.weight, m.scales, on_cpu=True)
    scales = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(device, SCALE_DTYPE)
    nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(device, torch.uint8)
    qweight = torch.ops.aten._convert_weight_to_int4pack(nibbles, int4_inner_k_tiles(k))
    return PackedMatrix(4, group_size, (n, k), qweight, scales)


@dataclass
class QuantizedExpertWeights:
    """ExpertWeights' quantized variant: `expert_forward` computes it with the weight-only kernels."""

    gate_up: PackedMatrix  # [2 * intermediate, hidden]: gate rows then up rows
    down: PackedMatrix  # [hidden, intermediate]
    native: moe_calls.ExpertCall | Literal[False] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes
