"""Dense layers (attention projections, LM head) in any CPU weight format, through the native kernels.

A GGUF user picks the bytes every matrix of a model costs (F32, BF16, Q8_0, Q4_0); `--weight-dtype` does the
same for our non-expert matrices, as `--expert-dtype` does for the routed experts. The router, norms and the
embedding table stay in the run dtype (a lookup reads one row of the table; routing decides which experts
run, and llama.cpp's quantized files keep it in F32 too).
"""

from __future__ import annotations

import torch

from services.engine.cpu_kernels import formats

WEIGHT_DTYPES = ("auto", "fp32", "bf16", "int8", "int4")


class NativeLinear:
    """y = x @ W.T + bias, W packed into a CPU weight format once (the float original can then be dropped)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, group: int,
                 alloc: formats.Allocator | None = None) -> None:
        self.matrix = formats.pack(weight, fmt, group, bias, alloc)
        self.bias = self.matrix.bias
        # What callers that want the float values get: the fp32 matrix itself, else the dequantised values
        # on demand (`float_weight`); nothing else keeps a second copy.
        self.weight = self.matrix.weight if fmt == "fp32" else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = formats.matmul(x, self.matrix)  # fp32: the kernels accumulate and write fp32
        return y if y.dtype == x.dtype else y.to(x.dtype)  # a bf16 run keeps bf16 activations and KV cache

    def float_weight(self) -> torch.Tensor:
        return formats.dequantize(self.matrix)

    def warm_up(self, max_rows: int) -> None:
        """Nothing to build: the kernels take every row count as it comes."""

    @property
    def nbytes(self) -> int:
        return self.matrix.nbytes

    @property
    def extra_bytes(self) -> int:
        return 0


def dense_format(weight_dtype: str, run_dtype: torch.dtype) -> str:
    """The CPU weight format `--weight-dtype` names (auto: the run dtype's)."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"unknown weight dtype {weight_dtype!r}: use {', '.join(WEIGHT_DTYPES)}")
    if weight_dtype != "auto":
        return weight_dtype
    return "bf16" if run_dtype == torch.bfloat16 else "fp32"
