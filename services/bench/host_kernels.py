"""`hintserve bench host-kernels`: the CPU's expert and dense kernels against the memory bandwidth they could use.

Real MoE decode is bound by memory bandwidth: each token streams its experts' weights from DRAM once. Per weight
format (fp32, bf16, int8, int4), row count and torch thread count this times one routed expert at Qwen3-30B-A3B's
shape through `expert_forward` (the one entry point every executor calls), a decode layer's top-8 experts through
the one-call MoE kernel the CPU engine runs (`moe8`: 8 experts a call), and Qwen3's dense matrices through the
model's own dense linear, cycling through copies of each matrix worth twice the last-level cache per thread so
every call reads its weights from DRAM, not from cache. GB/s is weight bytes read per second; the ratio divides it
by a STREAM-like read probe (over a buffer twice the cycle: torch's sum, or the kernels' own four-stream read
where that is faster) at the same thread count, interleaved with the case's timed slices (bandwidth.py says why).
Everything goes through the project's public functions, so faster kernels show up unchanged.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm import tqdm

from services.bench.bandwidth import (
    SLICE_PROBE_REPEATS,
    SLICES,
    bandwidth_probe,
    last_level_cache_bytes,
    time_against_probe,
)
from services.common.report import bar_plot, markdown_table, run_header, write_json, write_markdown
from services.engine import cpu_kernels
from services.engine.cpu_kernels import formats as cpu_formats
from services.engine.cpu_kernels import moe_calls
from services.engine.cpu_threads import use_threads
from services.engine.expert_format import DEFAULT_GROUP_SIZE
from services.engine.expert_provider import ExpertWeights
from services.engine.host_allocator import HugePageArena, huge_page_empty
from services.engine.models.moe import expert_forward
from services.engine.models.native_linear import NativeLinear
from services.engine.models.packed_linear import PackedLinear, should_pack
from services.engine.quant.kernels import packed_linear
from services.engine.quant.layout import expert_layout
from services.engine.quant.packed import PackedMatrix, QuantScheme, pack_matrix

FORMATS = ("fp32", "bf16", "int8", "int4")
GROUP_SIZE = DEFAULT_GROUP_SIZE  # int4: the engine's default --expert-group-size
# Qwen3-30B-A3B: hidden 2048, experts of width 768; 32 query and 4 KV heads of 128; the bench model's vocab.
HIDDEN, EXPERT_WIDTH = 2048, 768
DENSE = {"q_proj": (32 * 128, HIDDEN), "o_proj": (HIDDEN, 32 * 128), "lm_head": (8000, HIDDEN)}
_UNIQUE = 4  # distinct random matrices per kind; the rest are copies (only their addresses must differ)
TOP_K = 8  # Qwen3-30B-A3B's experts per token: one `moe8` call is one decode layer's experts
_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def default_threads() -> list[int]:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return list(range(1, cores + 1))


def _probes(buffer: torch.Tensor, threads: list[int]) -> dict[int, float]:
    return {t: bandwidth_probe(buffer, t) for t in threads}


def _count(nbytes: int, cycle_bytes: int, minimum: int = _UNIQUE, multiple: int = 1) -> int:
    """Copies of `nbytes` to stream at least `cycle_bytes` a pass, rounded up to whole `multiple`s."""
    count = max(minimum, -(-cycle_bytes // nbytes))
    return -(-count // multiple) * multiple


def expert_copies(fmt: str, gen: torch.Generator, cycle_bytes: int, minimum: int = _UNIQUE, multiple: int = 1,
                  ) -> tuple[Sequence[object], int]:
    """Qwen3-shape experts stored as the engine stores `fmt` (expert_layout's flat buffer each, all in one buffer
    on huge pages as a layer's resident experts are), enough to stream `cycle_bytes` per pass in whole
    `multiple`s (moe_groups' groups), and one expert's bytes. `_UNIQUE` are random, the rest copies of them."""
    expert_dtype = {"fp32": "auto", "bf16": "bf16"}.get(fmt, fmt)
    layout = expert_layout(HIDDEN, EXPERT_WIDTH, expert_dtype, GROUP_SIZE, torch.float32, "cpu")
    nbytes = layout.numel * layout.dtype.itemsize
    flats = huge_page_empty((_count(nbytes, cycle_bytes, minimum, multiple), layout.numel), layout.dtype)
    for i in range(_UNIQUE):
        dense = torch.randn(3 * EXPERT_WIDTH, HIDDEN, generator=gen) / HIDDEN**0.5
        layout.pack(ExpertWeights(dense[: 2 * EXPERT_WIDTH], dense[2 * EXPERT_WIDTH :].t().contiguous()), flats[i])
    for i in range(_UNIQUE, flats.shape[0]):
        flats[i].copy_(flats[i % _UNIQUE])
    return [layout.views(flat) for flat in flats], nbytes


def dense_copies(fmt: str, shape: tuple[int, int], gen: torch.Generator, cycle_bytes: int) -> tuple[Sequence[object], int]:
    """A dense matrix as the model runs `fmt` (its dense layer: native_linear where the kernels are built,
    else PackedLinear), in enough copies to stream `cycle_bytes` per pass, and one copy's bytes."""
    bases = [torch.randn(*shape, generator=gen) / shape[1] ** 0.5 for _ in range(_UNIQUE)]
    if cpu_kernels.library() is not None:
        # All copies in one arena, as the engine packs a model's dense matrices (dense_layers).
        weight_bytes = cpu_formats.packed_nbytes(shape, fmt, GROUP_SIZE)
        count = _count(weight_bytes, cycle_bytes)
        arena = HugePageArena(HugePageArena.bytes_for([weight_bytes] * count))
        layers = [NativeLinear(b, None, fmt, GROUP_SIZE, arena.take) for b in bases]
        layers += [_copy(layers[i % _UNIQUE], arena.take) for i in range(_UNIQUE, count)]
        return layers, layers[0].nbytes
    if fmt in _DTYPE:
        mats = [b.to(_DTYPE[fmt]) for b in bases]
        nbytes = mats[0].numel() * mats[0].element_size()
        mats += [mats[i % _UNIQUE].clone() for i in range(_UNIQUE, _count(nbytes, cycle_bytes))]
        pack = should_pack("cpu", _DTYPE[fmt])
        return [PackedLinear(m, None, pack) for m in mats], nbytes
    packed = [pack_matrix(b, QuantScheme(int(fmt[3:]), GROUP_SIZE), "cpu") for b in bases]
    nbytes = packed[0].nbytes
    packed += [dataclasses.replace(p, qweight=p.qweight.clone(), _cpu=None,
                                   scales=None if p.scales is None else p.scales.clone())
               for p in (packed[i % _UNIQUE] for i in range(_UNIQUE, _count(nbytes, cycle_bytes)))]
    return packed, nbytes


def matrix_copies(fmt: str, kind: str, gen: torch.Generator, cycle_bytes: int,
                  ) -> tuple[Sequence[object], int, Callable[[torch.Tensor, Any], object], int]:
    """An expert (`kind` "expert") or a DENSE matrix in `fmt`: its copies (expert_copies, dense_copies), one
    copy's bytes, the call that runs one on activation rows, and the rows' width."""
    if kind == "expert":
        weights, nbytes = expert_copies(fmt, gen, cycle_bytes)
        return weights, nbytes, expert_forward, HIDDEN
    weights, nbytes = dense_copies(fmt, DENSE[kind], gen, cycle_bytes)
    return weights, nbytes, dense_call, DENSE[kind][1]


def moe_groups(experts: Sequence[Any]) -> list[tuple[ctypes.Array, ctypes.Array]]:
    """The expert copies TOP_K at a time, each group as the one-call MoE takes a layer's experts (empty when
    the native kernels cannot read them)."""
    groups = []
    for i in range(0, len(experts) - TOP_K + 1, TOP_K):
        matrices = [(cpu_formats.as_cpu_matrix(w.gate_up), cpu_formats.as_cpu_matrix(w.down))
                    for w in experts[i:i + TOP_K]]
        gate_up = [g for g, _ in matrices if g is not None]
        down = [d for _, d in matrices if d is not None]
        if len(gate_up) < TOP_K or len(down) < TOP_K:
            return []
        groups.append((moe_calls.native_array(gate_up), moe_calls.native_array(down)))
    return groups


def moe_call(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every row routed to all TOP_K experts of the group, as a decode token to its layer's top-k."""
    gate_up, down = group
    ids = torch.arange(TOP_K).expand(x.shape[0], TOP_K)
    return moe_calls.moe(x, ids, torch.full((x.shape[0], TOP_K), 1.0 / TOP_K), gate_up, down, HIDDEN)


def _copy(layer: NativeLinear, alloc: cpu_formats.Allocator) -> NativeLinear:
    """The same layer on copies of its tensors, its weight where `alloc` puts it (packing each copy again would
    cost the run minutes)."""
    m = layer.matrix
    clone = copy.copy(layer)
    weight = alloc(tuple(m.weight.shape), m.weight.dtype).copy_(m.weight)
    clone.matrix = dataclasses.replace(m, weight=weight, _native=None, _alone=None,
                                       scales=None if m.scales is None else m.scales.clone())
    clone.weight = clone.matrix.weight if m.format == "fp32" else None
    return clone


def dense_call(x: torch.Tensor, weights: object) -> torch.Tensor:
    if isinstance(weights, NativeLinear):
        return weights(x)
    if isinstance(weights, PackedLinear):
        return weights(x if x.dtype == weights.weight.dtype else x.to(weights.weight.dtype))
    assert isinstance(weights, PackedMatrix)  # what dense_copies makes when neither of the above
    return packed_linear(x, weights)


def run_host_kernels(json_path: str, formats: list[str], rows: list[int], threads: list[int],
                     min_seconds: float = 0.3, cycle_bytes: int | None = None, seed: int = 0) -> dict:
    """Every (format, matrix, threads, rows) case; `cycle_bytes` (default twice the last-level cache per thread:
    a VM's vCPUs may each sit behind their own, as two Zen 5 CCDs' are) of weight copies per pass, a probe buffer
    twice that. At twice one cache, the two-thread probe read 70 GB/s here, 45 GB/s from 512 MB."""
    cache = last_level_cache_bytes()
    cycle = cycle_bytes or 2 * cache * max(threads)
    before = torch.get_num_threads()
    buffer = torch.ones(2 * cycle // 4)
    first = _probes(buffer, threads)
    results: list[dict] = []
    experts: Sequence[Any] = []
    kinds = ("expert", "moe8", *DENSE)
    with tqdm(total=len(formats) * len(kinds) * len(rows) * len(threads), desc="bench host-kernels") as bar:
        for fmt in formats:
            for kind in kinds:
                for t in threads:
                    use_threads(t)  # before building: without native kernels, oneDNN packing depends on it
                    gen = torch.Generator().manual_seed(seed)
                    if kind == "moe8":
                        # Whole groups: a remainder left out would shrink the pass below the cycle (int8's 15
                        # experts made one group of 38 MB, read partly from a 32 MB L3 at 1.2x the probe).
                        experts, one = expert_copies(fmt, gen, cycle, minimum=TOP_K, multiple=TOP_K)
                        # The groups are pointers into `experts`, which stays alive until the cases are done.
                        weights, nbytes, call, width = moe_groups(experts), TOP_K * one, moe_call, HIDDEN
                        if not weights:  # no native kernels here: no one-call MoE to time
                            bar.update(len(rows))
                            continue
                    else:
                        weights, nbytes, call, width = matrix_copies(fmt, kind, gen, cycle)
                    for r in rows:
                        bar.set_postfix_str(f"{fmt} {kind} rows={r} threads={t}")
                        x = torch.randn(r, width, generator=gen)
                        share, slices = time_against_probe(call, weights, x, nbytes, min_seconds, buffer, t)
                        results.append({"format": fmt, "kind": kind, "rows": r, "threads": t,
                                        "us_per_call": share.seconds * 1e6, "weight_bytes": nbytes,
                                        "gb_per_s": nbytes / share.seconds / 1e9,
                                        "probe_gb_per_s": share.probe_gb_per_s, "of_probe": share.of_probe,
                                        "slices": [dataclasses.asdict(s) for s in slices]})
                        bar.update()
                    del weights
                    experts = []
    last = _probes(buffer, threads)
    torch.set_num_threads(before)
    # The machine's best over the run, before and after the cases (each case's own probe is in its row).
    probes = {t: max(first[t], last[t]) for t in threads}
    result = {**run_header(), "last_level_cache_bytes": cache, "cycled_bytes_per_pass": cycle,
              "probe_gb_per_s": {str(t): g for t, g in probes.items()},
              "probe_runs_gb_per_s": {"before": {str(t): g for t, g in first.items()},
                                      "after": {str(t): g for t, g in last.items()}}, "group_size": GROUP_SIZE,
              "shapes": {"expert": [3 * EXPERT_WIDTH, HIDDEN], **{k: list(v) for k, v in DENSE.items()}},
              "min_seconds": min_seconds, "results": results}
    _write(json_path, result, formats, threads)
    return result


def _write(json_path: str, result: dict, formats: list[str], threads: list[int]) -> None:
    write_json(json_path, result)
    stem = os.path.splitext(json_path)[0]
    rows = [(r["format"], r["kind"], r["rows"], r["threads"], round(r["us_per_call"], 1), r["gb_per_s"],
             f"{r['of_probe']:.0%}") for r in result["results"]]
    probes = ", ".join(f"{t} thread(s) {g:.1f} GB/s" for t, g in result["probe_gb_per_s"].items())
    note = (f"Read-bandwidth probe: {probes}. Each figure cycles through {result['cycled_bytes_per_pass'] / 1e6:.0f}"
            f" MB of copies of the matrix (the last-level cache: {result['last_level_cache_bytes'] >> 20} MiB), "
            "median over passes; the probe reads a buffer twice that size, best of 5, before and after all "
            f"cases (above). Each case runs in {SLICES} slices with a probe (best of {SLICE_PROBE_REPEATS}) before "
            "each and after the last; a slice's share is of the better probe beside it, and the row is the "
            "slice of median share (every slice in the JSON). expert: Qwen3-30B-A3B's (gate/up 1536x2048, down 2048x768) through "
            "expert_forward;"
            f" int4 group size {result['group_size']}.\n\n")
    table = markdown_table(["format", "matrix", "rows", "threads", "us/call", "GB/s", "of probe"], rows)
    write_markdown(stem + ".md", "Host kernels: weight streaming against memory bandwidth", result, note + table)
    one_row = [r for r in result["results"] if r["kind"] == "expert" and r["rows"] == 1]
    series = {f"{t} thread(s)": [next(r["of_probe"] for r in one_row if r["format"] == f and r["threads"] == t)
                                 for f in formats] for t in threads}
    bar_plot(stem + ".png", "One expert, one row: fraction of the read-bandwidth probe", formats, series,
             "fraction of probe GB/s")
