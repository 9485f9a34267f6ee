"""Prefetch hints from the predictor service, turned into prefetch plans (FineMoE / MoE-Infinity style).

The predictor link's thread `submit`s hints (request, iteration, target layer, experts, probabilities) as
they arrive; the decode loop's `plan(layer, ctx)` picks the ones for the step's requests and iterations
whose target layer lies `min_hops`..`max_hops` MoE layers ahead (wrapping into the next step), so the near
layers can be left to a local skip-gate. A hint arriving after its target layer ran is *late*; one for an
iteration the request has already finished is *stale*; both are counted and dropped. All shared state
sits behind one lock held for dictionary operations only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from services.engine.offload.prefetch.base import GuessTracker, Prefetcher, PrefetchRequest, targets
from services.engine.offload.stats import OffloadStats
from services.engine.step_context import StepContext

_MAX_TRACKED = 8192  # requests (and request iterations) remembered; the oldest are forgotten first


class HintLike(Protocol):  # predictor_pb2.Hint, or anything with these fields
    request_id: str
    iteration: int
    layer: int
    experts: Iterable[int]
    priorities: Iterable[float]


@dataclass
class HintStats(OffloadStats):
    """OffloadStats plus the hint path's own counters and any extra sources (the predictor link)."""

    hints_stale: int = 0
    sources: list[Callable[[], dict[str, float]]] = field(default_factory=list)

    def as_engine_stats(self) -> dict[str, float]:
        out = super().as_engine_stats()
        out["offload_hints_stale_total"] = float(self.hints_stale)
        for source in self.sources:
            out.update(source())
        return out


class HintPrefetcher(Prefetcher):
    name = "hints"

    def __init__(
        self,
        moe_layers: tuple[bool, ...],
        stats: OffloadStats | None = None,
        min_hops: int = 1,
        max_hops: int | None = None,
    ) -> None:
        self.moe_layers = moe_layers
        self.stats = stats if stats is not None else HintStats(len(moe_layers))
        self.min_hops = min_hops
        self.max_hops = max_hops or sum(moe_layers)
        self.last_layer = max(i for i, moe in enumerate(moe_layers) if moe)
        self._lock = threading.Lock()
        # (request, iteration) -> target layer -> (experts, probabilities)
        self._hints: dict[tuple[str, int], dict[int, tuple[list[int], list[float]]]] = {}
        self._progress: dict[str, tuple[int, int]] = {}  # request -> (iteration, last layer routed)
        self._closers: list[Callable[[], None]] = []
        # Calibration: the predictor's probabilities are scaled so that, on average, they match how often
        # its hinted experts were then routed to (the eviction policy weighs a prefetch by them).
        self.tracker: GuessTracker = GuessTracker(precision=0.5, mean_probability=0.5)

    # ---- the link's side ----
    def submit(self, hints: Iterable[HintLike]) -> tuple[int, int, int]:
        """Stores fresh hints; returns (accepted, late, stale)."""
        accepted = late = stale = 0
        with self._lock:
            for h in hints:
                progress = self._progress.get(h.request_id)
                if progress is not None and h.iteration < progress[0]:
                    stale += 1
                elif progress is not None and h.iteration == progress[0] and h.layer <= progress[1]:
                    late += 1
                else:
                    key = (h.request_id, h.iteration)
                    entry = self._hints.pop(key, None) or {}
                    entry[h.layer] = (list(h.experts), list(h.priorities))
                    self._hints[key] = entry  # re-inserted: newest last, so trimming drops the oldest
                    accepted += 1
            _trim(self._hints)
            s = self.stats
            s.hints_received += accepted + late + stale
            s.hints_late += late
            if isinstance(s, HintStats):
                s.hints_stale += stale
        return accepted, late, stale

    def add_closer(self, close: Callable[[], None]) -> None:
        self._closers.append(close)

    def close(self) -> None:
        """Stops what feeds this prefetcher (the predictor link); idempotent."""
        closers, self._closers = self._closers, []
        for close in closers:
            close()

    # ---- the decode loop's side ----
    def plan(self, layer: int, ctx: StepContext) -> list[PrefetchRequest]:
        miss: dict[tuple[int, int, bool], float] = {}  # P(no request needs it), across the batch
        hops_of: dict[tuple[int, int, bool], int] = {}
        with self._lock:
            for rid, it in zip(ctx.request_ids, ctx.iterations):
                self._progress[rid] = (it, layer)
            for hops, target, next_step in targets(layer, self.max_hops, self.moe_layers):
                if hops < self.min_hops:
                    continue
                for rid, it in zip(ctx.request_ids, ctx.iterations):
                    entry = self._hints.get((rid, it + int(next_step)))
                    hint = entry.get(target) if entry else None
                    if hint is None:
                        continue
                    for expert, p in zip(*hint):
                        key = (target, expert, next_step)
                        miss[key] = miss.get(key, 1.0) * (1.0 - min(max(p, 0.0), 1.0))
                        hops_of[key] = hops
        scale = self.tracker.precision / max(self.tracker.mean_probability, 1e-3)
        requests = []
        for (t, e, n), q in miss.items():
            p = 1.0 - q
            if not n:
                self.tracker.guess(t, e, p)
            requests.append(PrefetchRequest(t, e, p / hops_of[(t, e, n)], n, min(1.0, p * scale)))
        return requests

    def on_step_end(self, ctx: StepContext) -> None:
        self.tracker.step_end(ctx)
        with self._lock:
            for rid, it in zip(ctx.request_ids, ctx.iterations):
                self._progress.pop(rid, None)
                self._progress[rid] = (it, self.last_layer)  # re-inserted: trimming drops idle requests
                self._hints.pop((rid, it), None)  # used up (or too late now)
            _trim(self._progress)

    def pending(self) -> int:
        """Request iterations holding hints (tests, debugging)."""
        with self._lock:
            return len(self._hints)


def _trim(d: dict) -> None:
    while len(d) > _MAX_TRACKED:
        del d[next(iter(d))]
