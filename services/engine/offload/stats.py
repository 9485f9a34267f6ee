"""Offload counters, recorded in the hot loop as plain integers and floats, exported as engine stats."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OffloadStats:
    num_layers: int
    hits: list[int] = field(default_factory=list)  # resident when the router asked
    inflight_hits: list[int] = field(default_factory=list)  # already on the way (prefetched) when asked
    misses: list[int] = field(default_factory=list)
    bytes_demand: int = 0
    bytes_prefetch: int = 0
    bytes_wasted_prefetch: int = 0  # prefetched, then evicted or cancelled before any use
    blocking_seconds: float = 0.0  # compute waiting on the link
    prefetches_issued: int = 0
    prefetches_used: int = 0  # prefetched experts the router then asked for
    prefetches_cancelled: int = 0
    prefetches_declined: int = 0  # the eviction policy would not let the prefetch displace its victim
    evictions: int = 0
    slots_total: int = 0
    slots_occupied: int = 0
    peak_slots_in_use: int = 0  # pinned or loading at once (DuoServe's prefill residency)
    expert_bytes: int = 0
    peak_device_bytes: int = 0
    hints_received: int = 0
    hints_late: int = 0
    host_experts: int = 0  # expert computations the host executor ran (hybrid policies)
    host_tokens: int = 0  # tokens those computations covered
    host_split_experts: int = 0  # of those, gate/up halves of split experts (down computed on the device)
    host_busy_seconds: float = 0.0  # host executor busy time (emulated: the emulated host's)
    quiet_steps: int = 0  # decode steps a hybrid policy ran without its per-step machinery (no misses)

    def __post_init__(self) -> None:
        for name in ("hits", "inflight_hits", "misses"):
            if not getattr(self, name):
                setattr(self, name, [0] * self.num_layers)

    @property
    def accesses(self) -> int:
        return sum(self.hits) + sum(self.inflight_hits) + sum(self.misses)

    def hit_rate(self, count_inflight: bool = True) -> float:
        hits = sum(self.hits) + (sum(self.inflight_hits) if count_inflight else 0)
        return hits / self.accesses if self.accesses else 0.0

    def prefetch_precision(self) -> float:
        return self.prefetches_used / self.prefetches_issued if self.prefetches_issued else 0.0

    def prefetch_recall(self) -> float:
        return self.prefetches_used / self.accesses if self.accesses else 0.0

    def as_engine_stats(self) -> dict[str, float]:
        """Keys follow the engine-stats convention: `name` or `name{label="v"}`; `_total` marks counters."""
        out: dict[str, float] = {}
        for layer in range(self.num_layers):
            lbl = f'{{layer="{layer}"}}'
            out[f"offload_expert_hits_total{lbl}"] = float(self.hits[layer])
            out[f"offload_expert_inflight_hits_total{lbl}"] = float(self.inflight_hits[layer])
            out[f"offload_expert_misses_total{lbl}"] = float(self.misses[layer])
            queries = self.hits[layer] + self.inflight_hits[layer] + self.misses[layer]
            out[f"offload_expert_queries_total{lbl}"] = float(queries)
        for kind in ("demand", "prefetch", "wasted_prefetch"):
            out[f'offload_bytes_moved_total{{kind="{kind}"}}'] = float(getattr(self, f"bytes_{kind}"))
        out.update(
            offload_blocking_seconds_total=self.blocking_seconds,
            offload_prefetches_issued_total=float(self.prefetches_issued),
            offload_prefetches_used_total=float(self.prefetches_used),
            offload_prefetches_cancelled_total=float(self.prefetches_cancelled),
            offload_prefetches_declined_total=float(self.prefetches_declined),
            offload_evictions_total=float(self.evictions),
            offload_prefetch_precision=self.prefetch_precision(),
            offload_prefetch_recall=self.prefetch_recall(),
            offload_cache_slots=float(self.slots_total),
            offload_cache_slots_occupied=float(self.slots_occupied),
            offload_peak_slots_in_use=float(self.peak_slots_in_use),
            offload_peak_device_bytes=float(self.peak_device_bytes),
            offload_hints_received_total=float(self.hints_received),
            offload_hints_late_total=float(self.hints_late),
            offload_host_compute_experts_total=float(self.host_experts),
            offload_host_compute_tokens_total=float(self.host_tokens),
            offload_host_compute_split_experts_total=float(self.host_split_experts),
            offload_host_compute_busy_seconds_total=self.host_busy_seconds,
            offload_quiet_steps_total=float(self.quiet_steps),
        )
        return out
