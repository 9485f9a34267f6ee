"""Weight formats of the native CPU matmul (matmul.c): how a float [N, K] matrix is packed for each, and the
one call that multiplies by it on the kernels' thread pool.

  fp32  float [N, K]                      bf16  bf16 [N, K]
  int8  uint8 = q + 128 (q in -127..127) in tiles of 16 rows: [N/16, K/4, 16, 4]; float scale [N]:
        w = q * scale
  int4  uint8 in tiles of 16 rows, group after group ([N/16, K/g, g/2 * 16 + 64]): the group's nibbles
        [g/8, 16, 4], byte (i, t) holding row i's inputs t (low nibble) and 4 + t (high) of each 8, then
        its bf16 scale [16] and zero [16] per row: w = (q - 8) * scale + zero. One stream per tile: the
        scales read apart cost a Zen 4 core a quarter of its one-row rate.
  Packed weights sit on huge pages of their own (host_allocator.huge_page_empty): the kernels stream them.
  A tile is what one vector op reads (rows.c); N is padded to a whole tile with zero rows.

The int8 / int4 grids are quant/groupwise's (round to nearest): the same weights torch's kernels computed on.
Where the library is not built, `matmul` dequantizes and runs torch (slow, same values up to the
activations' rounding).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from services.engine import cpu_kernels
from services.engine.host_allocator import huge_page_empty
from services.engine.quant.groupwise import native_source, quantize_int4, quantize_int8

if TYPE_CHECKING:
    from services.engine.quant.packed import PackedMatrix

FORMAT_IDS = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3}
TILE = 16  # rows.c's TILE: weight rows interleaved per tile (int8, int4)
PACK_BLOCK_ROWS = 256  # rows `pack` quantizes at a time (a multiple of TILE)


def q4_group_bytes(group: int) -> int:
    """hs.h's q4_group_bytes: one int4 group of a tile, its nibbles then its bf16 scales and zeros."""
    return group // 2 * TILE + 4 * TILE


class NativeMatrix(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("format", "group", "N", "K")] + [
        (name, ctypes.c_void_p) for name in ("w", "scales", "bias")]


@dataclass
class CpuMatrix:
    """A [N, K] matrix in one of FORMAT_IDS, on the CPU, in the layout matmul.c reads."""

    format: str
    shape: tuple[int, int]  # (N, K) of the float matrix
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    group: int = 0  # int4: inputs per (scale, zero)
    bias: torch.Tensor | None = None
    _native: NativeMatrix | None = field(default=None, repr=False, compare=False)
    _alone: ctypes.Array | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales) if t is not None)

    def native_fields(self) -> tuple[int | None, ...]:
        """hs_matrix's fields: format, group, N, K and the addresses of the weight, scales and bias."""
        n, k = self.shape
        return (FORMAT_IDS[self.format], self.group, n, k, self.weight.data_ptr(),
                None if self.scales is None else self.scales.data_ptr(),
                None if self.bias is None else self.bias.data_ptr())

    def native(self) -> NativeMatrix:
        """The struct matmul.c takes (built once: its pointers are this object's tensors')."""
        if self._native is None:
            self._native = NativeMatrix(*self.native_fields())
        return self._native


def alone(m: CpuMatrix) -> ctypes.Array:
    """The matrix as a one-element C array (a single expert's call), made once like its struct; a plain tensor's
    matrix is made afresh per call (as_cpu_matrix), so its array comes from a cache keyed by what it holds."""
    if m._alone is None:
        m._alone = _alone_array(*m.native_fields())
    return m._alone


@functools.lru_cache(maxsize=4096)
def _alone_array(*fields: int | None) -> ctypes.Array:
    """A one-element hs_matrix[] of these fields. It holds addresses, never tensors: an entry outliving its tensor
    is never read, and one whose address comes back for another tensor of the same format and shape is that
    tensor's struct (1.2 us a call saved, a bf16 expert's two matrices per host job)."""
    return (NativeMatrix * 1)(NativeMatrix(*fields))


def native_widths(fmt: str, k: int, group: int = 0) -> bool:
    """Whether matmul.c's kernels take this input width (vectors of 64 inputs; int4: whole groups of 32s)."""
    return k % 64 == 0 and (fmt != "int4" or group % 32 == 0)


# Where a packed weight goes: (shape, dtype) -> an uninitialised CPU tensor (huge_page_empty, an arena's take).
Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def packed_nbytes(shape: tuple[int, int], fmt: str, group: int = 64) -> int:
    """Bytes of the weight tensor `pack` makes for a float [N, K] matrix (int8's row scales apart)."""
    n, k = shape
    tiles = -(-n // TILE)
    if fmt in ("fp32", "bf16"):
        return n * k * (4 if fmt == "fp32" else 2)
    if fmt == "int8":
        return tiles * TILE * k
    if fmt == "int4":
        return tiles * k // group * q4_group_bytes(group)
    raise ValueError(f"unknown CPU weight format {fmt!r}: use {', '.join(FORMAT_IDS)}")


def pack(w: torch.Tensor, fmt: str, group: int = 64, bias: torch.Tensor | None = None,
         alloc: Allocator | None = None) -> CpuMatrix:
    """Packs a float [N, K] matrix (any float dtype) into `fmt`, its weight where `alloc` puts it (default:
    memory of its own on huge pages, but a float matrix already in the format stays as it is: a tied LM head
    keeps sharing the embedding table)."""
    n, k = w.shape
    bias = None if bias is None else bias.float().contiguous()
    if fmt in ("fp32", "bf16"):
        dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        if alloc is None and w.dtype == dtype and w.is_contiguous():
            return CpuMatrix(fmt, (n, k), w, bias=bias)
        return CpuMatrix(fmt, (n, k), (alloc or huge_page_empty)((n, k), dtype).copy_(w), bias=bias)
    if fmt in ("int8", "int4"):
        return _pack_quantized(w, fmt, group, bias, alloc)
    raise ValueError(f"unknown CPU weight format {fmt!r}: use {', '.join(FORMAT_IDS)}")


def _pack_quantized(w: torch.Tensor, fmt: str, group: int, bias: torch.Tensor | None,
                    alloc: Allocator | None) -> CpuMatrix:
    """int8 or int4, PACK_BLOCK_ROWS rows at a time, each block's tiles straight into its rows of one weight
    tensor (a tile is a run of whole rows). Why: quantizing a whole matrix held a few float copies of it at once,
    the load's peak (a Qwen3-30B-A3B expert's gate/up: 30 MB over the resident int4 weights)."""
    n, k = w.shape
    rows = -(-n // TILE) * TILE
    weight = (alloc or huge_page_empty)((rows, packed_nbytes((n, k), fmt, group) // rows), torch.uint8)
    scales = torch.empty(rows) if fmt == "int8" else None
    if not _native_quantize(w, fmt, group, weight, scales):  # the torch ops, a block of rows at a time
        blocks = []
        for r0 in range(0, n, PACK_BLOCK_ROWS):
            block = w[r0 : r0 + PACK_BLOCK_ROWS]
            place = placed_in(weight[r0 : r0 + -(-block.shape[0] // TILE) * TILE])
            if fmt == "int8":
                blocks.append(from_int8(*quantize_int8(block), alloc=place).scales)
            else:
                from_int4(*quantize_int4(block, group), group, alloc=place)
        scales = torch.cat([s for s in blocks if s is not None]) if fmt == "int8" else None
    if fmt == "int8":
        return CpuMatrix("int8", (n, k), weight, scales, bias=bias)
    return CpuMatrix("int4", (n, k), weight, None, group, bias)


def placed_in(into: torch.Tensor) -> Allocator:
    """An Allocator handing out `into`'s bytes (contiguous, exactly the size asked for) as the shape asked."""
    def place(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return into.view(dtype).view(shape)

    return place


def _native_quantize(w: torch.Tensor, fmt: str, group: int, weight: torch.Tensor, scales: torch.Tensor | None
                     ) -> bool:
    """Whether quantize.c's one pass (the same bits as the torch ops) packed w into weight (int8: its row
    scales into `scales`); False where it does not read w (groupwise.native_source) or take its widths."""
    source = native_source(w)
    return source is not None and not cpu_kernels.loaded().hs_quantize(
        FORMAT_IDS[fmt], w.data_ptr(), source, w.stride(0), w.shape[0], w.shape[1], group, weight.data_ptr(),
        None if scales is None else scales.data_ptr())


def from_int8(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              alloc: Allocator | None = None) -> CpuMatrix:
    """q int8 [N, K] in -127..127, scale [N]: w = q * scale."""
    n, k = q.shape
    tiles = _padded(q.to(torch.int16) + 128, 128).to(torch.uint8).view(-1, TILE, k // 4, 4)
    weight = (alloc or huge_page_empty)((tiles.shape[0] * TILE, k), torch.uint8)
    weight.view(-1, k // 4, TILE, 4).copy_(tiles.transpose(1, 2))
    return CpuMatrix("int8", (n, k), weight, _padded(scale.float(), 0.0), bias=bias)


def from_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
              bias: torch.Tensor | None = None, alloc: Allocator | None = None) -> CpuMatrix:
    """q int [N, K] in 0..15, scale and zero [N, K / group]: w = (q - 8) * scale + zero."""
    n, k = q.shape
    groups = k // group
    halves = _padded(q.to(torch.uint8), 8).view(-1, TILE, groups, group // 8, 2, 4)
    packed = halves[..., 0, :] | (halves[..., 1, :] << 4)  # [N/16, 16, G, g/8, 4]
    nibbles = packed.permute(0, 2, 3, 1, 4).reshape(-1, groups, group // 2 * TILE)
    pair = torch.stack((_padded(scale.float(), 0.0), _padded(zero.float(), 0.0)), dim=1)  # [N', 2, G]
    scales = pair.view(-1, TILE, 2, groups).permute(0, 3, 2, 1).to(torch.bfloat16).contiguous()  # [N/16, G, 2, 16]
    weight = (alloc or huge_page_empty)((nibbles.shape[0], groups, q4_group_bytes(group)), torch.uint8)
    torch.cat((nibbles, scales.view(torch.uint8).view(-1, groups, 4 * TILE)), dim=2, out=weight)
    return CpuMatrix("int4", (n, k), weight.view(-1, groups * q4_group_bytes(group) // TILE), None, group, bias)


def _padded(t: torch.Tensor, fill: float) -> torch.Tensor:
    """t's rows followed by rows of `fill` up to a whole tile."""
    extra = -t.shape[0] % TILE
    return t if not extra else torch.cat((t, t.new_full((extra, *t.shape[1:]), fill)))


def dequantize(m: CpuMatrix) -> torch.Tensor:
    """The float [N, K] matrix the format stands for (fp32)."""
    n, k = m.shape
    if m.format in ("fp32", "bf16"):
        return m.weight.float()
    if m.format == "int8":
        assert m.scales is not None  # int8 carries its row scales
        tiles = m.weight.view(-1, k // 4, TILE, 4).transpose(1, 2).reshape(-1, k)[:n]
        return (tiles.to(torch.int16) - 128).float() * m.scales[:n, None]
    g, groups = m.group, k // m.group
    blocks = m.weight.view(-1, groups, q4_group_bytes(g))
    packed = blocks[..., : g // 2 * TILE].reshape(-1, groups, g // 8, TILE, 4).permute(0, 3, 1, 2, 4)
    q = torch.stack((packed & 15, packed >> 4), dim=4).reshape(-1, k)[:n].float()  # [N, K]
    pair = blocks[..., g // 2 * TILE :].contiguous().view(torch.bfloat16).view(-1, groups, 2, TILE).float()
    pair = pair.permute(0, 3, 2, 1).reshape(-1, 2, groups)[:n]  # [N, 2, G]
    scale, zero = pair[:, 0], pair[:, 1]
    return ((q.view(n, groups, g) - 8) * scale[..., None] + zero[..., None]).view(n, k)


def f32_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read activations: fp32 rows of unit stride (rows may be strided); x itself when it is."""
    return x if x.dtype == torch.float32 and x.stride(-1) == 1 else x.float().contiguous()


def matmul(x: torch.Tensor, m: CpuMatrix, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32; rows may be strided) @ m^T (+ bias) -> fp32 [M, N], written into `out` when given."""
    rows, (n, k) = x.shape[0], m.shape
    lib = cpu_kernels.library()
    if lib is None or not native_widths(m.format, k, m.group):
        y = F.linear(x.float(), dequantize(m), m.bias)
        return y if out is None else out.copy_(y)
    x = f32_rows(x)
    if out is None:
        out = torch.empty(rows, n)
    if lib.hs_linear(ctypes.byref(m.native()), x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), rows):
        raise MemoryError("native matmul: out of memory for its activation scratch")
    return out


def as_cpu_matrix(w: torch.Tensor | PackedMatrix) -> CpuMatrix | None:
    """A weight the engine already holds (a dense [N, K] tensor or a CPU-layout PackedMatrix), seen as the
    native kernels' matrix without a copy; None when the kernels cannot read it in place."""
    if isinstance(w, torch.Tensor):
        fmt = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(w.dtype)
        if fmt is None or w.device.type != "cpu" or w.dim() != 2 or not w.is_contiguous():
            return None
        matrix = CpuMatrix(fmt, (w.shape[0], w.shape[1]), w)
    elif w.on_cpu:
        matrix = w.cpu_matrix()
    else:
        return None
    return matrix if native_widths(matrix.format, matrix.shape[1], matrix.group) else None
