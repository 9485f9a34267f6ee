"""The memory-bandwidth yardstick of the kernel benchmarks: a STREAM-like read probe, the timing of a matrix cycled
from DRAM, and the two interleaved, so each share of the probe compares figures taken moments apart.

Why interleaved: on a shared host the two-thread probe here read 34 GB/s in one minute and 67 in the next (a
neighbour's load coming and going). Held against one probe before and one after a matrix's cases, a case timed in
the other phase read 57-63% or 110% of "the probe"; against the probes on either side of each of its slices, the
share is of the bandwidth the machine had while it ran.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine import cpu_kernels
from services.engine.cpu_threads import use_threads

SLICES = 5  # timed slices of a case, each between two probes; odd, so one slice is the median
SLICE_PROBE_REPEATS = 2  # each probe between slices: best of this many reads (after a warm one)


def last_level_cache_bytes() -> int:
    """The largest CPU cache sysfs reports (L3 here; 32 MiB when it reports none)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=32 << 20)


def bandwidth_probe(buffer: torch.Tensor, threads: int, repeats: int = 5) -> float:
    """GB/s of reading `buffer` at `threads` threads, the best of `repeats` (a read-only STREAM): torch's sum,
    or where the native kernels are built the better of it and their read over four streams a thread (torch's
    sum reads one: on a Zen 2 guest the kernels that read four outran it by a quarter). Leaves `threads`
    computing as cpu_threads.use_threads does: the kernels' pool with torch on one where they are built, else
    torch's own threads."""
    def best_of(read: Callable[[], object]) -> float:
        read()  # first touch and thread start-up stay out of the figure
        return min(_timed(read) for _ in range(repeats))

    torch.set_num_threads(threads)
    best = best_of(buffer.sum)
    if cpu_kernels.library() is not None:
        use_threads(threads)  # the kernels' pool at `threads`, torch on one
        best = min(best, best_of(lambda: cpu_kernels.read_probe(buffer)))
    return buffer.numel() * buffer.element_size() / best / 1e9


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_cycle(call: Callable[[torch.Tensor, object], object], weights: Sequence[object], x: torch.Tensor,
               min_seconds: float, warm: bool = True) -> float:
    """Seconds per call, cycling through `weights` (one warm pass first when `warm`); passes until `min_seconds`
    and at least three, median."""
    if warm:
        for w in weights:
            call(x, w)
    per_call: list[float] = []
    spent = 0.0
    while spent < min_seconds or len(per_call) < 3:
        start = time.perf_counter()
        for w in weights:
            call(x, w)
        elapsed = time.perf_counter() - start
        per_call.append(elapsed / len(weights))
        spent += elapsed
    return statistics.median(per_call)


@dataclass(frozen=True)
class Share:
    """One timed slice of a case: seconds a call, the probe it is held against (GB/s) and the share of it."""

    seconds: float
    probe_gb_per_s: float
    of_probe: float


def median_share(nbytes: int, seconds: Sequence[float], probes: Sequence[float]) -> tuple[Share, list[Share]]:
    """Slice i (`seconds[i]` a call, `nbytes` a call) against the better of the probes just before and after it
    (`probes[i]`, `probes[i + 1]`), and the slice of median share among them (an odd count: one of them)."""
    if len(probes) != len(seconds) + 1 or not seconds:
        raise ValueError("median_share: one probe before each slice and one after the last")
    slices = [Share(s, max(probes[i], probes[i + 1]), nbytes / s / 1e9 / max(probes[i], probes[i + 1]))
              for i, s in enumerate(seconds)]
    ranked = sorted(slices, key=lambda share: share.of_probe)
    return ranked[(len(ranked) - 1) // 2], slices


def time_against_probe(call: Callable[[torch.Tensor, object], object], weights: Sequence[object], x: torch.Tensor,
                       nbytes: int, min_seconds: float, buffer: torch.Tensor, threads: int,
                       slices: int = SLICES) -> tuple[Share, list[Share]]:
    """A case in `slices` slices of `min_seconds / slices`, a probe of `buffer` before each and after the last,
    all at `threads`: median_share's slice, and every slice."""
    probes = [bandwidth_probe(buffer, threads, SLICE_PROBE_REPEATS)]  # each leaves `threads` computing
    seconds = []
    for i in range(slices):
        seconds.append(time_cycle(call, weights, x, min_seconds / slices, warm=i == 0))
        probes.append(bandwidth_probe(buffer, threads, SLICE_PROBE_REPEATS))
    return median_share(nbytes, seconds, probes)
