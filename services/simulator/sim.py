"""The step loop: a workload's steps through one policy and cache size, priced on the compute timeline.

Per step and layer it does what the engine's decoder does (services/engine/models/model.py, moe.py):
the layer's attention and router cost compute time, the router's choices go into the StepContext, the
provider's begin_layer orders the experts (queuing demand fetches and prefetches), each expert's `get`
stalls the clock until its transfer has landed, then its compute is added; end_layer, end_step as there.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from services.engine.expert_provider import HostResult
from services.engine.offload.hybrid_provider import HybridExpertProvider
from services.engine.offload.memory_bus import contended_seconds
from services.engine.offload.policies import OffloadPolicy
from services.engine.offload.provider import OffloadedExpertProvider
from services.engine.step_context import Phase
from services.simulator.bound import Bound
from services.simulator.hardware import CostModel
from services.simulator.host import HOST_PATH_S
from services.simulator.host_timeline import token_slice
from services.simulator.policy_driver import SimOffload, build_offload
from services.simulator.timeline import SimClock
from services.simulator.workload import SimStep, Workload


@dataclass
class SimResult:
    policy: str
    cache_gb: float
    cache_slots: int
    ttft_ms: float | None  # None: the trace holds no prefill
    tpot_ms: float | None
    hit_rate: float  # decode
    prefill_hit_rate: float | None
    gb_moved_per_token: float  # decode, host -> device
    bytes_moved: int  # whole run
    bytes_demand: int
    bytes_prefetch: int
    blocking_ms_per_token: float  # decode: compute stalled on the link
    link_busy_share: float  # of the decode time, the copy engine was busy this much
    peak_memory_gb: float  # non-expert weights + expert slots in use at the peak + KV cache
    peak_expert_slots_in_use: int
    prefetch_precision: float
    decode_tokens: int
    host_experts_per_token: float = 0.0  # decode: experts computed on the host (hybrid policies)
    host_busy_share: float = 0.0  # of the decode time, the host computed experts this much
    bound_tpot_ms: float | None = None  # the physical bound of this configuration (simulator/bound.py)
    of_bound: float | None = None  # this run's decode speed as a share of the bound's (<= 1)
    static_bound_tpot_ms: float | None = None  # the best fixed placement's figure (not a bound)
    of_static_bound: float | None = None
    note: str = ""


@dataclass(frozen=True)
class Snapshot:
    now: float
    blocked: float
    link_busy: float
    hits: int
    accesses: int
    bytes_moved: int
    host_experts: int = 0
    host_busy: float = 0.0

    @classmethod
    def take(cls, clock: SimClock, offload: SimOffload | None) -> Snapshot:
        if offload is None:
            return cls(clock.now, clock.blocked, 0.0, 0, 0, 0)
        s = offload.provider.stats
        hits = sum(s.hits) + sum(s.inflight_hits)
        busy = offload.transfers.busy_seconds
        return cls(clock.now, clock.blocked, busy, hits, s.accesses, s.bytes_demand + s.bytes_prefetch,
                   s.host_experts, s.host_busy_seconds)


@dataclass
class PhaseTotals:
    seconds: float = 0.0
    steps: int = 0
    tokens: int = 0  # one per request and step
    accesses: int = 0
    hits: int = 0  # resident or already in flight when the router asked
    bytes_moved: int = 0
    blocked_seconds: float = 0.0
    link_busy_seconds: float = 0.0
    host_experts: int = 0
    host_busy_seconds: float = 0.0

    def add(self, tokens: int, a: Snapshot, b: Snapshot) -> None:
        self.steps += 1
        self.tokens += tokens
        self.seconds += b.now - a.now
        self.accesses += b.accesses - a.accesses
        self.hits += b.hits - a.hits
        self.bytes_moved += b.bytes_moved - a.bytes_moved
        self.blocked_seconds += b.blocked - a.blocked
        self.link_busy_seconds += b.link_busy - a.link_busy
        self.host_experts += b.host_experts - a.host_experts
        self.host_busy_seconds += b.host_busy - a.host_busy

    def hit_rate(self, resident: bool) -> float | None:
        if not self.steps:
            return None
        return 1.0 if resident else self.hits / max(1, self.accesses)


@dataclass
class RunLog:
    """What one run accumulates: per-phase totals, each request's token times, memory peaks."""

    totals: dict[Phase, PhaseTotals] = field(default_factory=lambda: {p: PhaseTotals() for p in Phase})
    admitted_at: dict[str, float] = field(default_factory=dict)
    first_token: dict[str, float] = field(default_factory=dict)
    last_token: dict[str, float] = field(default_factory=dict)
    tokens_out: dict[str, int] = field(default_factory=dict)
    peak_kv_tokens: int = 0
    peak_slots: int = 0  # expert slots holding or receiving an expert

    def record(self, step: SimStep, before: Snapshot, after: Snapshot) -> None:
        self.totals[step.phase].add(len(step.iterations), before, after)
        for it in step.iterations:  # every request of the step has a new token now
            self.first_token.setdefault(it.request_id, after.now)
            self.last_token[it.request_id] = after.now
            self.tokens_out[it.request_id] = self.tokens_out.get(it.request_id, 0) + 1

    def tpot_ms(self) -> float | None:
        out = [
            (self.last_token[r] - self.first_token[r]) / (n - 1) for r, n in self.tokens_out.items() if n > 1
        ]
        return statistics.mean(out) * 1e3 if out else None

    def ttft_ms(self) -> float | None:
        """First token after the request joined the batch (offline replay: no arrival times)."""
        out = [self.first_token[r] - self.admitted_at[r] for r in self.first_token if r in self.admitted_at]
        return statistics.mean(out) * 1e3 if out else None


def simulate(
    workload: Workload,
    policy: OffloadPolicy,
    cost: CostModel,
    cache_slots: int,
    trace_path: str,
    prefetch_distance: int | None = None,
    hint_latency_s: float = 2e-3,
    eviction: str | None = None,
    warmup_steps: int = 0,
    bounds: tuple[Bound, Bound] | None = None,
) -> SimResult:
    """One run; the first `warmup_steps` steps fill the cache and are left out of every figure. `bounds`:
    this configuration's (bound, static placement figure), simulator/bound.py."""
    spec = workload.spec
    clock = SimClock()
    resident = policy.name == "resident"
    slots = spec.num_experts * spec.num_moe_layers if resident else cache_slots
    offload = None
    if not resident:
        offload = build_offload(
            policy,
            workload,
            clock,
            cost.link_bytes_per_second,
            slots,
            trace_path,
            prefetch_distance,
            hint_latency_s,
            eviction,
            cost,
        )
    log = RunLog(peak_slots=slots if resident else 0)
    for step in workload.steps:
        for rid in step.admitted:
            log.admitted_at[rid] = clock.now
        before = Snapshot.take(clock, offload)
        _run_step(workload, step, cost, clock, offload, log)
        if step.index >= warmup_steps:
            log.record(step, before, Snapshot.take(clock, offload))
    result = _result(policy, workload, slots, log, offload)
    decode = log.totals[Phase.DECODE].seconds
    if bounds is not None and decode > 0:
        bound, static = bounds
        result.bound_tpot_ms, result.of_bound = bound.tpot_ms, bound.seconds / decode
        result.static_bound_tpot_ms, result.of_static_bound = static.tpot_ms, static.seconds / decode
    return result


def _run_step(
    workload: Workload,
    step: SimStep,
    cost: CostModel,
    clock: SimClock,
    offload: SimOffload | None,
    log: RunLog,
) -> None:
    spec = workload.spec
    provider = offload.provider if offload else None
    ctx = workload.context(step)
    if offload is not None:
        ctx.layer_observers = offload.layer_observers
    shape = step.shape
    log.peak_kv_tokens = max(log.peak_kv_tokens, shape.kv_tokens)
    device = functools.partial(_device_seconds, cost, offload, step.phase is Phase.DECODE)
    for layer in range(spec.num_layers):
        clock.now += device(cost.layer_seconds(layer, shape))
        if not spec.moe_layers[layer]:
            continue
        tokens_of = workload.route(step, layer, ctx)
        ctx.layer_routed(layer)
        if provider is None:
            clock.now += sum(cost.expert_seconds(n) for n in tokens_of.values())
            continue
        assert offload is not None  # it has the provider
        if offload.hint_link is not None:
            offload.hint_link.deliver()
        plan = provider.begin_layer(layer, list(tokens_of), ctx, list(tokens_of.values()))
        halves = [(e, provider.host_activation(layer, e, token_slice(tokens_of[e]))) for e in plan.split]
        on_host = [provider.host_forward(layer, e, token_slice(tokens_of[e])) for e in plan.host]
        provider.dispatched(layer, ctx)
        for expert in plan.device:
            log.peak_slots = max(log.peak_slots, provider.cache.num_occupied)
            provider.get(layer, expert)  # stalls the clock until the expert has landed
            clock.now += device(cost.expert_seconds(tokens_of[expert]))
        if on_host or halves:
            _gather_host(offload, provider, layer, halves, on_host, tokens_of, clock, cost, device)
            clock.now += HOST_PATH_S  # handing the jobs over, gathering and merging them
        log.peak_slots = max(log.peak_slots, provider.cache.num_occupied)
        provider.end_layer(layer, ctx)
    if provider is not None:
        provider.end_step(ctx)
        assert offload is not None  # it has the provider
        for observe in offload.step_observers:
            observe(ctx)
    clock.now += cost.head_seconds(shape)


def _gather_host(
    offload: SimOffload, provider: OffloadedExpertProvider, layer: int, halves: list[tuple[int, HostResult]],
    on_host: list[HostResult], tokens_of: dict[int, int], clock: SimClock, cost: CostModel,
    device: Callable[[float], float],
) -> None:
    """The compute side gathers the layer's host jobs; a split expert's down runs on the device once both its
    activation and its down matrix are there."""
    host = offload.host
    assert host is not None and isinstance(provider, HybridExpertProvider)  # only hybrid policies use the host
    for expert, job in halves:
        host.gather(job)
        provider.get_down(layer, expert)
        assert provider.split_prices is not None  # it split this expert
        clock.now += device(provider.split_prices.device * cost.expert_seconds(tokens_of[expert]))
    for job in on_host:
        host.gather(job)  # stalls until the host has finished it


def _device_seconds(cost: CostModel, offload: SimOffload | None, decode: bool, seconds: float) -> float:
    """A device kernel's time: decode's kernels are memory-bound, and share the device's memory with the chunk
    landing meanwhile (offload/memory_bus.py)."""
    if offload is None or not decode or not offload.transfers.busy():
        return seconds
    landing = offload.transfers.sim_link.bytes_per_second
    return contended_seconds(seconds, cost.device_memory_bytes_per_second, [landing])


def _result(
    policy: OffloadPolicy, workload: Workload, slots: int, log: RunLog, offload: SimOffload | None
) -> SimResult:
    spec = workload.spec
    decode, prefill = log.totals[Phase.DECODE], log.totals[Phase.PREFILL]
    stats = offload.provider.stats if offload else None
    per_token = max(1, decode.tokens)
    kv_bytes = log.peak_kv_tokens * spec.kv_bytes_per_token * spec.num_layers
    hybrid = offload.provider if offload and isinstance(offload.provider, HybridExpertProvider) else None
    staging = hybrid.staging if hybrid is not None else None  # split experts' down matrices
    staging_bytes = len(staging.buffers) * spec.expert_chunk_bytes[1] if staging is not None else 0
    memory = spec.non_expert_bytes + log.peak_slots * spec.expert_bytes + staging_bytes + kv_bytes
    return SimResult(
        policy=policy.name,
        cache_gb=slots * spec.expert_bytes / 1e9,  # the budget; a split policy's staging comes out of it
        cache_slots=slots,
        ttft_ms=log.ttft_ms() if workload.has_prefill else None,
        tpot_ms=log.tpot_ms(),
        hit_rate=decode.hit_rate(stats is None) or 0.0,
        prefill_hit_rate=prefill.hit_rate(stats is None),
        gb_moved_per_token=decode.bytes_moved / 1e9 / per_token,
        bytes_moved=stats.bytes_demand + stats.bytes_prefetch if stats else 0,
        bytes_demand=stats.bytes_demand if stats else 0,
        bytes_prefetch=stats.bytes_prefetch if stats else 0,
        blocking_ms_per_token=decode.blocked_seconds * 1e3 / per_token,
        link_busy_share=decode.link_busy_seconds / decode.seconds if decode.seconds else 0.0,
        peak_memory_gb=memory / 1e9,
        peak_expert_slots_in_use=stats.peak_slots_in_use if stats else 0,
        prefetch_precision=stats.prefetch_precision() if stats else 0.0,
        decode_tokens=decode.tokens,
        host_experts_per_token=decode.host_experts / per_token,
        host_busy_share=decode.host_busy_seconds / decode.seconds if decode.seconds else 0.0,
    )
