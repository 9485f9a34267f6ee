"""The transfer engine: one worker owns the link; demand before prefetch, prefetch by priority, chunked.

A transfer moves one expert as a list of chunks (one per matrix). The worker copies one chunk per turn and
puts an unfinished transfer back in the queue, so a demand fetch that arrives waits at most one chunk.
Queued transfers can be promoted (prefetch -> demand) or cancelled (a stale prefetch) until they start.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from services.engine.offload.host_store import Key
from services.engine.offload.link import Link, ReadyEvent, precise_sleeps
from services.engine.offload.stats import OffloadStats


class TransferState(Enum):
    QUEUED = auto()  # in the heap (possibly with some chunks already copied)
    ACTIVE = auto()  # a chunk is being copied right now
    DONE = auto()
    CANCELLED = auto()


@dataclass(eq=False)
class Transfer:
    key: Key
    chunks: list[tuple[torch.Tensor, torch.Tensor]]  # (device destination, host source)
    event: ReadyEvent
    demand: bool
    priority: float
    target: tuple[int, int]  # (step, layer) it is needed by; a prefetch past it is stale
    fence: torch.cuda.Event | None = None
    state: TransferState = TransferState.QUEUED
    next_chunk: int = 0
    version: int = 0  # bumped on promotion; older heap entries are skipped
    chunk_offset: int = 0  # the layout's index of the first chunk moved (a split expert moves down only)
    repacks: list[Callable[[], None]] | None = None  # after each chunk's copy (offload/transcode.py); None: none
    nbytes: int = field(default=0)
    bytes_copied: int = 0  # of nbytes, by the chunks copied so far
    issued_at: float = 0.0  # perf_counter seconds when submitted
    copied_until: float = 0.0  # when its chunks copied so far land (an emulated link's clock; 0: unknown)

    def chunk_copied(self, nbytes: int, lands_at: float) -> bool:
        """Records a chunk of `nbytes` copied, landing at `lands_at`; True while chunks remain (queued again)."""
        self.next_chunk += 1
        self.bytes_copied += nbytes
        self.copied_until = lands_at
        more = self.next_chunk < len(self.chunks)
        self.state = TransferState.QUEUED if more else TransferState.DONE
        return more

    @property
    def share_left(self) -> float:
        """The share of its bytes still to copy: chunks differ in size (an expert's gate/up is two thirds)."""
        return 1.0 - self.bytes_copied / self.nbytes if self.nbytes else 0.0


class TransferEngine:
    def __init__(self, link: Link, stats: OffloadStats) -> None:
        self.link = link
        self.stats = stats
        self._heap: list[tuple[int, float, int, int, Transfer]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="hintserve-transfer", daemon=True)
        self._thread.start()

    def submit(self, transfer: Transfer) -> None:
        transfer.nbytes = sum(src.numel() * src.element_size() for _, src in transfer.chunks)
        transfer.issued_at = time.perf_counter()
        with self._cond:
            self._push(transfer)
            self._cond.notify()

    def promote(self, transfer: Transfer) -> None:
        """A prefetch the router now needs: move it to the demand class."""
        with self._cond:
            if transfer.demand or transfer.state in (TransferState.DONE, TransferState.CANCELLED):
                return
            transfer.demand = True
            transfer.version += 1
            if transfer.state is TransferState.QUEUED:
                self._push(transfer)
                self._cond.notify()

    def cancel(self, transfer: Transfer) -> bool:
        """Cancels a transfer that has not started; False if it is already running or done."""
        with self._cond:
            if transfer.state is not TransferState.QUEUED or transfer.next_chunk > 0:
                return False
            transfer.state = TransferState.CANCELLED
            return True

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()
        self.link.drained()  # copies still in flight read the host store, which may be freed next

    def _push(self, t: Transfer) -> None:
        heapq.heappush(self._heap, (0 if t.demand else 1, -t.priority, next(self._order), t.version, t))

    def _pop(self) -> Transfer | None:
        while self._heap:
            _, _, _, version, t = heapq.heappop(self._heap)
            if version == t.version and t.state is TransferState.QUEUED:
                return t
        return None

    def _run(self) -> None:
        self.link.bind_thread()
        precise_sleeps()  # an emulated link sleeps in wait_free until its last chunk would have landed
        while True:
            self.link.wait_free()
            with self._cond:
                transfer = self._pop()
                while transfer is None:
                    if self._stopped:
                        return
                    self._cond.wait()
                    transfer = self._pop()
                transfer.state = TransferState.ACTIVE
                dst, src = transfer.chunks[transfer.next_chunk]
                then = transfer.repacks[transfer.next_chunk] if transfer.repacks is not None else None
                demand = transfer.demand
            # The fence guards the slot's old contents: the first chunk waits for it, the others follow that one.
            fence = transfer.fence if transfer.next_chunk == 0 else None
            self.link.copy(dst, src, fence, issued_at=transfer.issued_at, then=then)
            nbytes = src.numel() * src.element_size()
            if demand:
                self.stats.bytes_demand += nbytes
            else:
                self.stats.bytes_prefetch += nbytes
            with self._cond:
                if transfer.chunk_copied(nbytes, self.link.busy_until):
                    self._push(transfer)  # give a newly arrived demand its turn between chunks
                    continue
            self.link.complete(transfer.event)
