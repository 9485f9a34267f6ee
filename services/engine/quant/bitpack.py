"""Unpacking the int32 words every 4/8-bit checkpoint format packs its integers into."""

from __future__ import annotations

import torch


def unpack_int32(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[..., W] int32 words -> [..., W * 32/bits] unsigned ints along the last dim.

    Field i of a word (bits i*b .. i*b+b-1) is element `order[i]` of its group of 32/b (default: element i).
    """
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    fields = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)  # [..., W, per_word]
    if order is not None:
        fields = fields[..., torch.argsort(torch.tensor(order))]
    return fields.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)


def pack_int32(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of `unpack_int32` (tests build checkpoints with it)."""
    per_word = 32 // bits
    fields = values.to(torch.int64).reshape(*values.shape[:-1], -1, per_word)
    if order is not None:
        fields = fields[..., list(order)]
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (fields << shifts).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def expect_shape(name: str, t: torch.Tensor, shape: tuple[int, ...], fmt: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"malformed {fmt} checkpoint: {name} has shape {tuple(t.shape)}, expected {shape}")
