"""The hybrid provider: the offloaded provider whose misses a placement may leave on the host, computed there
by a host executor, or split between host and device (offload/split_experts.py), plus experts pinned on the
device for the whole run (static placements)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from services.engine.expert_format import ExpertLayout
from services.engine.expert_provider import HostCompute, HostResult, HostSink, LayerPlan
from services.engine.offload.cost_model import PlacementCosts
from services.engine.offload.expert_cache import ExpertCache, Slot
from services.engine.offload.guess_ledger import GuessLedger
from services.engine.offload.host_store import ExpertStore, Key
from services.engine.offload.link import EmulatedLink
from services.engine.offload.placement import Placement
from services.engine.offload.prefetch.base import Prefetcher, PrefetchRequest
from services.engine.offload.prefetch_gate import PrefetchGate
from services.engine.offload.provider import Fence, OffloadedExpertProvider, PhaseRules
from services.engine.offload.split_experts import DownStaging
from services.engine.offload.stats import OffloadStats
from services.engine.offload.transfer_engine import Transfer, TransferEngine
from services.engine.step_context import StepContext

QUIET_AFTER_STEPS = 4  # decode steps without a miss before the per-step machinery stops


class HybridExpertProvider(OffloadedExpertProvider):
    def __init__(
        self, store: ExpertStore, cache: ExpertCache, transfers: TransferEngine, prefetchers: list[Prefetcher],
        rules: PhaseRules, stats: OffloadStats, *, executor: HostCompute, placement: Placement,
        pinned: Sequence[Key] = (), prefetch_floor: float = 0.0, prefetch_depth: int = 0, split_staging: int = 0,
        stream_slots: int = 2, fence: Fence | None = None, clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`executor` computes the host's experts and `placement` decides where each miss runs (collaborators,
        the engine's or the simulator's); `clock`: the provider's time (the simulator's own clock there): what
        the prefetch gate times a prefetcher's planning with, and what an in-flight transfer's landing is read
        against."""
        super().__init__(store, cache, transfers, prefetchers, rules, stats, stream_slots, fence)
        self.clock = clock
        self.prefetch_floor = prefetch_floor
        self.prefetch_depth = prefetch_depth  # prefetches on the link at once; 0: no limit
        self.executor = executor
        self.placement = placement
        self._tokens: dict[int, int] = {}
        self._host_only = False  # this layer's experts are all on the host
        self.costs: PlacementCosts | None = placement.costs  # measured prices; None for a host-only placement
        self.split_prices = placement.split_prices
        self.staging: DownStaging | None = None
        layout = store.layout
        if self.split_prices is not None and split_staging > 0 and isinstance(layout, ExpertLayout):
            # Only a dense expert splits (offload/split_experts.py): its down matrix is a plain slice.
            device = self.cache.storage[0].device if len(self.cache.slots) else "cpu"
            self.staging = DownStaging(layout, device, capacity=split_staging)
        self._split: dict[int, tuple[int, Transfer]] = {}  # this layer's split experts: staging buffer, down
        self._downs: dict[Key, torch.Tensor] = {}  # each expert's down matrix in the host store (views)
        self._hot_missing: list[Key] = []  # hot-set experts not cached, as of the last step end
        self.gate: PrefetchGate | None = None
        if self.costs is not None and prefetch_depth > 0:
            self.gate = PrefetchGate(self._saving_per_hit(self.costs),
                                     self._copy_cpu_seconds() + self._copy_dram_seconds(self.costs), clock=clock)
        self.ledger = GuessLedger()  # what the gate is told: who guessed what
        self._fetched_peak = 0  # most misses one layer of this step fetched whole
        # Quiet: the cache has held every expert decode asked for these last steps, so the per-step machinery
        # (prefetch planning and its gate, the hot-set fill and bookkeeping) has nothing to save; it stops until
        # a miss returns (the layer that misses turns it back on).
        self._clean_steps = 0  # decode steps in a row without a miss
        self._step_missed = False
        self._layer_missed = False  # set by _place_misses, each layer
        self.pinned = set(pinned)
        for key in pinned:
            self._pin_for_good(key)

    def begin_layer(
        self, layer: int, experts: list[int], ctx: StepContext, tokens: list[int] | None = None
    ) -> LayerPlan:
        gate = self.gate if not ctx.is_prefill and not self.quiet and self.gate is not None and self.gate.pays else None
        owed = self.ledger.settle(gate, self.cache, layer, experts) if gate is not None else []
        plan = super().begin_layer(layer, experts, ctx, tokens)
        self._host_only = not plan.device and not plan.split  # nothing for this thread to do beside the host's
        # A decode miss brings the machinery back from this layer on; a new prompt's prefill misses do not.
        if self._layer_missed and not ctx.is_prefill:
            self._step_missed = True
            self._clean_steps = 0
        if gate is not None:
            self.ledger.credit(gate, owed, plan.device)
        return plan

    @property
    def quiet(self) -> bool:
        return self.prefetch_depth > 0 and self._clean_steps >= QUIET_AFTER_STEPS

    def dispatched(self, layer: int, ctx: StepContext) -> None:
        self.executor.flush(wake=not self._host_only)  # the layer's host jobs in one hand-off, before any planning
        if self.quiet and not ctx.is_prefill:
            return
        super().dispatched(layer, ctx)
        self.ledger.asking = None  # the prefetchers asked in super() are done; the hot-set fill is nobody's guess
        if self._hot_missing and not ctx.is_prefill:
            self._fill_hot_set(layer, ctx)

    def _prefetch_started(self, slot: Slot, evicted: Slot | None) -> None:
        self.ledger.started(slot, evicted)

    def end_step(self, ctx: StepContext) -> None:
        if not ctx.is_prefill:
            self._clean_steps = 0 if self._step_missed else self._clean_steps + 1
            self._step_missed = False
            if self.quiet:
                self._close_step(ctx)
                self.stats.quiet_steps += 1
                return  # the hot set and the guesses' trackers keep their state until misses return
        if self.gate is not None and not ctx.is_prefill:
            # Slots beside the hot set: the link's prefetches while the gate asks for any, and the slots this
            # step's whole fetches streamed through (top-k at most: _issue_pending); the rest hold hot experts.
            fetches = min(self._fetched_peak, self.stream_slots)
            self.cache.eviction.reserve(max(self.prefetch_depth if self.gate.asking() else 0, fetches))
        self._fetched_peak = 0
        super().end_step(ctx)
        if self.prefetch_depth > 0:  # the hot set changes at step ends only
            hot = self.cache.eviction.hot
            self._hot_missing = [key for key in hot if self.cache.lookup(key) is None]

    def _holds_back(self, victim: Key | None) -> bool:
        """In decode, whole fetches stream through the slots beside the hot set: while this layer holds one
        of them (it frees once the layer has computed its expert; `get` then issues the next fetch), a demand
        waits for it rather than evict a hot expert, which the next step would miss. The link copies one
        expert at a time, so two such slots keep it busy. With none held, the fetch starts now."""
        hot = self.cache.eviction.hot
        if not hot or victim not in hot or self._ctx is None or self._ctx.is_prefill:
            return False
        return any(slot.key not in hot for slot in self._pinned)

    def _fill_hot_set(self, layer: int, ctx: StepContext) -> None:
        """Misses are computed on the host or split, so nothing would ever be cached: the link's remaining
        slack brings in the eviction policy's hot set (an online KTransformers), nearest layers first."""
        if self._link_room() <= 0:
            return
        self._hot_missing = [key for key in self._hot_missing if self.cache.lookup(key) is None]
        num_layers = len(self.stats.hits)
        requests = [
            PrefetchRequest(target, e, 1.0 / ((target - layer - 1) % num_layers + 1), next_step=target <= layer)
            for target, e in self._hot_missing
        ]
        if requests:
            self._issue_prefetches(requests, ctx)

    def _place_misses(
        self, layer: int, experts: list[int], tokens: list[int] | None, misses: list[int], inflight: list[int],
        ctx: StepContext,
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """An expert still on the link is weighed like a miss: a prefetch whose copy has not started costs
        the whole link time plus the queue ahead (it is taken off the link if the host computes it), one
        being copied costs what is left of it, which the host may still beat."""
        # Whether any of the layer's experts is not ready in the cache, for begin_layer (as the base class found
        # it: looking each one up again cost a quiet decode 2-3 us a layer).
        self._layer_missed = bool(misses or inflight)
        if not self._layer_missed:
            return misses, inflight, [], []
        unstarted, landing = [], {}
        now = self.clock()
        for e in inflight:
            transfer = self._transfer_of((layer, e))
            if transfer.next_chunk == 0:
                unstarted.append(e)
            elif self.costs is not None:  # the chunks copied land at copied_until; the bytes left follow
                left = self.costs.link * transfer.share_left
                landing[e] = max(0.0, transfer.copied_until - now) + left
        self._tokens.clear()
        self._tokens.update(zip(experts, tokens or [1] * len(experts)))
        started = [e for e in inflight if e not in unstarted]
        fetch, host, split = self.placement.place(
            misses + unstarted + started, self._tokens, ctx, self.executor.backlog_seconds(), self._link_backlog(),
            landing, self.staging.free if self.staging is not None else 0,
        )
        if not self.cache.slots:  # a budget the staging took whole: nothing can be fetched
            fetch, host = [], host + [e for e in fetch if e in misses]
        self._fetched_peak = max(self._fetched_peak, len(fetch))
        waiting = [e for e in inflight if e not in host and e not in split]
        for expert in host + split:
            if expert in unstarted:
                self._drop_unstarted((layer, expert))
            elif expert in started:
                self._unpin((layer, expert))  # lands for later use; this layer's fetches may need its slot
        return [e for e in fetch if e in misses], waiting, host, split

    def _fetch_down(self, key: Key) -> None:
        """A split expert's down matrix to a staging buffer, as a demand (it is needed this layer)."""
        staging = self._staging()
        index = staging.acquire()
        down = self._downs.get(key)
        if down is None:
            down = self._downs[key] = self.store.layout.chunks(self.store.buffers[key])[1]
        event = self.transfers.link.new_event()
        transfer = Transfer(key, [(staging.buffers[index], down)], event, True, float("inf"), (0, 0),
                            fence=staging.fences[index], chunk_offset=1)
        self.transfers.submit(transfer)
        self._split[key[1]] = (index, transfer)

    def _drop_unstarted(self, key: Key) -> None:
        """A prefetch the host computes instead: take it off the link, so it serves the next one."""
        slot = self.cache.lookup(key)
        if slot is None or slot.transfer is None or not self.transfers.cancel(slot.transfer):
            return
        self._unpin(key)
        self.cache.release(slot)
        self.stats.prefetches_cancelled += 1

    def _unpin(self, key: Key) -> None:
        slot = self.cache.lookup(key)
        assert slot is not None  # only this layer's pinned slots are unpinned
        slot.pins -= 1
        self._pinned.remove(slot)

    def _link_backlog(self) -> float:
        """What a demand fetch queues behind: demands still loading, and a prefetch chunk on the link (a
        demand overtakes queued prefetches, not the chunk being copied: half an expert on average)."""
        if self.costs is None:
            return 0.0
        demands = sum(1 for s in self.cache.slots if s.loading and s.transfer is not None and s.transfer.demand)
        prefetching = any(not t.event.is_ready() for t, _ in self._prefetches)
        return self.costs.link * (demands + 0.5 * prefetching)

    def _issue_prefetches(self, requests, ctx, limit: int | None = None) -> None:
        # With misses computed on the host, a prefetch pays only when it lands before its layer and is
        # used: leave the unlikely ones on the host, so the link serves the likely ones in time.
        if self.prefetch_floor > 0:
            requests = [r for r in requests if self._likely(r)]
        if self.prefetch_depth > 0:
            room = self._link_room()
            limit = room if limit is None else min(limit, room)
        super()._issue_prefetches(requests, ctx, limit)

    def _saving_per_hit(self, costs: PlacementCosts) -> float:
        """What a guess that lands saves on one token: the miss's cheapest other side, less the device."""
        miss = min(costs.host(1), self.placement.split_seconds(1))
        return max(0.0, miss - costs.device(1))

    def _copy_dram_seconds(self, costs: PlacementCosts) -> float:
        """The host's time one expert's copy takes from it: its bytes on the DRAM the host's math reads too (one
        DRAM, offload/memory_bus.py; the host's GEMV alone takes all of it), 0 where the DRAM is not modelled."""
        return 0.0 if costs.dram == float("inf") else costs.link_bytes / costs.dram

    def _copy_cpu_seconds(self) -> float:
        """Compute-side seconds one expert's transfer takes: the memcpy of an emulated link (the copy
        engine's DMA costs the cores nothing)."""
        if not isinstance(self.transfers.link, EmulatedLink) or not len(self.cache.slots):
            return 0.0
        src, dst = next(iter(self.store.buffers.values())), self.cache.storage[0]
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
        return best

    def _plan(self, prefetcher, layer: int, ctx: StepContext) -> list[PrefetchRequest]:
        if self.gate is None:
            return prefetcher.plan(layer, ctx)
        self.ledger.asking = id(prefetcher)
        is_new = lambda r: self.cache.lookup((r.layer, r.expert)) is None and self._likely(r)  # noqa: E731
        return self.gate.plan(prefetcher, layer, ctx, is_new, self._link_room())

    def _likely(self, request: PrefetchRequest) -> bool:
        return (1.0 if request.probability is None else request.probability) >= self.prefetch_floor

    def _link_room(self) -> int:
        """Prefetches the link may take now. Only its slack: a queue of prefetches delays every demand fetch
        and split expert and lands its tail too late, while the host computes what the link cannot bring."""
        return self.prefetch_depth - sum(1 for t, _ in self._prefetches if not t.event.is_ready())

    def _may_prefetch(self) -> bool:
        return self.prefetch_depth <= 0 or self._link_room() > 0  # a full link: no guessing either

    def host_forward(self, layer: int, expert: int, x: torch.Tensor, sink: HostSink | None = None) -> HostResult:
        return self.executor.submit(self.store.weights((layer, expert)), x, sink=sink)

    def host_activation(self, layer: int, expert: int, x: torch.Tensor) -> HostResult:
        # The longer half starts first: each side's clock runs from its submit, and the other's submit
        # takes tens of microseconds here.
        part, costs = self.split_prices, self.costs
        assert part is not None and costs is not None  # the placement splits only with split prices
        host_first = part.host * costs.host(x.shape[0]) >= part.link * costs.link
        if not host_first:
            self._fetch_down((layer, expert))
        job = self.executor.submit(self.store.weights((layer, expert)), x, activation=True, share=part.host)
        if host_first:
            self._fetch_down((layer, expert))
        return job

    def get_down(self, layer: int, expert: int) -> torch.Tensor:
        index, transfer = self._split[expert]
        self._wait_landed(transfer.event)
        return self._staging().down(index)

    def end_layer(self, layer: int, ctx: StepContext) -> None:
        super().end_layer(layer, ctx)
        if self._split:
            staging = self._staging()
            for index, _ in self._split.values():
                staging.release(index, self._fence() if self._fence is not None else None)
        self._split.clear()

    def _staging(self) -> DownStaging:
        assert self.staging is not None, "no staging: the placement splits no expert"
        return self.staging

    @property
    def device_bytes(self) -> int:
        return super().device_bytes + (self.staging.nbytes if self.staging is not None else 0)

    def close(self) -> None:
        super().close()
        self.executor.shutdown()

    def _pin_for_good(self, key: Key) -> None:
        slot = self.cache.fill_now(key, self.store.buffers[key])
        if slot is None:
            raise ValueError(f"{len(self.cache.slots)} expert slots cannot pin expert {key}")
        slot.pins = 1  # never released: not in the per-layer pin list
