"""The host expert executor: experts computed where they live, in host memory, on worker threads.

Each job calls `expert_forward` (the one entry point for any weight format) on the host copy of the weights
and the expert's token slice, so a host expert costs activations over the link, never weights. Workers use
the process's intra-op threads (torch's count is process-wide; the engine core sets it); torch releases the
GIL inside its ops, so host jobs overlap the device's compute of cached experts.

On a CPU-only machine the "device" and the host are the same cores, so the executor emulates the host the
way `EmulatedLink` emulates the link: the math is real, and the job is ready when the emulated host would
have finished it, `host_ratio` times the measured device time for the same work, on one virtual clock
(the host's memory bandwidth is one shared resource: a busy host queues work, whatever the thread count).
The thread that gathers the job holds itself until then (link.hold_until), as it does for a transfer: a
worker that slept until the finish and then handed the result over was 70-110 us late (measured).

On CUDA the rows leave the device from the submitting thread, into pinned memory, on the compute stream before
the layer's device experts are queued behind it (the worker only waits for that copy's event), and the output
goes back from pinned memory without a host sync on the compute thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from services.engine.expert_provider import ExpertWeights
from services.engine.models.moe import expert_activation, expert_forward
from services.engine.offload.link import hold_until
from services.engine.offload.stats import OffloadStats


class HostJob:
    """One host expert's output: there once its math is done and, emulated, its host time has passed."""

    __slots__ = ("_future", "ready_at")

    def __init__(self, future: Future[torch.Tensor], ready_at: float) -> None:
        self._future = future
        self.ready_at = ready_at  # perf_counter seconds; 0 on a real host

    def result(self) -> torch.Tensor:
        y = self._future.result()
        hold_until(self.ready_at)
        return y


class HostExecutor:
    def __init__(
        self, threads: int, stats: OffloadStats, emulated_seconds: Callable[[int], float] | None = None
    ) -> None:
        """`emulated_seconds(tokens)`: how long the emulated host takes for one expert; None: real host."""
        if threads < 1:
            raise ValueError(f"host_threads must be at least 1, got {threads}")
        self.stats = stats
        self._emulated_seconds = emulated_seconds
        # No torch.set_num_threads in the workers: it is process-wide, and set from a worker it left the
        # compute thread's small parallel ops (decode attention's softmax) taking milliseconds each.
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="hintserve-host")
        self._lock = threading.Lock()
        self._busy_until = 0.0  # emulation: when the virtual host finishes its queued work

    def submit(
        self, weights: ExpertWeights, x: torch.Tensor, activation: bool = False, share: float = 1.0
    ) -> HostJob:
        """The expert's output on x's device; `activation`: only its gate/up half (a split expert), which
        takes `share` of the whole expert's time."""
        self.stats.host_experts += 1
        self.stats.host_tokens += x.shape[0]
        self.stats.host_split_experts += activation
        finish = 0.0
        if self._emulated_seconds is not None:
            seconds = share * self._emulated_seconds(x.shape[0])
            with self._lock:
                start = max(time.perf_counter(), self._busy_until)
                self._busy_until = finish = start + seconds
            self.stats.host_busy_seconds += seconds
        staged, copied = x, None
        if x.is_cuda:
            staged = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            staged.copy_(x, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        job = self._pool.submit(self._run, weights, staged, copied, x.device, finish == 0.0, activation)
        return HostJob(job, finish)

    def backlog_seconds(self) -> float:
        """Emulated work queued ahead of a job submitted now (0 on a real host: not tracked)."""
        return max(0.0, self._busy_until - time.perf_counter())

    def _run(
        self, weights: ExpertWeights, x: torch.Tensor, copied: torch.cuda.Event | None, device: torch.device,
        real: bool, activation: bool,
    ) -> torch.Tensor:
        """`x` on the host (`copied`: the CUDA event its copy from the device records, or None)."""
        if copied is not None:
            copied.synchronize()
        start = time.perf_counter()
        y = expert_activation(x, weights.gate_up) if activation else expert_forward(x, weights)
        if real:
            self.stats.host_busy_seconds += time.perf_counter() - start
        if device.type != "cuda":
            return y
        # On the legacy default stream, which the compute thread's kernels share: ordered before what it
        # queues once it has the result.
        return y.pin_memory().to(device, non_blocking=True)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
