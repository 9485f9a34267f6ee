"""A quantized matrix in the layout torch's weight-only matmul kernels take on the compute device.

The layout differs between CPU and CUDA (each kernel has its own int4 tiling) but never in size, so the host
store keeps the compute device's layout and a transfer is a plain byte copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.quant.groupwise import quantize_int4, quantize_int8

SCALE_DTYPE = torch.bfloat16  # what the kernels take (CUDA's int4 kernel accepts nothing else)


@dataclass(frozen=True)
class QuantScheme:
    bits: int  # 4 or 8
    group_size: int  # int4: inputs per (scale, zero); int8 is per output row (one scale per row)

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"quantized experts have 4 or 8 bits, got {self.bits}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"expert group size must be 32, 64 or 128, got {self.group_size}")


@dataclass
class PackedMatrix:
    bits: int
    group_size: int
    shape: tuple[int, int]  # (out, in) of the float matrix
    qweight: torch.Tensor
    scales: torch.Tensor  # int4: [in/g, out, 2] (scale, zero); int8: [out]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales))


def _int4_inner_k_tiles(k: int) -> int:
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"CUDA int4 kernel needs an input dimension divisible by 32, got {k}")


def pack_matrix(w: torch.Tensor, scheme: QuantScheme, device: torch.device | str) -> PackedMatrix:
    """Quantizes a float [out, in] matrix (round-to-nearest) into the kernel layout of `device`."""
    device = torch.device(device)
    n, k = w.shape
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
    scales = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(device, SCALE_DTYPE)
    if device.type == "cuda":
        nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(device, torch.uint8)
        qweight = torch.ops.aten._convert_weight_to_int4pack(nibbles, _int4_inner_k_tiles(k))
    else:
        qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    return PackedMatrix(4, group_size, (n, k), qweight, scales)


@dataclass
class QuantizedExpertWeights:
    """ExpertWeights' quantized variant: `expert_forward` computes it with the weight-only kernels."""

    gate_up: PackedMatrix  # [2 * intermediate, hidden]: gate rows then up rows
    down: PackedMatrix  # [hidden, intermediate]

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes
