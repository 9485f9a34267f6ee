"""The real link on CUDA: copies on a dedicated copy stream from pinned memory, readiness as CUDA events."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from services.engine.offload.link import Link, ReadyEvent

_MAX_CHUNKS_IN_FLIGHT = 2  # keeps the copy queue short so a demand fetch waits at most a chunk or two


class CudaEvent(ReadyEvent):
    def __init__(self, device_index: int) -> None:
        self.event = torch.cuda.Event()
        self.device_index = device_index
        self._recorded = threading.Event()  # the worker has enqueued every chunk and recorded `event`
        # Once landed, always landed: eviction asks every cached slot whether it is ready, and a query per
        # slot per miss took about a third of a real-shape forward on an H200 under a profiler (128 slots).
        self._landed = False

    def is_ready(self) -> bool:
        if not self._landed:
            self._landed = self._recorded.is_set() and self.event.query()
        return self._landed

    def wait(self) -> None:
        # Waiting on an unrecorded CUDA event is a no-op, so first wait (rarely) for the worker to enqueue;
        # then the compute stream waits on the copy stream's event: device-side ordering, no host sync.
        self._recorded.wait()
        if not self._landed:
            torch.cuda.current_stream(self.device_index).wait_event(self.event)

    def synchronize(self) -> None:
        self._recorded.wait()
        self.event.synchronize()
        self._landed = True


class CudaLink(Link):
    name = "native"

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        # An int: torch's stream lookups take it as is, where a bare "cuda" costs a device query each call.
        self.device_index = torch.cuda.current_device() if self.device.index is None else self.device.index
        self.copy_stream = torch.cuda.Stream(device=self.device_index)
        self._chunk_events: list[torch.cuda.Event] = []

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, fence: torch.cuda.Event | None = None, *, issued_at: float = 0.0,
        then: Callable[[], None] | None = None,
    ) -> None:
        with torch.cuda.stream(self.copy_stream):
            if fence is not None:  # the slot's previous contents must be consumed before we overwrite it
                self.copy_stream.wait_event(fence)
            dst.copy_(src, non_blocking=True)
            if then is not None:  # on the copy stream after the copy: the chunk's event covers it
                then()
            # Blocking: the worker's throttle below sleeps on it instead of spinning on a core the host's
            # kernels may need (a chunk of a large expert copies for milliseconds).
            done = torch.cuda.Event(blocking=True)
            done.record(self.copy_stream)
        self._chunk_events.append(done)
        if len(self._chunk_events) > _MAX_CHUNKS_IN_FLIGHT:
            self._chunk_events.pop(0).synchronize()  # worker thread only: throttles how far we enqueue ahead

    def bind_thread(self) -> None:
        # Without it the worker's current device is 0: leaving torch.cuda.stream(copy_stream) restores that
        # device's stream, which makes a context on GPU 0 for an engine on cuda:1.
        torch.cuda.set_device(self.device_index)

    def drained(self) -> None:
        self.copy_stream.synchronize()

    def new_event(self) -> ReadyEvent:
        return CudaEvent(self.device_index)

    def complete(self, event: ReadyEvent) -> None:
        assert isinstance(event, CudaEvent)
        event.event.record(self.copy_stream)
        event._recorded.set()

    def compute_fence(self) -> torch.cuda.Event:
        fence = torch.cuda.Event()
        fence.record(torch.cuda.current_stream(self.device_index))
        return fence
