"""The device expert cache: a fixed pool of slots allocated once, a slot table, pins, eviction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.engine.expert_provider import StoredWeights
from services.engine.models.native_moe import NativeExperts
from services.engine.offload.eviction.base import EvictionPolicy
from services.engine.offload.host_store import Key
from services.engine.offload.link import Landed, ReadyEvent
from services.engine.quant.layout import StoredLayout
from services.engine.step_context import StepContext

if TYPE_CHECKING:
    from services.engine.offload.transcode import Repack, Transcoder
    from services.engine.offload.transfer_engine import Transfer


@dataclass(eq=False)
class Slot:
    index: int
    key: Key | None = None
    event: ReadyEvent | None = None  # set while (or after) its transfer runs
    transfer: Transfer | None = None  # the one that filled it
    pins: int = 0
    prefetched: bool = False  # filled by a prefetch that no router has asked for yet
    protected: bool = False  # an unused prefetch whose target layer has not passed: keep it (MoE-Infinity)
    fence: torch.cuda.Event | None = None  # CUDA: compute-stream event after the last use of the old contents

    @property
    def ready(self) -> bool:
        return self.event is not None and self.event.is_ready()

    @property
    def loading(self) -> bool:
        return self.event is not None and not self.event.is_ready()


class ExpertCache:
    def __init__(
        self, num_slots: int, layout: StoredLayout, dtype: torch.dtype, device: str, eviction: EvictionPolicy,
        transcoder: Transcoder | None = None,
    ) -> None:
        """`transcoder`: the host store keeps another layout than the slots' (offload/transcode.py)."""
        self.layout = layout
        self.transcoder = transcoder
        self.eviction = eviction
        self.storage = torch.empty(num_slots, layout.numel, dtype=dtype, device=device)
        self.slots = [Slot(i) for i in range(num_slots)]
        self._weights = [layout.views(self.storage[i]) for i in range(num_slots)]
        self._slot_of: dict[Key, Slot] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._native: NativeExperts | None = None
        self._native_built = False
        self.changes = 0  # slots (re)assigned or freed so far: what a view of the slots checks it is current with

    @property
    def native(self) -> NativeExperts | None:
        """Every slot's weights as the native kernels' matrices, slot i as matrix i (one MoE call computes a
        layer's cached experts in place); None off the CPU, without the kernels, or in a format they cannot read."""
        if not self._native_built:
            self._native_built = True
            if self.storage.device.type == "cpu" and self.slots:
                self._native = NativeExperts.build(self._weights)
        return self._native

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def has_free(self) -> bool:
        return bool(self._free)

    @property
    def num_occupied(self) -> int:
        return len(self._slot_of)

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def lookup(self, key: Key) -> Slot | None:
        return self._slot_of.get(key)

    def weights(self, slot: Slot) -> StoredWeights:
        return self._weights[slot.index]

    def flat(self, slot: Slot) -> torch.Tensor:
        return self.storage[slot.index]

    def transfer_chunks(self, slot: Slot, source: torch.Tensor
                        ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[Repack] | None]:
        """What carries `source` (the host store's buffer) into `slot`: (destination, source) chunks, one per
        matrix, and the repack after each where the two layouts differ (None: they are the same)."""
        if self.transcoder is not None:
            return self.transcoder.chunks(self.flat(slot), source)
        return list(zip(self.layout.chunks(self.flat(slot)), self.layout.chunks(source), strict=True)), None

    def evictable(self, include_protected: bool) -> list[Key]:
        """Resident, unpinned, fully loaded keys; protected prefetches only if `include_protected`."""
        return [
            key
            for key, s in self._slot_of.items()
            if s.pins == 0 and s.ready and (include_protected or not s.protected)
        ]

    def num_available(self, include_protected: bool) -> int:
        return len(self._free) + len(self.evictable(include_protected))

    def choose_victim(self, ctx: StepContext | None, layer_now: int, include_protected: bool) -> Key | None:
        """The key `acquire` would evict; None while a slot is free or nothing is evictable."""
        if self._free:
            return None
        candidates = self.evictable(include_protected)
        return self.eviction.victim(candidates, ctx, layer_now) if candidates else None

    def acquire(
        self, key: Key, ctx: StepContext | None, layer_now: int, include_protected: bool, victim: Key | None = None
    ) -> tuple[Slot | None, Slot | None]:
        """A slot for `key`: a free one, else `victim` or the eviction policy's choice.

        Returns (slot, evicted-slot copy)."""
        if self._free:
            slot = self.slots[self._free.pop()]
            evicted = None
        else:
            victim_key = victim or self.choose_victim(ctx, layer_now, include_protected)
            if victim_key is None:
                return None, None
            slot = self._slot_of.pop(victim_key)
            evicted = Slot(slot.index, victim_key, prefetched=slot.prefetched)
            self.eviction.on_evict(victim_key)
        self._reset(slot, key)
        self.changes += 1
        self._slot_of[key] = slot
        self.eviction.on_insert(key)
        return slot, evicted

    def fill_now(self, key: Key, source: torch.Tensor) -> Slot | None:
        """A free (or evictable) slot for `key`, filled from `source` in place and ready at once: start-up
        copies, which take no link; None when no slot can be had."""
        slot, _ = self.acquire(key, None, -1, include_protected=True)
        if slot is not None:
            if self.transcoder is not None:
                self.transcoder.fill(self.flat(slot), source)
            else:
                self.flat(slot).copy_(source)
            slot.event = Landed()
        return slot

    def release(self, slot: Slot) -> None:
        """Frees the slot entirely (cancelled transfer, or a policy that does not cache)."""
        if slot.key is not None and self._slot_of.get(slot.key) is slot:
            del self._slot_of[slot.key]
            self.eviction.on_evict(slot.key)
        transfer = slot.transfer
        if transfer is not None and transfer.next_chunk == 0 and slot.fence is None:
            # It took the fence over the old contents and never waited on it (cancelled before its first
            # chunk): the slot's next writer must, or it overwrites what the compute stream may still read.
            slot.fence = transfer.fence
        self._reset(slot, None)
        self.changes += 1
        self._free.append(slot.index)

    @staticmethod
    def _reset(slot: Slot, key: Key | None) -> None:
        slot.key, slot.event, slot.transfer, slot.pins = key, None, None, 0
        slot.prefetched = slot.protected = False
