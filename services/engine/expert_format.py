"""How a routed expert is stored: the --expert-dtype names, the int4 group sizes, the dense flat layout and
the bits each format spends per parameter. One definition each; the packed int8/int4 layout with the same
interface is services/engine/quant/layout.py."""

from __future__ import annotations

import torch

from services.engine.expert_provider import ExpertWeights

EXPERT_DTYPES = ("auto", "bf16", "int8", "int4")  # auto: the run dtype, or a quantized checkpoint's own form
GROUP_SIZES = (32, 64, 128)  # int4: inputs per (scale, zero); what the CPU and CUDA kernels take
DEFAULT_GROUP_SIZE = 64
SCALE_BITS = 16  # every scale and zero is bf16


def check_expert_format(expert_dtype: str, group_size: int) -> None:
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"unknown expert dtype {expert_dtype!r}: use {', '.join(EXPERT_DTYPES)}")
    check_group_size(group_size)


def check_group_size(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"expert group size must be {', '.join(map(str, GROUP_SIZES))}, got {group_size}")


def nearest_group_size(group_size: int) -> int:
    """A checkpoint's group size if our kernels take it, else the largest one (coarser: fewer scales)."""
    return group_size if group_size in GROUP_SIZES else GROUP_SIZES[-1]


def bits_per_parameter(expert_dtype: str, group_size: int, hidden: int, intermediate: int) -> float:
    """What one expert parameter costs stored: int4 carries a scale and a zero per group of inputs, int8 one
    scale per output row (of gate_up's 2 x intermediate rows and down's hidden ones)."""
    if expert_dtype == "bf16":
        return 16.0
    if expert_dtype == "int4":
        return 4.0 + 2 * SCALE_BITS / group_size
    if expert_dtype == "int8":
        rows, params = 2 * intermediate + hidden, 3 * hidden * intermediate
        return 8.0 + SCALE_BITS * rows / params
    raise ValueError(f"unknown expert dtype {expert_dtype!r}: use bf16, int8 or int4 (or auto: the spec's own)")


class ExpertLayout:
    """Where gate_up and down live inside one flat dense expert buffer (also the chunks of a transfer)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.gate_up_shape = (2 * intermediate, hidden)
        self.down_shape = (hidden, intermediate)
        self.gate_up_numel = 2 * intermediate * hidden
        self.numel = self.gate_up_numel + hidden * intermediate

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def pack(self, w: ExpertWeights, flat: torch.Tensor) -> None:
        flat[: self.gate_up_numel].copy_(w.gate_up.flatten())
        flat[self.gate_up_numel :].copy_(w.down.flatten())

    def views(self, flat: torch.Tensor) -> ExpertWeights:
        return ExpertWeights(
            flat[: self.gate_up_numel].view(self.gate_up_shape), flat[self.gate_up_numel :].view(self.down_shape)
        )

    def chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One chunk per expert matrix, so a demand fetch waits at most one matrix behind a prefetch."""
        return [flat[: self.gate_up_numel], flat[self.gate_up_numel :]]
