"""The expert cache seen as resident experts, once it holds every expert of the model.

Then nothing can miss, so nothing is fetched, evicted or planned, and the per-layer machinery of an offload
policy (lookups, pins, eviction bookkeeping, prefetch plans, the host hand-off) only costs time: on a 2-core
Zen 4 guest every offloaded policy decoded the int4 demo model 60% behind the resident engine at a cache that
held everything. The provider hands the model each layer's slots as resident native experts instead, and the
model computes as the resident engine does (a decode layer in one native call). The view is built at a step's
end and lapses the moment any slot is reassigned.

A cache with a slot for every expert is filled whole when the provider is built (`preload`), as a resident
engine loads its experts: waiting for each expert's first use would only spread those copies over the first
requests, as misses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from services.engine.models.native_moe import NativeExperts
from services.engine.offload.expert_cache import ExpertCache
from services.engine.offload.host_store import Key
from services.engine.offload.stats import OffloadStats
from services.engine.step_context import StepContext


class ResidentView:
    def __init__(self, cache: ExpertCache, keys: Iterable[Key], num_layers: int) -> None:
        self.cache = cache
        self.num_layers = num_layers
        self._keys: dict[int, list[Key]] = {}
        for layer, expert in sorted(keys):
            self._keys.setdefault(layer, []).append((layer, expert))
        self._total = sum(len(keys) for keys in self._keys.values())
        self._width = 1 + max((expert for _, expert in self._all_keys()), default=-1)
        self._layers: list[NativeExperts | None] | None = None
        self._built_at = -1  # cache.changes when the view was built
        self._epoch = 0  # bumped whenever the view starts or lapses

    @property
    def epoch(self) -> int:
        """What the model's own builds from the view follow: read before any of them, so it checks first."""
        self._current()
        return self._epoch

    @property
    def holding(self) -> bool:
        return self._current() is not None

    def experts(self, layer: int) -> NativeExperts | None:
        """Layer's experts in id order, read in place from their slots; None while the view does not hold."""
        layers = self._current()
        return None if layers is None else layers[layer]

    def refresh(self) -> None:
        """At a step's end: starts the view once every expert sits ready in the cache (and its slots can be
        read natively)."""
        cache = self.cache
        if self._current() is not None or self._total == 0 or cache.num_occupied < self._total or cache.native is None:
            return
        layers: list[NativeExperts | None] = [None] * self.num_layers
        for layer, keys in self._keys.items():
            slots = [cache.lookup(key) for key in keys]
            if any(slot is None or not slot.ready for slot in slots):
                return  # still landing (or held by a layer in flight): the next step's end looks again
            layers[layer] = NativeExperts.build([cache.weights(slot) for slot in slots if slot is not None])
            if layers[layer] is None:
                return
        self._layers, self._built_at = layers, cache.changes
        self._epoch += 1

    def preload(self, buffers: Mapping[Key, torch.Tensor]) -> bool:
        """Copies every expert not cached yet from `buffers` (the host store) into the cache, if it has a slot
        for each; whether it did. Load time, as pinned experts are: no link, no stats."""
        cache = self.cache
        if self._total == 0 or cache.num_slots < self._total:
            return False
        for key in self._all_keys():
            if cache.lookup(key) is None:
                slot = cache.fill_now(key, buffers[key])
                assert slot is not None  # a slot for every expert, and nothing pinned by a layer yet
        self.refresh()
        return True

    def count_hits(self, ctx: StepContext, seen: set[int], stats: OffloadStats) -> None:
        """Each layer the step routed past the provider (computed through the view) counts its distinct
        experts as hits, as the provider's own lookups would have."""
        layers = [layer for layer in ctx.selected_experts if layer not in seen]
        if not layers:
            return
        if ctx.num_tokens == 1:
            for layer in layers:
                stats.hits[layer] += ctx.selected_experts[layer].numel()
            return
        # One pass over every layer's ids, each layer's offset by its row of the table (a pruned prefill's
        # last layer routes fewer rows).
        chosen = torch.cat([ctx.selected_experts[layer].reshape(-1) + i * self._width for i, layer in enumerate(layers)])
        seen_at = torch.zeros(len(layers) * self._width, dtype=torch.bool).index_fill_(0, chosen, True)
        distinct = seen_at.view(len(layers), self._width).sum(1).tolist()
        for layer, n in zip(layers, distinct):
            stats.hits[layer] += n

    def _all_keys(self) -> Iterable[Key]:
        return (key for keys in self._keys.values() for key in keys)

    def _current(self) -> list[NativeExperts | None] | None:
        """The view's layers, after letting it lapse if any slot has changed since it was built."""
        if self._layers is not None and self.cache.changes != self._built_at:
            self._layers = None
            self._epoch += 1
        return self._layers
