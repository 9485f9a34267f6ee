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
    return _omp_threads() or max(1, (os.cpu_count() or 1) - 1)


def _omp_threads() -> int | None:
    """OMP_NUM_THREADS where it names a positive count, else None."""
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(omp) if omp.isdigit() and int(omp) > 0 else None


def host_threads(config: EngineConfig) -> int:
    """The kernels' pool on a CUDA engine whose host computes experts: one core fewer than a CPU engine's, as
    the thread that launches the device's kernels must not wait for a core behind a host job's workers
    (`--threads` or OMP_NUM_THREADS, when set, decide)."""
    return config.threads or _omp_threads() or max(1, core_threads() - 1)


def apply_threads(config: EngineConfig) -> None:
    """CPU compute threads, the same for `generate` (core on a thread) and `serve` (core process): the native
    kernels' pool gets them and torch runs one intra-op thread, so no two pools share the cores; without the
    kernels, torch gets them. A CUDA engine's CPU computes only a hybrid policy's host experts
    (offload/host_executor.py): the pool gets the threads for them and torch keeps its own for its few CPU ops
    (cpu_kernels.usable); other CUDA engines leave both as they are."""
    if config.device == "cpu":
        use_threads(config.threads or core_threads())
    elif _host_computes(config):
        cpu_kernels.set_threads(host_threads(config))


def compute_line(config: EngineConfig) -> str | None:
    """What a CPU engine computes with, or a CUDA engine's host experts, for its start-up line (None: a CUDA
    engine whose CPU computes no experts)."""
    if config.device == "cpu":
        return f"{cpu_kernels.describe()}, {config.threads or core_threads()} compute thread(s)"
    if _host_computes(config):
        return f"host experts on {cpu_kernels.describe()}, {host_threads(config)} thread(s)"
    return None


def _host_computes(config: EngineConfig) -> bool:
    """Whether the engine's policy computes experts on the host (a hybrid one)."""
    # Imported here: the policies import the models, which import this module.
    from services.engine.offload.policies import get_policy

    return get_policy(config.offload_policy).placement != "device"


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
