"""Host memory allocator settings for a CPU engine process: large activations reused, not re-mapped each step.

glibc serves any allocation above its mmap threshold (128 KiB at start, raised adaptively) with a fresh mmap
and returns it on free, so every step's activations past that size (a 2048-token prefill's 2 MiB hidden
states, its expert rows, its attention scores) cost page faults and zeroing again, on every op. Measured on
the demo model, one thread: a 2048-token prefill 255 -> 190 ms, add + RMSNorm over [2048, 256] 800 -> 205 us.
Raising the threshold to glibc's maximum and never trimming the heap's top keeps those pages mapped and
reused, as tcmalloc or jemalloc (what vLLM's CPU docs preload) would. Other libcs are left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import os
from collections.abc import Iterator
from typing import cast

import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's ceiling on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD_BYTES = 1 << 30  # keep up to 1 GiB of freed heap top mapped
LOADING_MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's own starting threshold


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    except (OSError, AttributeError):  # musl, macOS: no mallopt
        return None
    return libc


def keep_large_allocations() -> bool:
    """glibc keeps freed allocations up to 32 MiB for reuse. False where libc is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    ok = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
          and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not ok:
        log.debug("mallopt refused the allocator settings; large allocations stay on mmap")
    return ok


@contextlib.contextmanager
def loading_weights() -> Iterator[None]:
    """Weights load with every block above 128 KiB on its own mmap, then the serving settings above apply.

    Why: loading makes a float copy of each matrix (and quantizing, a few more) between the weights it keeps;
    with a 32 MiB threshold those transients came from the heap, and the kept weights between them pinned
    their pages: an int4 Qwen3-shape checkpoint of 1.4 GB peaked at 4.3 GB RSS. A fixed threshold (which
    also stops glibc raising it as mapped blocks are freed) returns each transient as it is freed."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD_BYTES)
    try:
        yield
    finally:
        if libc is not None:
            libc.malloc_trim(0)
        keep_large_allocations()


HUGE_PAGE_BYTES = 2 << 20
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _why_not_advised() -> str:
    """Why huge_page_empty would not advise huge pages whatever the kernel's mode ("" when it would)."""
    if os.environ.get("THP_MEM_ALLOC_ENABLE") == "0":
        return "turned off by THP_MEM_ALLOC_ENABLE=0"
    return "" if hasattr(mmap, "MADV_HUGEPAGE") else "no madvise(MADV_HUGEPAGE) on this OS"


def huge_page_status(mode_file: str = THP_MODE_FILE) -> dict[str, str | bool | None]:
    """Whether the weights the kernels stream get huge pages here (hintserve doctor): the kernel's THP mode
    (the bracketed word of `mode_file`; None where there is none) and whether huge_page_empty advises them."""
    try:
        with open(mode_file) as f:
            text = f.read()
        mode: str | None = text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        mode = None
    why = _why_not_advised() or ("no transparent huge pages here" if mode is None
                                 else f"THP mode {mode!r}: weights stream on 4 KB pages" if mode == "never" else "")
    return {"mode": mode, "weights": not why, "why": why}


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor for weights the kernels stream, on fresh memory starting on a 2 MB boundary
    and advised for transparent huge pages before anything touches it.

    Why: torch's own huge-page allocations (services/__init__.py) start wherever glibc's mapping does, so only
    the 2 MB pages wholly inside an allocation can be huge, and memory reused from the heap keeps its small
    pages: a Qwen3-shape dense matrix of 4.5-5.6 MB came out a third to nine tenths huge. On a Zen 4 guest
    (one thread, one row, one process alternating the two placements) the same matrices streamed 2-19% faster
    all huge. Only whole 2 MB pages are advised, so the tail of a buffer costs no more than its bytes. Off
    where THP_MEM_ALLOC_ENABLE=0 or the OS has no madvise(MADV_HUGEPAGE): then plain torch.empty."""
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES or _why_not_advised():
        return torch.empty(shape, dtype=dtype)
    mapping, start = _mapping(nbytes)
    # The tensor holds the mapping (torch.frombuffer keeps its buffer alive); freeing the tensor unmaps it.
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start).view(dtype).view(shape)


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A fresh anonymous mapping with `nbytes` from a 2 MB boundary (the offset returned), its whole 2 MB pages
    advised huge where huge pages are advised at all."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(mapping)) % HUGE_PAGE_BYTES
    whole = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if whole and not _why_not_advised():
        with contextlib.suppress(OSError):  # a kernel without THP: small pages, as torch.empty's
            mapping.madvise(mmap.MADV_HUGEPAGE, start, whole)
            # With THP "always" the partial page after the last whole one would be huge too: kept small.
            mapping.madvise(mmap.MADV_NOHUGEPAGE, start + whole, len(mapping) - start - whole)
    return mapping, start


CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every device's context, not only the current one's


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor the device copies from directly (page-locked) and the host's kernels stream
    (huge pages): a fresh mapping of its bytes (to the page), registered with CUDA while any tensor holds it.

    Why not torch.empty(pin_memory=True): torch's pinned allocator rounds every allocation up to a power of two
    (the bins of its cache), so a Qwen3-30B-A3B bf16 expert of 9 MiB held 16 MiB of page-locked memory and a
    Mixtral-8x7B one of 336 MiB held 512; a whole layer in one buffer rounds the same way. Where registering
    fails, RuntimeError: the failure stays CUDA's last error, which torch's next kernel launch would raise as
    its own, so no fallback can run on."""
    nbytes = max(math.prod(shape) * dtype.itemsize, 1)
    mapping, start = _mapping(nbytes)
    registered = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages, as older drivers required
    # The tensors hold the registered bytes, which hold the mapping: the last tensor freed unregisters them
    # (_PinnedBytes.__del__), then the mapping is unmapped; a finalizer on the mapping would run after that.
    pinned_bytes = cast("type[ctypes.Array[ctypes.c_uint8]]",
                        type("_PinnedBytes", (ctypes.c_uint8 * registered,), {"__del__": _unregister}))
    pinned = pinned_bytes.from_buffer(mapping, start)  # the mapping has 2 MB to spare past nbytes
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostRegister(ctypes.addressof(pinned), registered, CUDA_HOST_REGISTER_PORTABLE)
    if int(status) != 0:
        raise RuntimeError(f"cannot page-lock {nbytes} bytes of host memory for the expert store "
                           f"(cudaHostRegister: {cudart.cudaGetErrorString(status)}); check `ulimit -l` and the "
                           "memory left beside the model")
    setattr(pinned, "registered", True)  # noqa: B010 - an attribute of the subclass made above, not of Array
    return torch.frombuffer(pinned, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def _unregister(pinned: ctypes.Array) -> None:
    if getattr(pinned, "registered", False):
        with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone before us
            torch.cuda.cudart().cudaHostUnregister(ctypes.addressof(pinned))


class HugePageArena:
    """Tensors handed out in turn from one huge_page_empty buffer sized up front: a model's dense matrices (or a
    benchmark's copies of one) packed together, so none has a tail on small pages of its own (a 5.6 MB int4
    q/k/v matrix on a mapping of its own is 2 huge pages and 1.6 MB of small ones)."""

    ALIGN = 64  # each tensor starts on a cache line

    def __init__(self, nbytes: int) -> None:
        self.buffer = huge_page_empty((nbytes,), torch.uint8)
        self.used = 0

    @classmethod
    def bytes_for(cls, sizes: list[int]) -> int:
        """Bytes an arena needs to hand out tensors of these byte sizes."""
        return sum(-(-size // cls.ALIGN) * cls.ALIGN for size in sizes)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of the next bytes; ValueError once the arena is spent."""
        nbytes = math.prod(shape) * dtype.itemsize
        end = self.used + -(-nbytes // self.ALIGN) * self.ALIGN
        if end > self.buffer.numel():
            raise ValueError(f"arena of {self.buffer.numel()} bytes cannot hold {nbytes} more after {self.used}")
        part = self.buffer[self.used : self.used + nbytes]
        self.used = end
        return part.view(dtype).view(shape)
