"""int4 experts kept in the CPU kernels' layout on the host and in torch's CUDA layout in the device's slots.

A CUDA engine whose policy computes experts on the host needs the host's copy in a layout the host's kernels
read (cpu_kernels/formats.py: tiles of 16 rows, each group's nibbles then its bf16 scales and zeros), and the
device's copy in the one torch's CUDA int4 product reads (tinygemm's, made by `_convert_weight_to_int4pack`
from nibble pairs). No CPU kernel reads the second, so the store keeps the first, and each copied matrix lands
in a staging buffer on the device and is repacked there, on the copy stream, into its slot: the same bits as an
expert packed for the device at load (quant/packed.pack_int4), since both start from the same quantization.
"""

from __future__ import annotations

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


class Int4Transcoder:
    """Chunks that carry an expert from the host's CPU-layout buffer into a device slot's CUDA layout."""

    def __init__(self, host: QuantizedExpertLayout, device: QuantizedExpertLayout) -> None:
        if host.device.type != "cpu" or device.device.type != "cuda" or host.scheme != device.scheme:
            raise ValueError("transcoding takes CPU-layout int4 experts to the same scheme's CUDA layout")
        if host.scheme.bits != 4:
            raise ValueError(f"only int4 layouts differ between the CPU and CUDA, not int{host.scheme.bits}")
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
        return chunks, [self._repack(name, buffer, slot) for name, buffer in zip(names, staging, strict=True)]

    def fill(self, slot: torch.Tensor, source: torch.Tensor) -> None:
        """The same at start-up, on the current stream (no link), through buffers of its own: the copy
        stream's staging is that stream's alone."""
        chunks, repacks = self.chunks(slot, source, [torch.empty_like(buffer) for buffer in self.staging])
        for (staging, src), repack in zip(chunks, repacks, strict=True):
            staging.copy_(src)
            repack()

    def _repack(self, name: str, staging: torch.Tensor, slot: torch.Tensor) -> Callable[[], None]:
        (piece, scale_piece), shape = self.device.pieces[name], self.device.shapes[name]
        weight_bytes = self.host.pieces[name][0].nbytes  # the CPU layout's scales lie among its nibbles
        assert scale_piece is not None  # the CUDA layout keeps its scales apart

        def repack() -> None:
            nibbles, scale_zero = tinygemm_inputs(staging[:weight_bytes], shape, self.group)
            piece.view(slot).copy_(torch.ops.aten._convert_weight_to_int4pack(nibbles, int4_inner_k_tiles(shape[1])))
            scale_piece.view(slot).copy_(scale_zero)

        return repack


def needs_transcoding(layout: object, device: str, host_computes: bool) -> bool:
    """Whether a CUDA engine's int4 experts go through Int4Transcoder: its host computes some of them."""
    return (host_computes and device.startswith("cuda") and isinstance(layout, QuantizedExpertLayout)
            and layout.scheme.bits == 4)
