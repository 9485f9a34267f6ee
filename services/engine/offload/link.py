"""The host-to-device link: copies one chunk at a time and signals readiness to the compute side.

CPU-only machines use `EmulatedLink`: the copy runs on the transfer worker thread, and the transfer is ready
when it would have finished at the configured bandwidth, so transfers cost real wall-clock time and overlap
with compute exactly as a copy engine does on a GPU. The link keeps a virtual clock (`busy_until`) so many
small chunks add up to the right total despite sleep granularity, and a transfer's time starts when it was
issued (as the host executor's jobs do), not when the worker thread woke up to it. The thread that waits on
a transfer holds itself until the landing time (`hold_until`): a worker that slept until then and woke the
waiter arrived 70-110 us late here (measured), time a copy engine's event does not take.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from services.engine.offload.memory_bus import LINK_LANE, BusJob, MemoryBus

if TYPE_CHECKING:
    from services.engine.expert_provider import StoredWeights
    from services.engine.quant.layout import StoredLayout


class ReadyEvent(ABC):
    """Completion of one expert's transfer, as the compute side sees it."""

    @abstractmethod
    def is_ready(self) -> bool: ...

    @abstractmethod
    def wait(self) -> None:
        """Makes the compute side wait (CUDA: the compute stream waits on an event; no host sync)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Blocks the calling host thread until the transfer has landed."""


class Landed(ReadyEvent):
    """A pinned expert copied at start-up, before serving."""

    def is_ready(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class ThreadEvent(ReadyEvent):
    """Set by the transfer worker once the data is copied; ready from `ready_at()` on (an emulated link's
    landing time, a projection that may move later while the DRAM is shared; None: as soon as it is set)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._ready_at: Callable[[], float] | None = None
        # Once landed, for good: a job started later on the shared DRAM moves only what is still running, and
        # the projection cost a cache hit a few microseconds in every layer that asked (a full cache's decode).
        self._landed = False

    def set(self, ready_at: Callable[[], float] | None = None) -> None:
        self._ready_at = ready_at
        self._event.set()

    @property
    def ready_at(self) -> float:
        """perf_counter seconds it lands, as projected now (0: as soon as it is set)."""
        return 0.0 if self._ready_at is None else self._ready_at()

    def is_ready(self) -> bool:
        if not self._landed:
            self._landed = self._event.is_set() and time.perf_counter() >= self.ready_at
        return self._landed

    def wait(self) -> None:
        if self._landed:
            return
        self._event.wait()
        if self._ready_at is not None:
            hold_until_settled(self._ready_at)
        self._landed = True

    def synchronize(self) -> None:
        self.wait()


class Link(ABC):
    name: str

    def bind_thread(self) -> None:  # noqa: B027 - only a device link has a device to bind
        """Called first on the transfer worker thread: a CUDA link makes its device the thread's current one."""

    def drained(self) -> None:  # noqa: B027 - an emulated copy is done when copy() returns
        """Until every copy issued has landed (shutdown: the host memory they read may then be freed)."""

    def wait_free(self) -> None:  # noqa: B027 - a real copy engine queues; nothing to wait for
        """Blocks the transfer worker until the link can start another chunk (an emulated link is busy until
        its last chunk would have landed), so the worker picks the next chunk when a copy engine would."""

    @abstractmethod
    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, fence: torch.cuda.Event | None = None, *, issued_at: float = 0.0,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Copies one chunk (called on the transfer worker thread only); `fence`: CUDA, the compute stream's
        last use of `dst`'s old contents; `issued_at`: when its transfer was handed to the link (perf_counter
        seconds); `then`: work on the landed chunk, ordered after the copy (a repack, offload/transcode.py)."""

    @property
    def busy_until(self) -> float:
        """When the last chunk copied lands (perf_counter seconds), where the link knows; 0: unknown."""
        return 0.0

    @abstractmethod
    def new_event(self) -> ReadyEvent: ...

    @abstractmethod
    def complete(self, event: ReadyEvent) -> None:
        """Marks `event` done once every chunk copied so far has landed."""


class EmulatedLink(Link):
    """A link of `bytes_per_second`, emulated in wall-clock time on the worker thread. Its copies read the
    host's DRAM: `bus` (offload/memory_bus.py), shared with an emulated host's expert math where setup gives
    one; its own otherwise, with no one to share it."""

    name = "emulated"

    def __init__(self, bytes_per_second: float) -> None:
        if bytes_per_second <= 0:
            raise ValueError(f"link bandwidth must be positive, got {bytes_per_second}")
        self.bytes_per_second = bytes_per_second
        self.bus = MemoryBus(math.inf)
        self._last: BusJob | None = None  # the last chunk copied

    def wait_free(self) -> None:
        while (delay := self.busy_until - time.perf_counter()) > 0:  # a shared DRAM may push it back
            time.sleep(delay)

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, fence: torch.cuda.Event | None = None, *, issued_at: float = 0.0,
        then: Callable[[], None] | None = None,
    ) -> None:
        # A copy engine takes a transfer up when it is issued, or when its previous copy ends (the bus's lane
        # runs one chunk at a time): the worker thread's own wake-up (~70 us here) and its turn between chunks
        # are not the link's time. (`issued_at` 0: from now.)
        nbytes = src.numel() * src.element_size()
        self._last = self.bus.add(LINK_LANE, nbytes, self.bytes_per_second, issued_at or time.perf_counter())
        dst.copy_(src)
        if then is not None:
            then()

    @property
    def busy_until(self) -> float:
        """When the last chunk copied lands (perf_counter seconds), as far as the DRAM's readers so far tell."""
        return 0.0 if self._last is None else self.bus.finish(self._last)

    def new_event(self) -> ReadyEvent:
        return ThreadEvent()

    def complete(self, event: ReadyEvent) -> None:
        chunk, bus = self._last, self.bus
        assert isinstance(event, ThreadEvent) and chunk is not None  # its own event, after its chunks
        event.set(ready_at=lambda: bus.finish(chunk))


_PR_SET_TIMERSLACK = 29


def precise_sleeps() -> None:
    """This thread's sleeps end when asked, not up to Linux's default 50 us timer slack later (measured: a
    0.5 ms sleep overshot by 82 us, 34 with the slack at 1 ns): the emulated link and host hold each job by
    sleeping, and the overshoot would add to every price. Per thread; a no-op off Linux."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)


_SPIN_SECONDS = 1e-4  # a precise sleep overshoots by 35 us (median) to 95 us (worst of hundreds) here
_precise = threading.local()


def hold_until_settled(deadline: Callable[[], float]) -> None:
    """hold_until a deadline that may move later meanwhile (a projection on a shared memory: a job started
    while this one runs slows it)."""
    while (at := deadline()) > time.perf_counter():
        hold_until(at)


def hold_until(deadline: float) -> None:
    """Returns at `deadline` (perf_counter seconds), not later: sleeps until just before it, then spins. How
    an emulated job (a link transfer, a host expert) ends on the thread that waits for it."""
    remaining = deadline - time.perf_counter()
    if remaining <= 0:
        return
    if remaining > _SPIN_SECONDS:
        if not getattr(_precise, "set", False):
            precise_sleeps()
            _precise.set = True
        time.sleep(remaining - _SPIN_SECONDS)
    while time.perf_counter() < deadline:
        pass


# Weights an expert timing cycles through: more than a last-level cache holds, so each expert streams from
# memory as on a device (a GPU's L2 holds a sliver of one expert). Timed on one expert's weights over and over,
# the unit measured L2-hot math here: 1.6x (torch) to 2.5x (native kernel) faster than an expert of the
# resident engine, whose experts stream from DRAM, and the link and host priced that much too fast.
COLD_BYTES = 128 * 2**20


def emulation_unit(hidden: int, intermediate: int, dtype: torch.dtype, tokens: int = 1) -> float:
    """The unit --link-ratio and --host-ratio multiply: one expert's time on `tokens` tokens on the device
    path here, weights streamed from memory, the best of five medians (a busy moment must not inflate it),
    measured once per process, so that every engine of a process emulates the same link and host (a
    benchmark's policies, side by side)."""
    return _measured_unit(hidden, intermediate, dtype, tokens)


@functools.cache  # keyed on all four arguments as given: the link's call and the host's share one entry
def _measured_unit(hidden: int, intermediate: int, dtype: torch.dtype, tokens: int) -> float:
    return expert_compute_seconds(hidden, intermediate, dtype, 50, tokens, rounds=5)


def expert_compute_seconds(
    hidden: int, intermediate: int, dtype: torch.dtype, repeats: int = 200, tokens: int = 1, rounds: int = 1,
    pool_is_host: bool = False, layout: StoredLayout | None = None,
) -> float:
    """Median time of one expert's SwiGLU on `tokens` tokens on this machine, as the engine computes it
    (a host job's math, offload/host_executor.host_math: the native kernel where it runs; `pool_is_host` as
    a CUDA engine's host runs it), cycling through COLD_BYTES of experts, dense in `dtype` or stored in
    `layout` (a CUDA engine's host store: its quantized experts cost the host their own bytes); the best of
    `rounds` medians. The experts are built once: allocating them takes most of a round."""
    from services.engine.expert_provider import ExpertWeights
    from services.engine.offload.host_executor import host_math

    dense = ExpertWeights(torch.full((2 * intermediate, hidden), 0.01, dtype=dtype),
                          torch.full((hidden, intermediate), 0.01, dtype=dtype))
    experts: list[StoredWeights]
    if layout is None:
        count = max(2, -(-COLD_BYTES // dense.nbytes))
        experts = [ExpertWeights(dense.gate_up.clone(), dense.down.clone()) for _ in range(count)]
    else:
        flats = torch.empty(max(2, -(-COLD_BYTES // layout.nbytes)), layout.numel, dtype=layout.dtype)
        layout.pack(dense, flats[0])
        flats[1:] = flats[0]
        experts = [layout.views(flat) for flat in flats]
    x = torch.randn(tokens, hidden, dtype=dtype)
    for w in experts:
        host_math(w, x, False, pool_is_host)
    best = float("inf")
    for _ in range(rounds):
        samples = []
        for i in range(repeats):
            w = experts[i % len(experts)]
            start = time.perf_counter()
            host_math(w, x, False, pool_is_host)
            samples.append(time.perf_counter() - start)
        samples.sort()
        best = min(best, samples[len(samples) // 2])
    return best
