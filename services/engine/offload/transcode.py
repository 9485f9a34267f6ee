"""Quantized experts kept in the CPU kernels' layout on the host and in torch's CUDA layout in the device's slots.

A CUDA engine whose policy computes experts on the host needs the host's copy in a layout the host's kernels
read (cpu_kernels/formats.py: tiles of 16 rows), and the device's copy in the one torch's CUDA products read
(int8: plain rows and bf16 row scales; int4: tinygemm's, made by `_convert_weight_to_int4pack` from nibble
pairs). No CPU kernel reads torch's CUDA int4 layout, and torch's CPU int8 product read an expert at a third
to a half of the kernels' rate (one row, one and two threads, Zen 4 guest); so the store keeps the kernels'
layout, and each copied matrix lands in a staging buffer on the device and is repacked there, on the copy
stream, into its slot: the same bits as an expert packed for the device at load (quant/packed.pack_matrix),
since both start from the same quantization.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from services.engine.cpu_kernels.formats import TILE, q4_group_bytes
from services.engine.quant.layout import QuantizedExpertLayout
from services.engine.quant.packed import SCALE_DTYPE, int4_inner_k_tiles

Repack = Callable[[], None]  # run on the copy stream once its chunk's copy is queued


def tinygemm_inputs(weight: torch.Tensor, shape: tuple[int, int], group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One int4 matrix's bytes in the CPU kernels' layout -> (nibble pairs [N, K/2] uint8, input k's in the high
    nibble of byte k/2 when k is even; (scale, zero) [K/group, N, 2] in SCALE_DTYPE): what pack_int4 hands
    `_convert_weight_to_int4pack`, on whatever device `weight` is."""
    n, k = shape
    groups, tiles = k // group, -(-n // TILE)
    blocks = weight.view(tiles, groups, q4_group_bytes(group))
    packed = blocks[..., : group // 2 * TILE].reshape(tiles, groups, group // 8, TILE, 4)
    # Byte (row, t) of an 8-input step holds input t in its low nibble and input 4 + t in its high one.
    q = torch.stack((packed & 0x0F, packed >> 4), dim=-2)  # [tiles, G, g/8, 16, 2, 4]
    q = q.permute(0, 3, 1, 2, 4, 5).reshape(tiles * TILE, k)[:n]
    nibbles = (q[:, ::2] << 4) | q[:, 1::2]
    pairs = blocks[..., group // 2 * TILE :].contiguous().view(torch.bfloat16).view(tiles, groups, 2, TILE)
    scale_zero = pairs.permute(1, 0, 3, 2).reshape(groups, tiles * TILE, 2)[:, :n].to(SCALE_DTYPE).contiguous()
    return nibbles.contiguous(), scale_zero


def int8_rows(weight: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One int8 matrix in the CPU kernels' layout (q + 128 in tiles [N/16, K/4, 16, 4], fp32 row scales) ->
    (q int8 [N, K], scales [N] in SCALE_DTYPE): what pack_matrix moves to a CUDA device."""
    n, k = shape
    tiles = weight.reshape(-1, k // 4, TILE, 4).transpose(1, 2).reshape(-1, k)[:n]
    return (tiles ^ 0x80).view(torch.int8), scales[:n].to(SCALE_DTYPE)  # q + 128 = q ^ 0x80 as a byte


class Transcoder:
    """Chunks that carry an expert from the host's CPU-layout buffer into a device slot's CUDA layout."""

    def __init__(self, host: QuantizedExpertLayout, device: QuantizedExpertLayout) -> None:
        if host.device.type != "cpu" or device.device.type != "cuda" or host.scheme != device.scheme:
            raise ValueError("transcoding takes CPU-layout experts to the same scheme's CUDA layout")
        self.host, self.device = host, device
        self.group = host.scheme.group_size
        # One staging buffer per matrix: copies and repacks all run on the link's one copy stream, in order.
        self.staging = [torch.empty(chunk.numel(), dtype=torch.uint8, device=device.device)
                        for chunk in host.chunks(torch.empty(host.numel, dtype=torch.uint8, device="meta"))]

    def chunks(self, slot: torch.Tensor, source: torch.Tensor, staging: list[torch.Tensor] | None = None
               ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[Repack]]:
        """The transfer of `source` (a host buffer) into `slot` (a device slot's flat buffer): its chunks
        (staging destination, host source) and what runs after each."""
        staging = self.staging if staging is None else staging
        names = list(self.host.shapes)  # gate_up, down: the layouts' chunk order
        chunks = list(zip(staging, self.host.chunks(source), strict=True))
        starts = (0, self.host.gate_up_numel)  # each chunk's offset in the host's flat buffer
        return chunks, [self._repack(name, buffer, start, slot)
                        for name, buffer, start in zip(names, staging, starts, strict=True)]

    def fill(self, slot: torch.Tensor, source: torch.Tensor) -> None:
        """The same at start-up, on the current stream (no link), through buffers of its own: the copy
        stream's staging is that stream's alone."""
        chunks, repacks = self.chunks(slot, source, [torch.empty_like(buffer) for buffer in self.staging])
        for (staging, src), repack in zip(chunks, repacks, strict=True):
            staging.copy_(src)
            repack()

    def _repack(self, name: str, staging: torch.Tensor, start: int, slot: torch.Tensor) -> Repack:
        (weight, scales), shape = self.host.pieces[name], self.device.shapes[name]
        weight = dataclasses.replace(weight, offset=weight.offset - start)  # within the staged chunk
        scales = None if scales is None else dataclasses.replace(scales, offset=scales.offset - start)
        device_weight, device_scales = self.device.pieces[name]
        assert device_scales is not None  # the CUDA layouts keep their scales apart

        def repack() -> None:
            if self.host.scheme.bits == 4:  # the CPU layout's scales lie among its nibbles
                packed, scale = tinygemm_inputs(weight.view(staging), shape, self.host.scheme.group_size)
                packed = torch.ops.aten._convert_weight_to_int4pack(packed, int4_inner_k_tiles(shape[1]))
            else:
                assert scales is not None  # int8 keeps its row scales apart
                packed, scale = int8_rows(weight.view(staging), scales.view(staging), shape)
            device_weight.view(slot).copy_(packed)
            device_scales.view(slot).copy_(scale)

        return repack


def needs_transcoding(layout: object, device: str, host_computes: bool) -> bool:
    """Whether a CUDA engine's quantized experts go through a Transcoder: its host computes some of them."""
    return host_computes and device.startswith("cuda") and isinstance(layout, QuantizedExpertLayout)
