"""oneDNN-prepacked linear layers for the CPU: the dense path's GEMMs in the layout oneDNN's kernels read.

On this class of CPU, MKL's fp32 GEMM reaches 30-95 GFLOP/s on our small shapes; oneDNN on a weight reordered
once at load time reaches 100-230 GFLOP/s from a few rows up (the 8000 x 256 LM head: 2.5x faster at 16 rows).
A single row is a matrix-vector product, bound by reading the weight: there MKL on the weight stored as
[in, out] (each input element scales one contiguous row) beats both oneDNN and MKL on [out, in], where each
output is a separate dot product. Measured on this session's AVX2 EPYC, cold, one row: the LM head 480 us
against oneDNN's 945 and 1000 on [out, in]; an expert's gate/up 122 against 231 and 166. So a packed layer
keeps its plain weight in that layout (`weight` is a transposed view of it: same values, F.linear's meaning
unchanged) and sends one row there; from two rows on every packed layer takes the packed kernel.

oneDNN builds (JIT-compiles) a kernel per input shape on first use, about 2 ms each, and caches 1024 of them;
MoE experts see a different row count nearly every step, so rows are padded up to a few dozen buckets
(`padded_rows`): every shape is built once (`warm_up`, at engine start) and stays cached.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from services.engine import cpu_kernels

# Up to this many rows the native kernel beats oneDNN on the demo model's q/k/v, o and LM head (32 rows: 82
# against 90 us, 40 against 51, 1368 against 1470; even at 48); see cpu_kernels.
NATIVE_MAX_ROWS = 32


def padded_rows(rows: int) -> int:
    """The row count oneDNN runs for `rows` rows: eight buckets per power of two past 8, so at most 12.5% of
    padding and 8 + 8 log2(max / 8) shapes (72 up to 2048 rows)."""
    if rows <= 8:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def bucket_floor(rows: int) -> int:
    """The largest padded row count (a bucket, padded to itself) not above `rows`."""
    if rows <= 8:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)
    return rows // step * step


def bucket_sizes(max_rows: int) -> list[int]:
    """Every padded row count up to max_rows' bucket: the shapes `warm_up` builds."""
    return sorted({padded_rows(r) for r in range(1, max_rows + 1)})


@functools.cache
def packing_supported(device: str, dtype: torch.dtype) -> bool:
    """oneDNN's linear runs here: CPU, fp32 (its bf16 kernels need AMX/AVX512-BF16 to pay off)."""
    if device != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.zeros(8, 8)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(4, 8), torch.ops.mkldnn._reorder_linear_weight(w, None),
                                           None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


def should_pack(device: str, dtype: torch.dtype) -> bool:
    """Pack when oneDNN runs here and torch's threads leave a core free. oneDNN parallelises every call, even
    one-row GEMMs; with a thread on every core, any other busy process stalls each call's barrier for a
    scheduler slice (measured: decode steps 8 -> 430 ms with 2 threads on 2 cores while another job ran). The
    serving core runs one core short (cpu_threads.core_threads); offline runs with every thread keep MKL."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return packing_supported(device, dtype) and torch.get_num_threads() < cores


class PackedLinear:
    """y = x @ weight.T + bias, with `weight` also prepacked for oneDNN when `pack` (see packing_supported)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None) if pack else None
        # Packed: the plain copy, for one row, stored [in, out] (no copy when it already is, as experts are).
        self.weight = weight.t().contiguous().t() if pack else weight
        self.bias = bias
        # The native kernel reads the [in, out] copy: fp32, widths in 16s (on one torch thread, per call).
        self.native = (pack and self.weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)
                       and cpu_kernels.widths_supported(*self.weight.t().shape))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= NATIVE_MAX_ROWS and self.native and cpu_kernels.usable(x):
            return cpu_kernels.linear(x, self.weight.t(), self.bias)
        if self.packed is None or rows == 1:
            return F.linear(x, self.weight, self.bias)
        padded = padded_rows(rows)
        if padded != rows:
            x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:rows]

    def warm_up(self, max_rows: int) -> None:
        """Builds oneDNN's kernel for every padded row count up to max_rows (cached per shape, not weight)."""
        if self.packed is None:
            return
        for rows in bucket_sizes(max_rows):
            self(self.weight.new_zeros(rows, self.weight.shape[1]))

    @property
    def extra_bytes(self) -> int:
        """Bytes the packed copy adds (the plain weight stays: per-expert views, the offload path, device_bytes)."""
        return 0 if self.packed is None else self.weight.numel() * self.weight.element_size()
