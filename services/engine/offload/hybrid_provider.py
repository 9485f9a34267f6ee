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
        self, *args, executor, placement: Placement, pinned: list[Key] = (), prefetch_floor: float = 0.0,
        prefetch_depth: int = 0, **kwargs
    ) -> None:  # type: ignore[assignment]
        super().__init__(*args, **kwargs)
        self.prefetch_floor = prefetch_floor
        self.prefetch_depth = prefetch_depth  # prefetches on the link at once; 0: no limit
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
        """An expert still on the link is weighed like a miss: a prefetch whose copy has not started costs
        the whole link time plus the queue ahead (it is taken off the link if the host computes it), one
        being copied costs what is left of it, which the host may still beat."""
        if not misses and not inflight:
            return misses, inflight, []
        link = getattr(self.placement, "costs", None)
        unstarted, landing = [], {}
        for e in inflight:
            transfer = self.cache.lookup((layer, e)).transfer  # type: ignore[union-attr]
            if transfer.next_chunk == 0:  # type: ignore[union-attr]
                unstarted.append(e)
            elif link is not None:
                landing[e] = link.link * (1.0 - transfer.next_chunk / len(transfer.chunks))  # type: ignore
        self._tokens.clear()
        self._tokens.update(zip(experts, tokens or [1] * len(experts)))
        started = [e for e in inflight if e not in unstarted]
        fetch, host = self.placement.split(
            misses + unstarted + started, self._tokens, ctx, self.executor.backlog_seconds(), self._link_backlog(),
            landing,
        )
        waiting = [e for e in inflight if e not in host]
        for expert in host:
            if expert in unstarted:
                self._drop_unstarted((layer, expert))
        return [e for e in fetch if e in misses], waiting, host

    def _drop_unstarted(self, key: Key) -> None:
        """A prefetch the host computes instead: take it off the link, so it serves the next one."""
        slot = self.cache.lookup(key)
        if slot is None or not self.transfers.cancel(slot.transfer):  # type: ignore[arg-type]
            return
        slot.pins -= 1
        self._pinned.remove(slot)
        self.cache.release(slot)
        self.stats.prefetches_cancelled += 1

    def _link_backlog(self) -> float:
        """What a demand fetch queues behind: demands still loading, and a prefetch chunk on the link (a
        demand overtakes queued prefetches, not the chunk being copied: half an expert on average)."""
        link = getattr(self.placement, "costs", None)
        if link is None:
            return 0.0
        demands = sum(1 for s in self.cache.slots if s.loading and s.transfer.demand)  # type: ignore[union-attr]
        prefetching = any(not t.event.is_ready() for t, _ in self._prefetches)
        return link.link * (demands + 0.5 * prefetching)

    def _issue_prefetches(self, requests, ctx, limit: int | None = None) -> None:
        # With misses computed on the host, a prefetch pays only when it lands before its layer and is
        # used: leave the unlikely ones on the host, so the link serves the likely ones in time.
        if self.prefetch_floor > 0:
            requests = [r for r in requests if (1.0 if r.probability is None else r.probability) >= self.prefetch_floor]
        if self.prefetch_depth > 0:
            # Only into the link's slack: a queue of prefetches delays every demand fetch and lands its tail
            # too late, while the host computes what the link cannot bring in time.
            room = self.prefetch_depth - sum(1 for t, _ in self._prefetches if not t.event.is_ready())
            limit = room if limit is None else min(limit, room)
        super()._issue_prefetches(requests, ctx, limit)

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
