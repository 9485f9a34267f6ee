"""Two overlapping timelines: compute (the clock the step loop advances) and the copy engine.

`SimTransferEngine` is the engine's TransferEngine without its worker thread: the same Transfer objects,
heap order (demand before prefetch, prefetch by priority, FIFO), one chunk per turn, promotion and
cancellation rules; only the chunks move on a simulated copy-engine timeline. The copy engine is advanced
lazily to the compute clock before anything looks at it, so every decision it takes at a chunk boundary
sees exactly the transfers submitted before that moment. Each chunk reads the host's DRAM, which the host's
expert math reads too (`bus`, offload/memory_bus.py): a chunk's end is its projection on that shared memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.engine.offload.link import Link, ReadyEvent
from services.engine.offload.memory_bus import LINK_LANE, BusJob, MemoryBus
from services.engine.offload.stats import OffloadStats
from services.engine.offload.transfer_engine import Transfer, TransferEngine, TransferState


class SimClock:
    """The compute timeline: `now` moves forward as the step loop prices work or stalls on a transfer."""

    def __init__(self) -> None:
        self.now = 0.0
        self.blocked = 0.0  # compute stalled on the link


class SimEvent(ReadyEvent):
    def __init__(self, engine: SimTransferEngine) -> None:
        self.engine = engine
        self.done_at: float | None = None  # when the transfer's last chunk landed

    def is_ready(self) -> bool:
        # Once set, done_at is never ahead of the compute clock: chunks only land up to now.
        if self.done_at is None:
            self.engine.advance()
        return self.done_at is not None

    def wait(self) -> None:
        self.engine.wait_for(self)

    def synchronize(self) -> None:
        self.engine.wait_for(self)


class SimLink(Link):
    """Moves no data: the provider's chunk tensors are placeholders, bytes come from the model spec."""

    name = "simulated"

    def __init__(self, bytes_per_second: float) -> None:
        if bytes_per_second <= 0:
            raise ValueError(f"link bandwidth must be positive, got {bytes_per_second}")
        self.bytes_per_second = bytes_per_second
        self.engine: SimTransferEngine | None = None

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, fence: torch.cuda.Event | None = None, *, issued_at: float = 0.0,
        then: Callable[[], None] | None = None,
    ) -> None:
        pass  # nothing moves: the simulator's chunks are sizes on its clock (and none is ever repacked)

    def new_event(self) -> ReadyEvent:
        assert self.engine is not None
        return SimEvent(self.engine)

    def complete(self, event: ReadyEvent) -> None:
        pass


class SimTransferEngine(TransferEngine):
    def __init__(
        self, link: SimLink, stats: OffloadStats, clock: SimClock, chunk_bytes: tuple[int, ...], bus: MemoryBus
    ) -> None:
        super().__init__(link, stats)
        TransferEngine.shutdown(self)  # no worker thread: chunks move on the simulated copy-engine timeline
        self.clock = clock
        self.sim_link = link  # the base class's `link`, with its simulated rate
        self.chunk_bytes = chunk_bytes
        self.bus = bus
        self.busy_seconds = 0.0
        self._free_at = 0.0  # when the copy engine finishes its current chunk (or went idle)
        self._active: tuple[Transfer, BusJob, bool, int] | None = None  # transfer, its chunk, demand, bytes
        link.engine = self

    # ---- TransferEngine's interface, each first bringing the copy engine up to the compute clock ----
    def submit(self, transfer: Transfer) -> None:
        self.advance()
        first = transfer.chunk_offset
        transfer.nbytes = sum(self.chunk_bytes[first : first + len(transfer.chunks)])
        with self._cond:
            self._push(transfer)

    def promote(self, transfer: Transfer) -> None:
        self.advance()
        super().promote(transfer)

    def cancel(self, transfer: Transfer) -> bool:
        self.advance()
        return super().cancel(transfer)

    def shutdown(self) -> None:
        pass

    # ---- the copy-engine timeline ----
    def busy(self) -> bool:
        """Whether a chunk is on the link now (landing in device memory)."""
        self.advance()
        return self._active is not None

    def advance(self, until: float | None = None) -> None:
        """Runs the copy engine up to `until` (default the compute clock's now; later only while compute
        stalls, so nothing is submitted before then)."""
        until = self.clock.now if until is None else until
        while True:
            if self._active is not None:
                if self.bus.finish(self._active[1]) > until:
                    return
                self._finish()
                continue
            transfer = self._pop()
            if transfer is None:
                self._free_at = max(self._free_at, until)  # idle: the next chunk starts when submitted
                return
            self._start(transfer)

    def wait_for(self, event: SimEvent) -> None:
        """Compute stalls until `event`'s transfer lands. Nothing is submitted meanwhile, so the copy engine
        may run ahead of the clock."""
        self.advance()
        while event.done_at is None:
            if self._active is not None:
                self._finish()
                continue
            transfer = self._pop()
            if transfer is None:
                raise RuntimeError("compute waits on a transfer the copy engine does not hold")
            self._start(transfer)
        if event.done_at > self.clock.now:
            self.clock.blocked += event.done_at - self.clock.now
            self.clock.now = event.done_at

    def _start(self, transfer: Transfer) -> None:
        nbytes = self.chunk_bytes[transfer.chunk_offset + transfer.next_chunk]
        transfer.state = TransferState.ACTIVE
        rate = self.sim_link.bytes_per_second
        self._active = (transfer, self.bus.add(LINK_LANE, nbytes, rate, self._free_at), transfer.demand, nbytes)

    def _finish(self) -> None:
        assert self._active is not None  # called while a chunk is on the link
        transfer, chunk, demand, nbytes = self._active
        self._active = None
        end = self.bus.finish(chunk)
        self.busy_seconds += end - chunk.ready_at
        self._free_at = end
        if demand:
            self.stats.bytes_demand += nbytes
        else:
            self.stats.bytes_prefetch += nbytes
        if transfer.chunk_copied(nbytes, end):
            self._push(transfer)  # a demand that arrived meanwhile goes first
        else:
            event = transfer.event
            assert isinstance(event, SimEvent)  # new_event's: every transfer here is simulated
            event.done_at = end
