"""One memory's bandwidth, shared by whatever reads it at the same time (the one-DRAM model).

A PCIe copy from pinned host memory reads the same DRAM the host's expert GEMVs read, so host expert math and
link copies running together cannot draw more than the DRAM gives; on the device, kernels and landing copies
share the device memory the same way. Each lane (the host executor, the copy engine) runs its jobs one at a
time, in order; a job moves `nbytes` and alone draws `cap` bytes/s (what it reaches alone); jobs running together
share the memory max-min fairly (none gets more than its cap, what one leaves the others share), so together
they never draw more than `capacity`. A fluid model on a virtual clock: finish times are projections from the
jobs known so far, and a job added later can only push them back.

One model for the simulator (virtual seconds: services/simulator/) and the emulated link and host (perf_counter
seconds: link.EmulatedLink, host_executor.HostExecutor).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

HOST_LANE = "host"  # the host executor's expert math
LINK_LANE = "link"  # the copy engine's reads of pinned host memory
_EPS = 1e-9  # bytes left below this share of a job count as done (float rounding)


# The emulated DRAM over what the emulated host's expert math draws alone: 1, as on the reference box (dual-channel
# DDR4: the GEMV's 75% of peak is all the DRAM gives its readers together); inf: the host and the link each with a
# memory of its own (what the emulation assumed before the one-DRAM model).
EMULATED_DRAM_OVER_HOST = 1.0


def emulated_dram(expert_bytes: float, host_seconds: float, link: float) -> float:
    """An emulated host's DRAM: EMULATED_DRAM_OVER_HOST x what its expert math draws alone (one expert of
    `expert_bytes` on one token, memory-bound), never less than the `link` alone draws (a host slowed by its
    cores, not by its memory)."""
    return max(EMULATED_DRAM_OVER_HOST * expert_bytes / host_seconds, link)


def fair_rates(capacity: float, caps: Sequence[float]) -> list[float]:
    """Max-min fair shares of `capacity` for streams that alone draw `caps`: the smallest demands are met first,
    the rest share what is left equally."""
    rates = [0.0] * len(caps)
    left = capacity
    order = sorted(range(len(caps)), key=caps.__getitem__)
    for i, index in enumerate(order):
        rates[index] = min(caps[index], left / (len(caps) - i))
        left -= rates[index]
    return rates


def contended_seconds(seconds: float, capacity: float, others: Sequence[float]) -> float:
    """A memory-bound kernel that alone draws all of `capacity` for `seconds`, while streams drawing `others`
    run beside it (the device's kernels while copies land in its memory)."""
    if not others or math.isinf(capacity):
        return seconds
    mine = fair_rates(capacity, [capacity, *others])[0]
    return seconds * capacity / mine


class BusJob:
    __slots__ = ("lane", "nbytes", "cap", "ready_at", "left", "done_at", "projected")

    def __init__(self, lane: str, nbytes: float, cap: float, ready_at: float) -> None:
        self.lane = lane
        self.nbytes = nbytes
        self.cap = cap  # bytes/s it draws alone
        self.ready_at = ready_at  # it may start then (or once its lane's previous job is done)
        self.left = nbytes
        self.done_at: float | None = None  # settled
        self.projected = math.inf  # finish time from the jobs known at the last projection

    def finished(self, at: float) -> None:
        self.done_at = at


class MemoryBus:
    """`capacity`: bytes/s the memory gives all readers together (the usable share of its peak)."""

    def __init__(self, capacity: float) -> None:
        if capacity <= 0:
            raise ValueError(f"memory bandwidth must be positive, got {capacity}")
        self.capacity = capacity
        self._lanes: dict[str, list[BusJob]] = {}
        self._now = 0.0  # settled up to here: the jobs' progress before it no longer changes
        self._stale = False  # a job was added since the last projection
        self._lock = threading.Lock()  # the emulated link and host add from their own threads

    def add(self, lane: str, nbytes: float, cap: float, at: float) -> BusJob:
        """A job of `lane` that may start at `at` (not before the jobs already added to the lane finish)."""
        if cap <= 0:
            raise ValueError(f"a job's bandwidth must be positive, got {cap}")
        with self._lock:
            at = max(at, self._now)  # the past is settled: a job added late starts now
            self._advance(self._lanes.values(), self._now, at)
            self._now = at
            job = BusJob(lane, max(nbytes, 1e-9), cap, at)  # a job of no bytes still takes its turn
            self._lanes.setdefault(lane, []).append(job)
            self._stale = True
            return job

    def finish(self, job: BusJob) -> float:
        """When `job` finishes, as far as the jobs added so far tell."""
        with self._lock:
            if job.done_at is not None:
                return job.done_at
            if self._stale:
                copies = [[_Copy(j) for j in lane] for lane in self._lanes.values()]
                self._advance(copies, self._now, math.inf)
                self._stale = False
            return job.projected

    def last(self, lane: str) -> BusJob | None:
        jobs = self._lanes.get(lane)
        return jobs[-1] if jobs else None

    def _advance(self, lanes, now: float, until: float) -> None:
        """Runs the lanes' heads from `now` to `until` (each lane a list of jobs, or of projection copies),
        max-min fair while several run; finished jobs leave their lane (settled jobs, or projection copies)."""
        lanes = [lane for lane in lanes if lane]
        while lanes and now < until:
            running = [lane[0] for lane in lanes if lane[0].ready_at <= now]
            arrival = min((lane[0].ready_at for lane in lanes if lane[0].ready_at > now), default=math.inf)
            if not running:
                now = min(arrival, until)
                continue
            rates = fair_rates(self.capacity, [job.cap for job in running])
            step = min(min(job.left / r for job, r in zip(running, rates)), arrival - now, until - now)
            now += step
            for job, rate in zip(running, rates):
                job.left -= rate * step
                if job.left <= _EPS * max(1.0, job.nbytes):
                    job.left = 0.0
                    job.finished(now)
            for lane in lanes:
                while lane and lane[0].left == 0.0:
                    lane.pop(0)
            lanes = [lane for lane in lanes if lane]


class _Copy:
    """A job's projection: advanced on a copy, so the settled state stays as it is."""

    __slots__ = ("job", "nbytes", "cap", "ready_at", "left")

    def __init__(self, job: BusJob) -> None:
        self.job, self.nbytes, self.cap, self.ready_at, self.left = job, job.nbytes, job.cap, job.ready_at, job.left

    def finished(self, at: float) -> None:
        self.job.projected = at
