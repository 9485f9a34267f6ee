"""The hybrid provider: the offloaded provider whose misses a placement may leave on the host, computed there
by a host executor, plus experts pinned on the device for the whole run (static placements)."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from services.engine.offload.host_store import Key
from services.engine.offload.link import ReadyEvent
from services.engine.offload.placement import Placement
from services.engine.offload.provider import OffloadedExpertProvider
from services.engine.step_context import StepContext


class Landed(ReadyEvent):
    """A pinned expert copied at start-up, before serving."""

    def is_ready(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class HybridExpertProvider(OffloadedExpertProvider):
    def __init__(
        self, *args, executor, placement: Placement, pinned: list[Key] = (), prefetch_floor: float = 0.0, **kwargs
    ) -> None:  # type: ignore[assignment]
        super().__init__(*args, **kwargs)
        self.prefetch_floor = prefetch_floor
        self.executor = executor
        self.placement = placement
        self._tokens: dict[int, int] = {}
        self.pinned = set(pinned)
        for key in pinned:
            self._pin_for_good(key)

    def _place_misses(
        self, layer: int, experts: list[int], tokens: list[int] | None, misses: list[int], inflight: list[int],
        ctx: StepContext,
    ) -> tuple[list[int], list[int], list[int]]:
        """A prefetch whose copy has not started is a miss again (it keeps going, for later use): waiting for
        it costs the whole link time plus the queue ahead, so the placement weighs it like any miss."""
        unstarted = [e for e in inflight if self.cache.lookup((layer, e)).transfer.next_chunk == 0]  # type: ignore
        if not misses and not unstarted:
            return misses, inflight, []
        self._tokens.clear()
        self._tokens.update(zip(experts, tokens or [1] * len(experts)))
        fetch, host = self.placement.split(
            misses + unstarted, self._tokens, ctx, self.executor.backlog_seconds(), self._link_backlog()
        )
        waiting = [e for e in inflight if e not in host]
        return [e for e in fetch if e not in unstarted], waiting, host

    def _link_backlog(self) -> float:
        """What a demand fetch queues behind: demands still loading, and a prefetch chunk on the link (a
        demand overtakes queued prefetches, not the chunk being copied: half an expert on average)."""
        link = getattr(self.placement, "costs", None)
        if link is None:
            return 0.0
        demands = sum(1 for s in self.cache.slots if s.loading and s.transfer.demand)  # type: ignore[union-attr]
        prefetching = any(not t.event.is_ready() for t, _ in self._prefetches)
        return link.link * (demands + 0.5 * prefetching)

    def _issue_prefetches(self, requests, ctx) -> None:
        # With misses computed on the host, a prefetch pays only when it lands before its layer and is
        # used: leave the unlikely ones on the host, so the link serves the likely ones in time.
        if self.prefetch_floor > 0:
            requests = [r for r in requests if (1.0 if r.probability is None else r.probability) >= self.prefetch_floor]
        super()._issue_prefetches(requests, ctx)

    def host_forward(self, layer: int, expert: int, x: torch.Tensor) -> Future[torch.Tensor]:
        return self.executor.submit(self.store.weights((layer, expert)), x)

    def close(self) -> None:
        super().close()
        self.executor.shutdown()

    def _pin_for_good(self, key: Key) -> None:
        slot, _ = self.cache.acquire(key, None, -1, include_protected=True)
        if slot is None:
            raise ValueError(f"{len(self.cache.slots)} expert slots cannot pin expert {key}")
        self.cache.flat(slot).copy_(self.store.buffers[key])
        slot.event = Landed()
        slot.pins = 1  # never released: not in the per-layer pin list
