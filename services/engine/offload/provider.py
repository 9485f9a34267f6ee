"""The offloaded ExpertProvider: cache hits in place, early demand fetches, prefetch plans, phase rules."""

from __future__ import annotations

import ctypes
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.engine.expert_provider import CachedBatch, ExpertProvider, LayerPlan, StoredWeights
from services.engine.models.native_moe import NativeExperts
from services.engine.offload.eviction.base import EvictionPolicy
from services.engine.offload.expert_cache import ExpertCache, Slot
from services.engine.offload.host_store import ExpertStore, Key
from services.engine.offload.link import ReadyEvent
from services.engine.offload.prefetch.base import Prefetcher, PrefetchRequest
from services.engine.offload.resident_view import ResidentView
from services.engine.offload.stats import OffloadStats
from services.engine.offload.transfer_engine import Transfer, TransferEngine
from services.engine.step_context import StepContext

_DEMAND = float("inf")
Fence = Callable[[], torch.cuda.Event]  # CUDA: records a compute-stream event the link waits on before reusing a slot


@dataclass(frozen=True)
class PhaseRules:
    early_demand: bool = True  # ProMoE: queue every miss right after the router, compute resident ones first
    keep_cache: bool = True  # False: free each expert after use (HF Accelerate)
    stream_prefill: bool = False  # DuoServe: stream prefill experts through `stream_slots` slots
    prefetch_in_prefill: bool = False  # prefill touches nearly every expert; prefetching there mostly wastes


class OffloadedExpertProvider(ExpertProvider):
    """Weights returned by `get` stay valid until the next `get` or `end_layer` of the same layer."""

    def __init__(
        self,
        store: ExpertStore,
        cache: ExpertCache,
        transfers: TransferEngine,
        prefetchers: list[Prefetcher],
        rules: PhaseRules,
        stats: OffloadStats,
        stream_slots: int = 2,
        fence: Fence | None = None,
    ) -> None:
        self.store = store
        self.cache = cache
        self.transfers = transfers
        self.prefetchers = prefetchers
        self.rules = rules
        self.stats = stats
        self.stream_slots = stream_slots
        self._fence = fence  # CUDA: records a compute-stream event before a slot's contents are replaced
        self._layer = -1
        self._ctx: StepContext | None = None
        self._pinned: list[Slot] = []
        self._pending: deque[int] = deque()  # this layer's misses still without a slot
        self._demanded: set[int] = set()  # slot indices this layer fetched on demand and still holds
        self._depth: int | None = None
        self._current: list[Slot] = []  # what the layer computes now: `get`'s expert, or a cached batch
        experts_per_layer = 1 + max((e for _, e in store.buffers), default=-1)
        # Each expert id's slot in this layer's cached batch, -1 outside it (hs_moe's matrix_of).
        self._matrix_of = (ctypes.c_int64 * experts_per_layer)(*[-1] * experts_per_layer)
        self._batched: list[int] = []  # the expert ids set in _matrix_of
        self._prefetches: list[tuple[Transfer, Slot]] = []  # unused prefetches whose target is ahead
        # Only FineMoE's eviction reads router probabilities; skip the per-layer mean for the others.
        self._wants_router_probs = type(cache.eviction).on_layer_routed is not EvictionPolicy.on_layer_routed
        # Once the cache holds every expert (and keeps what it holds), the model computes as if resident.
        self.resident = ResidentView(cache, store.buffers.keys() if rules.keep_cache else (), stats.num_layers)
        self._seen_layers: set[int] = set()  # layers of this step that came through begin_layer

    # ---- the ExpertProvider protocol ----
    def begin_layer(
        self, layer: int, experts: list[int], ctx: StepContext, tokens: list[int] | None = None
    ) -> LayerPlan:
        self._layer, self._ctx = layer, ctx
        self._seen_layers.add(layer)
        self._expire_prefetches(ctx, layer)
        eviction = self.cache.eviction
        probs = ctx.router_probs.get(layer)
        if probs is not None and self._wants_router_probs:
            eviction.on_layer_routed(layer, probs.mean(dim=0).tolist(), ctx)
        self._depth = self.stream_slots if ctx.is_prefill and self.rules.stream_prefill else None
        hits, inflight, misses = [], [], []
        for expert in experts:
            key = (layer, expert)
            eviction.on_access(key, ctx)
            slot = self.cache.lookup(key)
            if slot is None:
                misses.append(expert)
                self.stats.misses[layer] += 1
                continue
            if slot.prefetched:
                slot.prefetched = slot.protected = False
                self.stats.prefetches_used += 1
            self._pin(slot)
            if slot.ready:
                hits.append(expert)
                self.stats.hits[layer] += 1
            else:
                inflight.append(expert)
                self.stats.inflight_hits[layer] += 1
        misses, inflight, host, split = self._place_misses(layer, experts, tokens, misses, inflight, ctx)
        for expert in inflight:
            self.transfers.promote(self._transfer_of((layer, expert)))
        self._pending = deque(misses)
        self._demanded.clear()
        if self.rules.early_demand:
            self._issue_pending()
        self._track_peak()
        return LayerPlan(hits + inflight + misses, host, split)

    def dispatched(self, layer: int, ctx: StepContext) -> None:
        if self.prefetchers and (self.rules.prefetch_in_prefill or not ctx.is_prefill) and self._may_prefetch():
            for prefetcher in self.prefetchers:
                self._issue_prefetches(self._plan(prefetcher, layer, ctx), ctx)
            self._track_peak()

    def get(self, layer: int, expert: int) -> StoredWeights:
        self._finish_current()
        slot = self.cache.lookup((layer, expert))
        if slot is None:
            if expert in self._pending:
                self._pending.remove(expert)
            slot = self._demand(expert)
        elif slot.pins == 0:  # landed after the router looked (a late prefetch)
            self._pin(slot)
        if self.rules.early_demand:
            self._issue_pending()
        self._current.append(slot)
        self._wait_landed(slot.event)
        return self.cache.weights(slot)

    def cached_batch(self, layer: int, experts: list[int], wait: bool = False) -> CachedBatch | None:
        # One call for the layer's hits, not two per expert: at a full cache on a 2-core Zen 4 guest every
        # offloaded policy ran 25-35% behind the resident engine, which makes this one call.
        slots = self.cache.native
        if slots is None or not self.rules.keep_cache:
            return None
        self._finish_current()
        if wait and self.rules.early_demand:
            self._issue_pending()  # into the slots the last batch freed
        matrix_of = self._matrix_of
        for expert in self._batched:
            matrix_of[expert] = -1
        batched = self._batched = []
        for expert in experts:
            slot = self.cache.lookup((layer, expert))
            if slot is None or not (slot.ready or wait):
                continue
            if expert in self._pending:  # a prefetch that took its slot after the router asked
                self._pending.remove(expert)
            if slot.pins == 0:  # landed after the router looked (a late prefetch)
                self._pin(slot)
            matrix_of[expert] = slot.index
            batched.append(expert)
            self._current.append(slot)
        for slot in self._current if wait else ():
            self._wait_landed(slot.event)
        return CachedBatch(batched, slots, matrix_of) if batched else None

    def _wait_landed(self, event: ReadyEvent | None) -> None:
        """Compute waits for a transfer; the time it stalls counts as blocking."""
        assert event is not None, "a slot the layer uses has been filled or is being filled"
        if event.is_ready():
            event.wait()  # CUDA: orders the compute stream after the copy
        else:
            start = time.perf_counter()
            event.wait()
            self.stats.blocking_seconds += time.perf_counter() - start

    def end_layer(self, layer: int, ctx: StepContext) -> None:
        self._finish_current()
        for slot in self._pinned:
            slot.pins = max(0, slot.pins - 1)
        self._pinned.clear()

    def native_experts(self, layer: int) -> NativeExperts | None:
        return self.resident.experts(layer)

    @property
    def native_epoch(self) -> int:
        return self.resident.epoch

    def end_step(self, ctx: StepContext) -> None:
        if self._close_step(ctx):
            return  # every expert cached: no eviction or guess has anything left to learn for
        self.cache.eviction.on_step_end(ctx)
        for prefetcher in self.prefetchers:
            prefetcher.on_step_end(ctx)

    def _close_step(self, ctx: StepContext) -> bool:
        """Every step's end: the slots gauge, the hits of the layers computed through the resident view, and
        the view's refresh; whether the whole step ran through it."""
        self.stats.slots_occupied = self.cache.num_occupied
        through_view = not self._seen_layers and self.resident.holding
        self.resident.count_hits(ctx, self._seen_layers, self.stats)
        self._seen_layers.clear()
        self.resident.refresh()
        return through_view

    def engine_stats(self) -> dict[str, float]:
        return self.stats.as_engine_stats()

    @property
    def device_bytes(self) -> int:
        return self.cache.nbytes

    def close(self) -> None:
        for prefetcher in self.prefetchers:  # e.g. the hint prefetcher's predictor link thread
            prefetcher.close()
        self.transfers.shutdown()

    def _place_misses(
        self, layer: int, experts: list[int], tokens: list[int] | None, misses: list[int], inflight: list[int],
        ctx: StepContext,
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """(misses to fetch, in-flight experts to wait for, experts to compute on the host, experts to split
        between the two): transfer-only policies fetch and wait for every one."""
        return misses, inflight, [], []

    # ---- demand ----
    def _pin(self, slot: Slot) -> None:
        slot.pins += 1
        self._pinned.append(slot)

    def _issue_pending(self) -> None:
        while self._pending and (self._depth is None or len(self._demanded) < self._depth):
            victim = self.cache.choose_victim(self._ctx, self._layer, include_protected=True)
            if (victim is None and not self.cache.has_free) or self._holds_back(victim):
                return
            self._demand(self._pending.popleft(), victim)

    def _holds_back(self, victim: Key | None) -> bool:
        """Whether the next demand waits for a slot this layer frees (`get` issues it then) rather than
        evict `victim` now."""
        return False

    def _demand(self, expert: int, victim: Key | None = None) -> Slot:
        key = (self._layer, expert)
        slot, evicted = self.cache.acquire(key, self._ctx, self._layer, include_protected=True, victim=victim)
        while slot is None:  # every slot is pinned or loading: take one back from the prefetches
            self._reclaim_prefetch_slot()
            slot, evicted = self.cache.acquire(key, self._ctx, self._layer, include_protected=True)
        self._account_eviction(evicted)
        self._start_transfer(slot, key, demand=True, priority=_DEMAND, target=(0, 0))
        self._pin(slot)
        self._demanded.add(slot.index)
        self._track_peak()
        return slot

    def _finish_current(self) -> None:
        if not self._current:
            return
        for slot in self._current:
            slot.pins = max(0, slot.pins - 1)
            self._pinned.remove(slot)
            self._demanded.discard(slot.index)
            if self._fence is not None:
                slot.fence = self._fence()
            if not self.rules.keep_cache and slot.pins == 0:
                self.cache.release(slot)
        self._current.clear()

    def _reclaim_prefetch_slot(self) -> None:
        loading = [s for s in self.cache.slots if s.key is not None and s.pins == 0 and s.loading]
        for slot in loading:
            if slot.transfer is not None and self.transfers.cancel(slot.transfer):
                self.cache.release(slot)
                self.stats.prefetches_cancelled += 1
                return
        if not loading:
            raise RuntimeError("expert cache too small: every slot is pinned by the current layer")
        event = loading[0].event
        assert event is not None  # a loading slot has its event
        event.synchronize()  # already on the link: let it land

    def _transfer_of(self, key: Key) -> Transfer:
        slot = self.cache.lookup(key)
        assert slot is not None and slot.transfer is not None, f"{key} is not on the link"
        return slot.transfer

    # ---- prefetch ----
    def _plan(self, prefetcher: Prefetcher, layer: int, ctx: StepContext) -> list[PrefetchRequest]:
        return prefetcher.plan(layer, ctx)

    def _may_prefetch(self) -> bool:
        """Whether to ask the prefetchers at all this layer (a hybrid policy skips them while its link is full)."""
        return True

    def _issue_prefetches(
        self, requests: list[PrefetchRequest], ctx: StepContext, limit: int | None = None
    ) -> None:
        """Starts transfers for the most urgent requests not cached yet, at most `limit` of them."""
        eviction = self.cache.eviction
        for req in sorted(requests, key=lambda r: -r.priority):
            key = (req.layer, req.expert)
            eviction.on_prediction(key, req.priority if req.probability is None else req.probability)
            if self.cache.lookup(key) is not None or (limit is not None and limit <= 0):
                continue
            # Leave room for this layer's own misses; never evict other protected prefetches.
            if self.cache.num_available(include_protected=False) <= len(self._pending):
                return
            victim = self.cache.choose_victim(ctx, self._layer, include_protected=False)
            if victim is not None and not eviction.admit(key, victim, ctx, self._layer):
                self.stats.prefetches_declined += 1
                continue
            slot, evicted = self.cache.acquire(key, ctx, self._layer, include_protected=False, victim=victim)
            if slot is None:
                return
            self._account_eviction(evicted)
            target = (ctx.step_index + int(req.next_step), req.layer)
            transfer = self._start_transfer(slot, key, demand=False, priority=req.priority, target=target)
            slot.prefetched = slot.protected = True
            self._prefetch_started(slot, evicted)
            self._prefetches.append((transfer, slot))
            self.stats.prefetches_issued += 1
            if limit is not None:
                limit -= 1

    def _prefetch_started(self, slot: Slot, evicted: Slot | None) -> None:
        """A prefetch took `slot`, evicting `evicted` (a hybrid provider weighs what that cost)."""

    def _expire_prefetches(self, ctx: StepContext, layer: int) -> None:
        """Prefetches whose target layer has passed: cancel if not started, else stop protecting them."""
        now = (ctx.step_index, layer)
        keep = []
        for transfer, slot in self._prefetches:
            if slot.transfer is not transfer or not slot.prefetched:
                continue  # used by the router, evicted, or the slot was reused
            if transfer.target >= now:
                keep.append((transfer, slot))
            elif self.transfers.cancel(transfer):
                self.cache.release(slot)
                self.stats.prefetches_cancelled += 1
            else:
                slot.protected = False  # a misprediction that stays cached until evicted
        self._prefetches = keep

    # ---- shared ----
    def _start_transfer(
        self, slot: Slot, key: Key, demand: bool, priority: float, target: tuple[int, int]
    ) -> Transfer:
        chunks, repacks = self.cache.transfer_chunks(slot, self.store.buffers[key])
        slot.event = self.transfers.link.new_event()
        transfer = Transfer(key, chunks, slot.event, demand, priority, target, fence=slot.fence, repacks=repacks)
        slot.transfer, slot.fence = transfer, None
        self.transfers.submit(transfer)
        return transfer

    def _account_eviction(self, evicted: Slot | None) -> None:
        if evicted is None:
            return
        self.stats.evictions += 1
        if evicted.prefetched:
            self.stats.bytes_wasted_prefetch += self.store.expert_bytes

    def _track_peak(self) -> None:
        in_use = len(self._pinned) + sum(1 for t, _ in self._prefetches if not t.event.is_ready())
        if in_use > self.stats.peak_slots_in_use:
            self.stats.peak_slots_in_use = in_use
