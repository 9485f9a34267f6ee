"""`hintserve bench offload`: every offload policy on the same prompts, side by side in one process."""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

import torch
from tqdm import tqdm

from services.bench.prompts import prompt_ids
from services.common.report import bar_plot, markdown_table, run_header, write_json, write_markdown
from services.engine.config import EngineConfig
from services.engine.cpu_threads import core_threads, intra_op_threads
from services.engine.llm_engine import LLMEngine
from services.engine.models.geometry import expert_bytes, total_experts
from services.engine.offload.cost_model import DEFAULT_HOST_RATIO
from services.engine.offload.host_path import measure_host_path
from services.engine.offload.link import EmulatedLink, emulation_unit
from services.engine.offload.memory_bus import emulated_dram
from services.engine.offload.policies import get_policy
from services.engine.offload.routing_trace import RoutingTrace
from services.engine.sampling_params import SamplingParams
from services.simulator.bound import Bound, Side, Visits, physical_bound
from services.simulator.offline_cache import fewest_misses


@dataclass
class Row:
    policy: str
    cache_fraction: float
    link_ratio: float
    batch: int
    ttft_ms: float
    tpot_ms: float
    hit_rate: float  # decode: resident or already in flight when the router asked
    prefill_hit_rate: float
    blocking_ms_per_token: float
    mb_per_token: float
    peak_device_mb: float
    peak_expert_slots_in_use: int
    prefetch_precision: float
    tokens_identical_to_resident: bool
    expert_dtype: str = "auto"
    cache_experts: int = 0  # slots the cache budget holds (more for packed experts in the same bytes)
    tpot_samples_ms: list[float] = field(default_factory=list)  # every repeat's TPOT, in the order run
    bound_tpot_ms: float = 0.0  # the physical bound of this configuration (simulator/bound.py)
    of_bound: float = 0.0  # this row's decode speed as a share of the bound's


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    """Submits all prompts at once; returns (tokens per request, TTFT s, TPOT s, (counters moved by the
    prefill, counters moved by the whole run)); counters are relative to the engine's before the run, so
    an earlier warm-up run does not count."""
    before = engine.stats()
    delta = lambda: {k: v - before.get(k, 0.0) for k, v in engine.stats().items()}  # noqa: E731
    start = time.perf_counter()
    seqs = [engine.add_request(f"bench-{i}", p, params) for i, p in enumerate(prompts)]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    after_prefill = None
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
        if after_prefill is None and len(first) == len(seqs):
            after_prefill = delta()
    ttft = statistics.mean(first[s.request_id] - start for s in seqs)
    n = params.max_tokens
    tpot = statistics.mean((last[s.request_id] - first[s.request_id]) / (n - 1) for s in seqs)
    return [s.completion_token_ids for s in seqs], ttft, tpot, (after_prefill, delta())


def _sum(stats: dict[str, float], *prefixes: str) -> float:
    return sum(v for k, v in stats.items() if k.startswith(prefixes))


def _row(policy, cache, ratio, batch, engine, tokens, expected, ttft, tpot, counters, decode_tokens) -> Row:
    s = getattr(engine.model.experts, "stats", None)
    if s is None:  # resident: every expert always there
        return Row(policy, cache, ratio, batch, ttft * 1e3, tpot * 1e3, 1.0, 1.0, 0.0, 0.0,
                   engine.device_bytes() / 2**20, 0, 0.0, True)
    pre, run = counters
    hit_keys = ("offload_expert_hits_total", "offload_expert_inflight")
    moved_keys = ('offload_bytes_moved_total{kind="demand"}', 'offload_bytes_moved_total{kind="prefetch"}')
    pre_hits, pre_queries = _sum(pre, *hit_keys), _sum(pre, "offload_expert_queries_total")
    hits, queries = _sum(run, *hit_keys) - pre_hits, _sum(run, "offload_expert_queries_total") - pre_queries
    issued, used = run["offload_prefetches_issued_total"], run["offload_prefetches_used_total"]
    blocking = run["offload_blocking_seconds_total"] - pre["offload_blocking_seconds_total"]
    return Row(
        policy=policy,
        cache_fraction=cache,
        link_ratio=ratio,
        batch=batch,
        ttft_ms=ttft * 1e3,
        tpot_ms=tpot * 1e3,
        hit_rate=hits / queries if queries else 0.0,
        prefill_hit_rate=pre_hits / pre_queries if pre_queries else 0.0,
        blocking_ms_per_token=blocking * 1e3 / decode_tokens,
        mb_per_token=(_sum(run, *moved_keys) - _sum(pre, *moved_keys)) / 2**20 / decode_tokens,
        peak_device_mb=engine.device_bytes() / 2**20,
        peak_expert_slots_in_use=s.peak_slots_in_use,
        prefetch_precision=used / issued if issued else 0.0,
        tokens_identical_to_resident=tokens == expected,
    )


def run_offload_bench(
    model_dir: str,
    policies: list[str],
    caches: list[float],
    ratios: list[float],
    batches: list[int],
    json_path: str,
    plot_path: str | None = None,
    new_tokens: int = 32,
    repeats: int = 1,
    device: str = "cpu",
    link: str = "emulated",
    expert_dtypes: tuple[str, ...] = ("auto",),
    group_size: int = 64,
    hot_set_from: str = "warmup",
) -> dict:
    """With an expert dtype other than auto, the cache is sized in bytes: the fraction of every expert in
    bf16, so packed experts get more slots in the same budget. Static hot sets are counted on the warm-up
    prompts (a calibration set, disjoint from the measured ones) unless `hot_set_from` is "measured"; the
    bounds (oracle, belady) always replay the measured run."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    # A serving engine's cache is warm from earlier traffic: every engine first serves other prompts (not
    # measured), and the reference does the same so that recorded and replayed steps line up.
    warm_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rows: list[Row] = []
    trace_dir = tempfile.mkdtemp(prefix="hintserve-trace-")
    cases = [(d, c, r, b) for d in expert_dtypes for c in caches for r in ratios for b in batches]
    progress = tqdm(total=len(cases) * len(policies) * repeats, desc="bench offload", unit="run")
    # The intra-op threads `hintserve serve` gives its engine core (the rest: link, host), for this run only.
    with intra_op_threads(core_threads() if device == "cpu" else None):
        host_path = {str(n): measure_host_path(n) for n in (1, 16)}  # the engine's per-layer host path
        for dtype, cache, ratio, batch in cases:
            quant = dict(expert_dtype=dtype, expert_group_size=group_size)
            reference = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=max(batch, 1), device=device, **quant))
            size = ({"expert_cache_fraction": cache} if dtype == "auto" else
                    {"expert_cache_gb": cache * total_experts(reference.spec) * reference.spec.expert_params * 2 / 1e9})
            warm, prompts = _split(prompt_ids(reference.tokenizer, 2 * batch), batch)
            trace, calibration = RoutingTrace(reference.spec.num_layers), RoutingTrace(reference.spec.num_layers)
            reference.runner.step_observers += [trace, calibration]
            _run(reference, warm, warm_params)
            reference.runner.step_observers.remove(calibration)
            measured_from = len(trace.steps)  # the measured run's first step (its prefill)
            expected, _, resident_tpot, _ = _run(reference, prompts, params)
            trace_path = os.path.join(trace_dir, f"trace-{dtype}-b{batch}.json")
            trace.save(trace_path)
            hot_set_path = trace_path
            if hot_set_from == "warmup":
                hot_set_path = os.path.join(trace_dir, f"calibration-{dtype}-b{batch}.json")
                calibration.save(hot_set_path)
            reference.close()
            # Repeats go round the policies, so a slow spell on a shared machine falls on all of them alike,
            # each repeat starting one policy further on, so no policy always runs right after the same one.
            samples: dict[str, list[Row]] = {policy: [] for policy in policies}
            offloaded: dict[str, float] = {}  # what the bound reads off an offloaded engine: link, stored expert
            for repeat in range(repeats):
                shift = repeat % len(policies)
                for policy in policies[shift:] + policies[:shift]:
                    name, _, eviction = policy.partition("@")  # "policy@eviction" swaps the policy's eviction
                    engine = LLMEngine(EngineConfig(
                        model=model_dir, max_num_seqs=max(batch, 1), offload_policy=name, eviction=eviction or None,
                        link_ratio=ratio, routing_trace=hot_set_path if get_policy(name).pinned == "hot" else trace_path,
                        device=device, link=link, **size, **quant,
                    ))
                    _run(engine, warm, warm_params)
                    gc.collect()  # the previous engines' garbage, freed here rather than during the timed run
                    tokens, ttft, tpot, counters = _run(engine, prompts, params)
                    row = _row(policy, cache, ratio, batch, engine, tokens, expected, ttft, tpot, counters,
                               batch * (new_tokens - 1))
                    slots = getattr(getattr(engine.model.experts, "cache", None), "num_slots", 0)
                    samples[policy].append(replace(row, expert_dtype=dtype, cache_experts=slots))
                    copies = getattr(getattr(engine.model.experts, "transfers", None), "link", None)
                    if isinstance(copies, EmulatedLink):
                        offloaded.update(link=copies.bytes_per_second, stored=engine.model.experts.store.expert_bytes)
                    engine.close()
                    progress.update()
            case = [_median_row(samples[policy]) for policy in policies]
            if offloaded:
                reference_bytes = expert_bytes(reference.spec, reference.dtype if dtype == "auto" else torch.bfloat16)
                unit = emulation_unit(reference.spec.hidden_size, reference.spec.moe_intermediate_size, reference.dtype)
                # The device time: the resident policy's run where there is one (the reference run also records
                # the trace, which slows its steps), the faster of the two.
                device_tpot = min([resident_tpot] + [r.tpot_ms / 1e3 for r in case if r.policy == "resident"])
                bound = emulated_bound(
                    trace.steps, measured_from, max(r.cache_experts for r in case), device_tpot, new_tokens - 1,
                    Side(offloaded["stored"] / offloaded["link"], offloaded["stored"]),
                    Side(DEFAULT_HOST_RATIO * unit, reference_bytes), offloaded["link"], host_path["1"]["host_path_s"],
                )
                case = [replace(r, bound_tpot_ms=bound.tpot_ms, of_bound=bound.tpot_ms / r.tpot_ms) for r in case]
            rows += case
    progress.close()
    result = {**run_header(), "model": os.path.abspath(model_dir), "new_tokens": new_tokens,
              "hot_set_from": hot_set_from, "host_path": host_path,
              "repeats": repeats, "device": device, "link": link, "rows": [asdict(r) for r in rows]}
    _report(result, rows, json_path, plot_path or os.path.splitext(json_path)[0] + ".png")
    return result


def emulated_bound(
    steps: list[list[list[int]]], measured_from: int, slots: int, resident_tpot: float, decode_steps: int,
    link: Side, host: Side, link_rate: float, sync_seconds: float,
) -> Bound:
    """The bound of the measured run's decode (its steps after `measured_from`, the first of them its prefill),
    on the emulated link and host (their DRAM: memory_bus.emulated_dram), with every engine's cache of `slots`
    empty before the warm-up run. The device time is the resident engine's, spread evenly over each step's MoE
    layers and counted as expert time one host expert could free entirely (what keeps it a bound without a
    per-layer breakdown)."""
    measured = steps[measured_from + 1 :]
    misses = fewest_misses(steps, slots)[measured_from + 1 :]
    visits = Visits([], [], [], [])
    for routed, missed in zip(measured, misses):
        moe = [layer for layer, experts in enumerate(routed) if experts]
        share = resident_tpot / max(1, len(moe))
        for layer in moe:
            visits.add(0.0, share, share, missed[layer])
    dram = emulated_dram(host.dram_bytes, host.seconds, link_rate)
    return physical_bound(visits, decode_steps, link, host, dram, sync_seconds)


def _split(prompts: list[list[int]], batch: int) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up prompts, measured prompts): the measured ones are the same whatever the warm-up."""
    return prompts[batch:] or prompts[:batch], prompts[:batch]


def _median_row(samples: list[Row]) -> Row:
    if len(samples) == 1:
        return replace(samples[0], tpot_samples_ms=[samples[0].tpot_ms])
    fields = asdict(samples[0])
    for name, value in fields.items():
        if isinstance(value, float):
            fields[name] = statistics.median(getattr(s, name) for s in samples)
    fields["tokens_identical_to_resident"] = all(s.tokens_identical_to_resident for s in samples)
    fields["tpot_samples_ms"] = [s.tpot_ms for s in samples]
    fields["expert_dtype"] = samples[0].expert_dtype
    return Row(**fields)


def _report(result: dict, rows: list[Row], json_path: str, plot_path: str) -> None:
    # The repeats' range beside the median: where policies compute alike (a cache that holds every expert) it
    # is the machine's noise, which a few percent between medians can lie inside.
    headers = ("policy", "experts", "cache (slots)", "ratio", "batch", "TTFT ms", "TPOT ms", "TPOT range ms", "hit rate",
               "blocking ms/tok", "MB/tok", "peak MB", "peak slots", "bound ms", "of bound", "same tokens")
    table = markdown_table(headers, [
        (r.policy, r.expert_dtype, f"{r.cache_fraction:.0%} ({r.cache_experts})", r.link_ratio, r.batch, r.ttft_ms, r.tpot_ms,
         f"{min(r.tpot_samples_ms):.3g}-{max(r.tpot_samples_ms):.3g}", r.hit_rate,
         r.blocking_ms_per_token, r.mb_per_token, r.peak_device_mb, r.peak_expert_slots_in_use, r.bound_tpot_ms,
         f"{r.of_bound:.2f}", "yes" if r.tokens_identical_to_resident else "NO")
        for r in rows
    ])
    print(table)
    path = result["host_path"]
    print("engine host path per MoE layer (submit, run, gather, merge; offload/host_path.py): "
          + ", ".join(f"{n} token(s) {v['host_path_s'] * 1e6:.0f} us" for n, v in path.items())
          + "; beside device experts (a worker woken): "
          + ", ".join(f"{n} token(s) {v['mixed_path_s'] * 1e6:.0f} us" for n, v in path.items()))
    write_json(json_path, result)
    write_markdown(os.path.splitext(json_path)[0] + ".md", "Offload policies", result, table)
    if rows:
        policies = list(dict.fromkeys(r.policy for r in rows))
        series = {}
        for r in rows:
            series.setdefault(f"{r.expert_dtype}, batch {r.batch}, {r.cache_fraction:.0%}, x{r.link_ratio:g}",
                              {})[r.policy] = r.tpot_ms
        bar_plot(plot_path, "TPOT by offload policy (lower is better)", policies,
                 {k: [v.get(p, 0.0) for p in policies] for k, v in series.items()}, "TPOT (ms)")
