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
    def __init__(self, *args, executor, placement: Placement, pinned: list[Key] = (), **kwargs) -> None:  # type: ignore[assignment]
        super().__init__(*args, **kwargs)
        self.executor = executor
        self.placement = placement
        self._tokens: dict[int, int] = {}
        self.pinned = set(pinned)
        for key in pinned:
            self._pin_for_good(key)

    def _place_misses(
        self, layer: int, experts: list[int], tokens: list[int] | None, misses: list[int], ctx: StepContext
    ) -> tuple[list[int], list[int]]:
        if not misses:
            return misses, []
        self._tokens.clear()
        self._tokens.update(zip(experts, tokens or [1] * len(experts)))
        return self.placement.split(misses, self._tokens, ctx, self.executor.backlog_seconds())

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
