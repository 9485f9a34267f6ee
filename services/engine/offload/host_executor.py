"""The host expert executor: experts computed where they live, in host memory, on worker threads.

Each job calls `expert_forward` (the one entry point for any weight format) on the host copy of the weights
and the expert's token slice, so a host expert costs activations over the link, never weights. Workers use
the process's intra-op threads (torch's count is process-wide; the engine core sets it); torch releases the
GIL inside its ops, so host jobs overlap the device's compute of cached experts.

On a CPU-only machine the "device" and the host are the same cores, so the executor emulates the host the
way `EmulatedLink` emulates the link: the math is real, and the job is ready when the emulated host would
have finished it, `host_ratio` times the measured device time for the same work alone, on the DRAM it
shares with the emulated link (offload/memory_bus.py: a busy host queues work, whatever the thread count, and
a copy running beside it slows it). The thread that gathers the job holds itself until then
(link.hold_until_settled), as it does for a transfer: a worker that slept until the finish and then handed
the result over was 70-110 us late (measured).

A layer's jobs are handed to the workers together (`flush`, called by the provider once the layer's host work
is submitted): one wake-up per worker and layer, not one per expert, and one signal back per worker and layer.
Each worker is a plain thread on a C-level SimpleQueue, and a job is a slotted object, not a Future with a
Condition of its own. The thread that gathers a job not yet started runs it itself (and the others queued
before it) rather than sleep until a worker has: it would only wait, and a worker's wake-up and the signal
back cost tens of microseconds a layer (offload/host_path.py measures the path; the pool with a Future per
job took ~50 us a layer at one token, this ~15). A job it runs itself goes through the job's sink where the
MoE layer gives one: straight into the layer's output by the native call its device experts take, not into
rows of its own that a second call then adds (a Zen 2 guest's host path at one token: 71 -> 38 us a layer;
13 once a one-token layer handed its experts the token itself instead of a gathered copy each).

On CUDA the rows leave the device from the submitting thread, into pinned memory, on the compute stream before
the layer's device experts are queued behind it (the worker only waits for that copy's event), and the output
goes back from pinned memory without a host sync on the compute thread. There a layer's whole experts of one
kind run in one native call on the kernels' pool (HostGroup), each job's output a slice of it.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from services.engine import cpu_kernels
from services.engine.cpu_kernels import moe_calls
from services.engine.expert_provider import HostSink, StoredWeights
from services.engine.models.moe import expert_activation, expert_forward, pooled_expert
from services.engine.offload.link import hold_until_settled
from services.engine.offload.memory_bus import HOST_LANE, BusJob, MemoryBus
from services.engine.offload.stats import OffloadStats


class HostJob:
    """One host expert's output: there once its math is done and, emulated, its host time has passed."""

    __slots__ = ("_value", "_error", "_done", "_in_place", "_executor", "_bus_job")

    def __init__(self, executor: HostExecutor, bus_job: BusJob | None) -> None:
        self._value: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._in_place = False  # its sink added it into the layer's output: no _value
        self._done = False  # set by the worker after _value, _in_place or _error
        self._executor = executor
        self._bus_job = bus_job  # emulated: its share of the DRAM; None on a real host

    @property
    def ready_at(self) -> float:
        """perf_counter seconds the emulated host finishes it (0 on a real host): a projection on the shared
        DRAM, which a copy the link starts later can push back."""
        bus = self._executor.bus
        return 0.0 if self._bus_job is None or bus is None else bus.finish(self._bus_job)

    def result(self) -> torch.Tensor | None:
        """The expert's output, or None when its sink added it into the layer's output."""
        self._executor.flush()  # gathered before its layer's hand-off (no provider flushed): hand it off now
        self._executor.wait(self)
        if self._error is not None:
            raise self._error
        if self._bus_job is not None:
            hold_until_settled(lambda: self.ready_at)
        assert self._value is not None or self._in_place  # done without an error
        return self._value


def host_math(weights: StoredWeights, x: torch.Tensor, activation: bool, pool_is_host: bool, pinned: bool = False
              ) -> torch.Tensor:
    """One host job's math: the whole expert, or (`activation`) a split one's gate/up half, in x's dtype. Where
    the kernels' pool is the host's, a bf16 device's rows are widened for them (exactly: bf16 is a prefix of
    fp32) and the result narrowed back: the native bf16 expert read 2.2 times torch's bf16 product per second
    (Qwen3 shape, one row, two threads, Zen 4 guest)."""
    widen = pool_is_host and x.dtype != torch.float32
    rows = cpu_kernels.convert(x, torch.empty(x.shape)) if widen else x
    if activation:
        assert isinstance(weights.gate_up, torch.Tensor)  # only a dense expert splits
        y = expert_activation(rows, weights.gate_up, pool_is_host)
    else:
        y = expert_forward(rows, weights, pool_is_host)
    if pool_is_host:
        return in_dtype(y, x.dtype, pinned)
    y = y if y.dtype == x.dtype else y.to(x.dtype)
    return y.pin_memory() if pinned else y


def in_dtype(y: torch.Tensor, dtype: torch.dtype, pinned: bool = False) -> torch.Tensor:
    """A host result in the device's dtype (`pinned`: in pinned memory, to copy to the device from), converted
    on the kernels' pool: torch's conversion of a prefill's rows left its intra-op threads spinning on the
    pool's cores (cpu_kernels/convert.c)."""
    if y.dtype == dtype and not pinned:
        return y
    return cpu_kernels.convert(y, torch.empty(y.shape, dtype=dtype, pin_memory=pinned))


class HostGroup:
    """A layer's jobs that one native call computes together (moe_calls.run_experts): whole experts of one kind,
    run for real on the kernels' pool where it is the host's (a CUDA engine's). One call streams all their
    weights in one parallel pass, where one call each split every expert over the pool's threads on its own:
    a decode layer's 8 experts (Qwen3 shape, one token) took 7-11% less time at two threads in int4, int8
    and bf16 and 4% less at one (Xeon guest, alternating), and there is one copy back instead of 8. A host
    with more threads than one expert has tiles for gains more."""

    __slots__ = ("items", "calls")

    def __init__(self, items: list[tuple], calls: list[moe_calls.ExpertCall]) -> None:
        self.items = items
        self.calls = calls


class HostExecutor:
    def __init__(
        self, threads: int, stats: OffloadStats, emulated_seconds: Callable[[int], float] | None = None,
        bus: MemoryBus | None = None, expert_bytes: float = 1.0, pool_is_host: bool = False,
    ) -> None:
        """`emulated_seconds(tokens)`: how long the emulated host takes for one expert alone on the DRAM (None: a
        real host), reading `expert_bytes` from `bus`, the DRAM it shares with the emulated link
        (offload/memory_bus.py; None: its own, shared with no one). `pool_is_host`: the native kernels' pool
        is this host's (a CUDA engine's: cpu_threads.apply_threads), so jobs take the kernels, on fp32 rows."""
        if threads < 1:
            raise ValueError(f"host_threads must be at least 1, got {threads}")
        self.stats = stats
        self.threads = threads
        self.bus = bus if bus is not None or emulated_seconds is None else MemoryBus(math.inf)
        self.expert_bytes = expert_bytes
        self._emulated_seconds = emulated_seconds
        self.pool_is_host = pool_is_host
        # No torch.set_num_threads in the workers: it is process-wide, and set from a worker it left the
        # compute thread's small parallel ops (decode attention's softmax) taking milliseconds each.
        self._pending: deque[tuple | HostGroup] = deque()  # jobs handed over, not yet claimed (popleft claims one, atomically)
        self._inboxes: list[queue.SimpleQueue[bool | None]] = [queue.SimpleQueue() for _ in range(threads)]
        self._finished: queue.SimpleQueue[None] = queue.SimpleQueue()  # a worker found nothing left to claim
        self._workers = [threading.Thread(target=self._work, args=(inbox,), name=f"hintserve-host-{i}", daemon=True)
                         for i, inbox in enumerate(self._inboxes)]
        for worker in self._workers:
            worker.start()
        self._batch: list[tuple] = []  # this layer's jobs, handed to the workers together by flush()
        # CUDA: the last rows copied to the host this layer, their pinned copy and its event (submit)
        self._staged: tuple[torch.Tensor, torch.Tensor, torch.cuda.Event] | None = None

    def submit(
        self, weights: StoredWeights, x: torch.Tensor, activation: bool = False, share: float = 1.0,
        sink: HostSink | None = None,
    ) -> HostJob:
        """The expert's output on x's device; `activation`: only its gate/up half (a split expert), which
        takes `share` of the whole expert's time. It starts at `flush` (the layer's one hand-off), on the
        emulated host's clock from now. `sink`: how the gathering thread, if it runs the job itself, adds it
        into the layer's output in place (host rows on the CPU only); a worker computes it into rows of its own."""
        self.stats.host_experts += 1
        self.stats.host_tokens += x.shape[0]
        self.stats.host_split_experts += activation
        bus_job = None
        if self._emulated_seconds is not None and self.bus is not None:  # an emulated host always has a bus
            seconds = share * self._emulated_seconds(x.shape[0])
            nbytes = share * self.expert_bytes
            bus_job = self.bus.add(HOST_LANE, nbytes, nbytes / seconds, time.perf_counter())
            self.stats.host_busy_seconds += seconds
        staged, copied = x, None
        if x.is_cuda:
            # One copy to the host per rows tensor and layer: a one-token layer hands each of its experts the
            # token itself, so its k host experts share one staged copy (and event) instead of k.
            last = self._staged
            if last is not None and last[0] is x:
                staged, copied = last[1], last[2]
            else:
                staged = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                staged.copy_(x, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(torch.cuda.current_stream(x.device))  # the copy's stream, whatever device is current
                self._staged = (x, staged, copied)
        job = HostJob(self, bus_job)
        self._batch.append((job, weights, staged, copied, x.device, bus_job is None, activation,
                            None if x.is_cuda else sink))
        return job

    def flush(self, wake: bool = True) -> None:
        """Hands the jobs submitted since the last flush to the workers: one hand-off per worker thread, not
        one per expert (each cost a thread wake-up; measured: offload/host_path.py). `wake` False: the caller
        has nothing to do meanwhile but gather them (a layer all on the host), so it runs them itself and no
        worker is woken: a wake-up and its signal back, and the GIL passed between two threads, took a 2-vCPU
        Xeon guest's host path at one token from 0-26 us to 150-210 us a layer, for no overlap."""
        self._staged = None  # the next layer's rows are new ones
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        pending: Sequence[tuple | HostGroup] = self._grouped(batch) if self.pool_is_host else batch
        while not self._finished.empty():  # signals of workers whose claimed jobs are all done: no one needs them
            self._finished.get_nowait()
        self._pending.extend(pending)
        if wake:
            for inbox in self._inboxes[: len(pending)]:
                inbox.put(True)

    def wait(self, job: HostJob) -> None:
        """Until `job` is done, on the one thread that gathers the host's results: it runs the jobs no worker
        has claimed yet, then sleeps until a worker is done with the rest."""
        while not job._done:
            try:
                self._execute(self._pending.popleft(), gathering=True)
            except IndexError:
                self._finished.get()  # a worker is done with what it claimed: perhaps this job

    def backlog_seconds(self) -> float:
        """Emulated work queued ahead of a job submitted now (0 on a real host: not tracked)."""
        bus = self.bus
        last = bus.last(HOST_LANE) if bus is not None else None
        return 0.0 if bus is None or last is None else max(0.0, bus.finish(last) - time.perf_counter())

    def _work(self, inbox: queue.SimpleQueue[bool | None]) -> None:
        while inbox.get() is not None:
            while True:
                try:
                    item = self._pending.popleft()
                except IndexError:
                    break
                self._execute(item)
            self._finished.put(None)

    def _grouped(self, batch: list[tuple]) -> list[tuple | HostGroup]:
        """The batch with its jobs that can share a native call merged, each group where its first job was."""
        items: list[tuple | HostGroup] = []
        groups: dict[tuple, HostGroup] = {}
        for item in batch:
            _, weights, x, _, device, real, activation, sink = item
            call = None
            if real and not activation and sink is None and x.device.type == "cpu" and cpu_kernels.library():
                call = pooled_expert(x, weights)
            if call is None:
                items.append(item)
                continue
            key = (call.kind, device, x.dtype)
            group = groups.get(key)
            if group is None:
                group = groups[key] = HostGroup([], [])
                items.append(group)
            group.items.append(item)
            group.calls.append(call)
        return [g.items[0] if isinstance(g, HostGroup) and len(g.items) == 1 else g for g in items]

    def _run_group(self, group: HostGroup) -> None:
        """A group's jobs in one native call, each its own rows' outputs (on its device, as _run's)."""
        items = group.items
        try:
            events = {id(item[3]): item[3] for item in items if item[3] is not None}
            for event in events.values():
                event.synchronize()
            start = time.perf_counter()
            rows = [item[2].shape[0] for item in items]
            x = torch.empty(sum(rows), items[0][2].shape[1])
            for item, part in zip(items, x.split(rows)):  # widened on the pool, as host_math's rows
                cpu_kernels.convert(item[2], part)
            y = moe_calls.run_experts(x, group.calls, rows)
            device = items[0][4]
            y = in_dtype(y, items[0][2].dtype, pinned=device.type == "cuda")
            self.stats.host_busy_seconds += time.perf_counter() - start
            if device.type == "cuda":  # one copy back for the group, each job a slice of it
                y = y.to(device, non_blocking=True)
            for item, part in zip(items, y.split(rows)):
                item[0]._value = part
        except BaseException as e:  # the MoE layer gathering each job re-raises
            for item in items:
                item[0]._error = e
        for item in items:
            item[0]._done = True

    def _execute(self, item: tuple | HostGroup, gathering: bool = False) -> None:
        """Runs one job: in place through its sink on the gathering thread (the one that writes the layer's
        output: no race), else into rows of its own; or a group of them in one call."""
        if isinstance(item, HostGroup):
            self._run_group(item)
            return
        job, weights, x, copied, device, real, activation, sink = item
        try:
            if gathering and sink is not None and self._sunk(sink, weights, real):
                job._in_place = True
            else:
                job._value = self._run(weights, x, copied, device, real, activation)
        except BaseException as e:  # the MoE layer gathering it re-raises
            job._error = e
        job._done = True

    def _sunk(self, sink: HostSink, weights: StoredWeights, real: bool) -> bool:
        start = time.perf_counter()
        if not sink(weights):
            return False
        if real:
            self.stats.host_busy_seconds += time.perf_counter() - start
        return True

    def _run(
        self, weights: StoredWeights, x: torch.Tensor, copied: torch.cuda.Event | None, device: torch.device,
        real: bool, activation: bool,
    ) -> torch.Tensor:
        """`x` on the host (`copied`: the CUDA event its copy from the device records, or None)."""
        if copied is not None:
            copied.synchronize()
        start = time.perf_counter()
        y = host_math(weights, x, activation, self.pool_is_host, pinned=device.type == "cuda")
        if real:
            self.stats.host_busy_seconds += time.perf_counter() - start
        if device.type != "cuda":
            return y
        # On the legacy default stream, which the compute thread's kernels share: ordered before what it
        # queues once it has the result.
        return y.to(device, non_blocking=True)

    def shutdown(self) -> None:
        self.flush()
        for inbox in self._inboxes:
            inbox.put(None)
        for worker in self._workers:
            worker.join()
