"""Native CPU kernels: every weight format's matmul and a MoE layer in one call on one thread pool
(`threadpool.c`, `matmul.c`, `rows.c` and its `rows_*.h` parts, `moe.c`; bf16, int8 and int4 at many rows on
Intel AMX tiles in `amx.c` and `amx_q4.c`; the formats and their Python side in `formats.py`, the calls that
run experts in `moe_calls.py`), fp32 paged decode attention (`attention.c`), RMSNorm and RoPE (`norm_rope.c`),
and a decode step's whole layer chaining them (`layer.c`, `decode_layer.py`).

Why: decode on a CPU is bound by reading weights, and torch's paths read them at a third of the memory's
bandwidth (weight-only int8/int4) or paid a dozen small ops per expert and layer; `attention.c` reads
each cached key and value once, in place. The older fp32 expert kernels (`expert_f32.c`: `moe_swiglu`, `expert_rows`) still
serve stacked experts whose widths the newer ones do not take and the offload path's gather and scatter.

The sources are compiled (`build.py`) at first use with the system C compiler (`$CC`, else `cc`), -O3 -march=native -fno-math-errno, into
a per-user cache keyed by the sources, flags and CPU; nothing to build at install time, no torch headers (a few
seconds). Without a compiler, or with HINTSERVE_CPU_KERNELS=0, `library()` is None and callers keep torch's
path. HINTSERVE_KERNEL_FLAGS (e.g. "-O3 -mavx2 -mfma -mno-avx512f -fno-math-errno") replaces the flags: to
build and check the loops of another instruction set than this CPU's best. Callers use the kernels when torch
runs one intra-op thread (`usable`): the pool then has the cores (`cpu_threads.apply_threads`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shlex
import threading
from collections.abc import Iterator

import torch

from services.engine.cpu_kernels.build import FLAG_SETS
from services.engine.cpu_kernels.build import SOURCES as SOURCES
from services.engine.cpu_kernels.build import build_library as build_library
from services.engine.cpu_kernels.build import cache_dir as cache_dir

_ROWS = 8  # expert_f32.c's ROWS: tokens per expert GEMM pass
_NT_ROWS = 4  # expert_f32.c's NT_ROWS: tokens per pass of expert_rows_f32

_swapped: ctypes.CDLL | None = None  # `swapped_in`'s build, while one runs


def library() -> ctypes.CDLL | None:
    """The built kernels, or None (disabled, no compiler, or the build failed: said once, in a warning)."""
    return _swapped or _default_library()


@functools.cache
def _default_library() -> ctypes.CDLL | None:
    if os.environ.get("HINTSERVE_CPU_KERNELS", "1") == "0":
        return None
    return build_library(flag_sets())


def flag_sets() -> tuple[list[str], ...]:
    """The compiler flags `library()` tries, in order: $HINTSERVE_KERNEL_FLAGS alone where set."""
    env = os.environ.get("HINTSERVE_KERNEL_FLAGS")
    return (shlex.split(env),) if env else FLAG_SETS


def forget_library() -> None:
    """Build again at the next `library()` call (after HINTSERVE_KERNEL_FLAGS or HINTSERVE_CPU_KERNELS changed)."""
    _default_library.cache_clear()


@contextlib.contextmanager
def swapped_in(lib: ctypes.CDLL) -> Iterator[None]:
    """Every caller of `library()` gets `lib` until the block ends: to time two builds of the kernels against
    each other in one process (`hintserve bench kernel-flags`). Not for serving: one build per process."""
    global _swapped
    before, _swapped = _swapped, lib
    try:
        yield
    finally:
        _swapped = before


def loaded() -> ctypes.CDLL:
    """The built kernels, for a caller that has checked they are there (usable(), library())."""
    lib = library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not built")
    return lib


def describe() -> str:
    """Which kernels run here, for the start-up line and hintserve doctor."""
    lib = library()
    if lib is None:
        return "native CPU kernels off (no compiler, a failed build or HINTSERVE_CPU_KERNELS=0): torch's path runs"
    from services.engine.cpu_kernels.formats import FORMAT_IDS  # formats imports this module

    amx_rows = {fmt: lib.hs_amx_rows(FORMAT_IDS[fmt]) for fmt in ("bf16", "int8", "int4")}
    amx = ", ".join(f"{fmt} from {rows} rows" for fmt, rows in amx_rows.items() if rows)
    return f"native CPU kernels: {lib.hs_isa().decode()} loops" + (f"; AMX tiles: {amx}" if amx else "")


def set_threads(threads: int) -> int:
    """The native kernels' pool size (the caller counts as one); returns the size in force (1 without them)."""
    lib = library()
    return 1 if lib is None else lib.hs_set_threads(threads)


def pool_threads() -> int | None:
    """The pool's size, or None without the kernels (torch then has every thread already)."""
    lib = library()
    return None if lib is None else lib.hs_threads()


_CONVERSIONS = {(torch.float32, torch.float32): 0, (torch.bfloat16, torch.float32): 1,
                (torch.float32, torch.bfloat16): 2}


def convert(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """src's values into `out` (contiguous, as many elements), fp32 and bf16 either way on the kernels' pool
    (convert.c says why not torch's), other dtypes by torch; returns out."""
    kind = _CONVERSIONS.get((src.dtype, out.dtype))
    lib = library()
    if kind is None or lib is None or not src.is_contiguous() or not out.is_contiguous() or src.numel() != out.numel():
        return out.copy_(src.reshape(out.shape))
    lib.hs_convert(src.data_ptr(), out.data_ptr(), src.numel(), kind)
    return out


def read_probe(buffer: torch.Tensor) -> int:
    """Reads `buffer` once on the pool, four streams a thread (bench host-kernels' bandwidth probe); returns
    the sum over its 64-byte lines of each line's four 8-byte lanes XORed with the next four, mod 2**64."""
    return loaded().hs_read_probe(buffer.data_ptr(), buffer.numel() * buffer.element_size())


def widths_supported(*widths: int) -> bool:
    """The kernels vectorise every row they loop over (hidden, intermediate, head size, GEMM K and N) in 16s."""
    return all(width % 16 == 0 for width in widths)


def usable(x: torch.Tensor, pool_is_host: bool = False) -> bool:
    """Whether the kernels run for activations `x`: fp32 on the CPU, the library built, and the cores theirs:
    torch on one thread (a CPU engine), or `pool_is_host` (a CUDA engine's host experts: its torch keeps its
    threads for its own few CPU ops, and the pool is sized for the host's math, cpu_threads.apply_threads)."""
    return (x.dtype == torch.float32 and x.is_cpu and (pool_is_host or torch.get_num_threads() == 1)
            and library() is not None)


class _Scratch(threading.local):
    """Grow-only work buffers, one set per thread: no allocation per call once the largest step has run."""

    def __init__(self) -> None:
        self.floats = torch.empty(0)
        self.ints = torch.empty(0, dtype=torch.int64)

    def get(self, floats: int, ints: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if self.floats.numel() < floats:
            self.floats = torch.empty(floats)
        if self.ints.numel() < ints:
            self.ints = torch.empty(ints, dtype=torch.int64)
        return self.floats, self.ints


_scratch = _Scratch()


def scratch(floats: int, ints: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's grow-only work buffers, at least `floats` fp32 and `ints` int64 (for one call's use)."""
    return _scratch.get(floats, ints)


def moe_swiglu(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor) -> torch.Tensor:
    """x [T, H] through each token's top-k experts (ids and weights [T, k]), summed: fused_moe's result.

    w13: [E, H, 2I], w2: [E, I, H], fp32 and contiguous (StackedExperts' layout)."""
    tokens, top_k = experts.shape
    num_experts, hidden, intermediate = w2.shape[0], w2.shape[2], w2.shape[1]
    x = x.contiguous()
    experts = experts.to(torch.int64).contiguous()  # no copy when already so (topk's)
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty(tokens, hidden)
    floats, ints = _scratch.get(_ROWS * (2 * hidden + 3 * intermediate), tokens * top_k)
    status = loaded().moe_swiglu_f32(
        x.data_ptr(), experts.data_ptr(), weights.data_ptr(), tokens, top_k, w13.data_ptr(), w2.data_ptr(),
        num_experts, hidden, intermediate, out.data_ptr(), floats.data_ptr(), ints.data_ptr())
    if status != 0:
        raise ValueError(f"expert id out of range 0..{num_experts - 1}")
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           scale: float) -> torch.Tensor:
    """q [B, Hq, D] (any row and head strides) against caches [Hkv, slots, D] -> [B, Hq, D]."""
    batch, q_heads, head_dim = q.shape
    kv_heads, slots, _ = k_cache.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()  # no copies when already so (the runner's)
    context_lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty(batch, q_heads, head_dim)
    status = loaded().paged_decode_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), slots,
        block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), block_size, batch, q_heads,
        kv_heads, head_dim, scale, out.data_ptr())
    if status == -1:
        raise ValueError("a context length or block id is outside the KV cache")
    if status:
        raise MemoryError("native decode attention: out of memory for its scores")
    return out


def linear(x: torch.Tensor, weight_in_out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight_in_out [K, N] (+ bias): a few rows, each pass of the weight serving 8 of them."""
    rows, (in_features, out_features) = x.shape[0], weight_in_out.shape
    x = x.contiguous()
    out = torch.empty(rows, out_features)
    loaded().linear_rows_f32(x.data_ptr(), weight_in_out.data_ptr(),
                              None if bias is None else bias.data_ptr(), out.data_ptr(), rows, in_features,
                              out_features)
    return out


def expert_rows(x: torch.Tensor, gate_up: torch.Tensor | None, down: torch.Tensor | None, out: torch.Tensor,
                count: int, start: int = 0, gather: torch.Tensor | None = None, scatter: torch.Tensor | None = None,
                route_weights: torch.Tensor | None = None) -> None:
    """One expert in torch's Linear layout (gate_up [2I, H], down [H, I], contiguous; None skips that half) on
    `count` rows: row i is x[gather[start + i]] (no gather: x[i]); its output is added into
    out[scatter[start + i]] times route_weights[start + i] (no scatter: written to out[i]). Index arrays int64,
    weights fp32, all contiguous, as are x's rows; bounds are the caller's (moe_forward's own grouping)."""
    if gate_up is not None:
        hidden, intermediate = gate_up.shape[1], gate_up.shape[0] // 2
    elif down is not None:
        hidden, intermediate = down.shape
    else:  # rows copied as they are: both widths the rows'
        hidden = intermediate = out.shape[1]
    floats, _ = _scratch.get(_NT_ROWS * (max(hidden, intermediate) + 3 * intermediate + hidden))
    loaded().expert_rows_f32(
        x.data_ptr(), x.stride(0), None if gather is None else gather.data_ptr() + 8 * start, count,
        None if gate_up is None else gate_up.data_ptr(), None if down is None else down.data_ptr(), hidden,
        intermediate, None if scatter is None else scatter.data_ptr() + 8 * start,
        None if route_weights is None else route_weights.data_ptr() + 4 * start, out.data_ptr(), floats.data_ptr())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, its RMS norm) in one pass; without residual, (x, norm of x)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    total = x if residual is None else torch.empty_like(x)
    add = None if residual is None else residual.contiguous().data_ptr()
    loaded().rms_norm_f32(x.data_ptr(), add, weight.data_ptr(), eps,
                           total.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
    return total, out


def rope_write_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                  sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, head_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
                  eps: float = 0.0) -> None:
    """Rotates qkv's q and k heads in place ([T, (Hq + 2 Hkv) * D], contiguous) and writes k and v to the
    caches at `slots`: apply_rope and write_kv in one pass. head_norms: (q_norm, k_norm) weights of [D] that
    RMS-normalise each head first (Qwen3), with `eps`."""
    positions = positions.to(torch.int64).contiguous()
    slots = slots.to(torch.int64).contiguous()
    q_norm, k_norm = head_norms if head_norms is not None else (None, None)
    status = loaded().rope_write_kv_f32(
        qkv.data_ptr(), qkv.shape[0], num_heads, num_kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
        cos.shape[0], positions.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.shape[1], None if q_norm is None else q_norm.data_ptr(),
        None if k_norm is None else k_norm.data_ptr(), eps)
    if status != 0:
        raise ValueError("a position or KV slot is outside the model's tables or the cache")
