"""How many CPU threads compute, decided in one place for `generate` and `serve` alike."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from services.engine import cpu_kernels
from services.engine.config import EngineConfig


def core_threads() -> int:
    """Compute threads for the core: one core left to the frontend (HTTP, SSE, detokenisation), as vLLM's CPU
    worker does; OMP_NUM_THREADS, when set, decides."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.strip().isdigit() and int(omp) > 0:
        return int(omp)
    return max(1, (os.cpu_count() or 1) - 1)


def apply_threads(config: EngineConfig) -> None:
    """CPU compute threads, the same for `generate` (core on a thread) and `serve` (core process): the native
    kernels' pool gets them and torch runs one intra-op thread, so no two pools share the cores; without the
    kernels, torch gets them. CUDA engines leave both as they are (the host executor has its own workers)."""
    if config.device == "cpu":
        use_threads(config.threads or core_threads())


def compute_line(config: EngineConfig) -> str | None:
    """What a CPU engine computes with, for its start-up line (None on CUDA)."""
    if config.device != "cpu":
        return None
    return f"{cpu_kernels.describe()}, {config.threads or core_threads()} compute thread(s)"


def use_threads(threads: int) -> None:
    """`threads` compute: the native kernels' pool (torch then on one), else torch's intra-op threads."""
    if cpu_kernels.library() is not None:
        cpu_kernels.set_threads(threads)
        torch.set_num_threads(1)
    else:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op thread count (process-wide) at `threads` inside the block, restored after; None:
    left as it is."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
