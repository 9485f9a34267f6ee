"""`hintserve bench kernel-flags`: two builds of the native CPU kernels timed against each other in one process.

The kernels' tuning knobs are compile-time macros (prefetch distances and hints, streams a row, pairs; each
named in `rows_tuning.h` or the `rows_*.h` loop it tunes), and a shared machine's memory bandwidth drifts by a quarter within
minutes, more than most of them move. So both builds run in the same process on the same weights, the rounds
alternating which goes first, and every case reports the median of its rounds and whether the two builds'
outputs are the same bits. The baseline is the build the engine would make here (HINTSERVE_KERNEL_FLAGS, else
-O3 -march=native); the candidate adds `flags` to it, or replaces it with `replace`.
"""

from __future__ import annotations

import os
import shlex
import statistics

import torch
from tqdm import tqdm

from services.bench.bandwidth import last_level_cache_bytes, time_cycle
from services.bench.host_kernels import DENSE, matrix_copies
from services.common.report import bar_plot, markdown_table, run_header, write_json, write_markdown
from services.engine import cpu_kernels
from services.engine.cpu_threads import use_threads

KINDS = ("expert", *DENSE)


def baseline_flags() -> list[str]:
    """The flags the engine builds its kernels with on this machine (the first set `library()` tries)."""
    return list(cpu_kernels.flag_sets()[0])


def run_kernel_flags(json_path: str, candidate: list[str], formats: list[str], kinds: list[str], rows: list[int],
                     threads: list[int], rounds: int, min_seconds: float = 0.2, cycle_bytes: int | None = None,
                     seed: int = 0) -> dict:
    """Every (format, kind, threads, rows) case under both builds, `rounds` rounds each; writes JSON, markdown and
    a plot. `candidate`: the second build's whole flag list."""
    base = baseline_flags()
    built = {"baseline": cpu_kernels.build_library([base]), "candidate": cpu_kernels.build_library([candidate])}
    builds = {name: lib for name, lib in built.items() if lib is not None}
    if len(builds) < len(built):
        failed = " and ".join(name for name in built if name not in builds)
        raise ValueError(f"the {failed} build of the kernels failed (baseline flags: {shlex.join(base)}; "
                         f"candidate: {shlex.join(candidate)})")
    cycle = cycle_bytes or 2 * last_level_cache_bytes() * max(threads)
    before = torch.get_num_threads()
    results: list[dict] = []
    total = len(formats) * len(kinds) * len(threads) * len(rows)
    with tqdm(total=total, desc="bench kernel-flags") as bar:
        for fmt in formats:
            for kind in kinds:
                gen = torch.Generator().manual_seed(seed)
                weights, nbytes, call, width = matrix_copies(fmt, kind, gen, cycle)
                for t in threads:
                    for r in rows:
                        bar.set_postfix_str(f"{fmt} {kind} rows={r} threads={t}")
                        x = torch.randn(r, width, generator=gen)
                        outputs, seconds = {}, {name: [] for name in builds}
                        for i in range(rounds):
                            order = list(builds) if i % 2 == 0 else list(reversed(builds))
                            for name in order:
                                with cpu_kernels.swapped_in(builds[name]):
                                    use_threads(t)
                                    if name not in outputs:  # the first round's, for the bit check
                                        outputs[name] = call(x, weights[0])
                                    seconds[name].append(time_cycle(call, weights, x, min_seconds))
                        base_s, cand_s = (statistics.median(seconds[n]) for n in builds)
                        results.append({
                            "format": fmt, "kind": kind, "rows": r, "threads": t, "weight_bytes": nbytes,
                            "baseline_us": base_s * 1e6, "candidate_us": cand_s * 1e6, "speedup": base_s / cand_s,
                            "same_bits": torch.equal(outputs["baseline"], outputs["candidate"]),
                            "rounds_us": {n: [s * 1e6 for s in v] for n, v in seconds.items()}})
                        bar.update()
                del weights
    torch.set_num_threads(before)
    result = {**run_header(), "baseline_flags": base, "candidate_flags": candidate, "rounds": rounds,
              "cycled_bytes_per_pass": cycle, "results": results}
    _write(json_path, result)
    return result


def _write(json_path: str, result: dict) -> None:
    write_json(json_path, result)
    stem = os.path.splitext(json_path)[0]
    rows = [(r["format"], r["kind"], r["rows"], r["threads"], round(r["baseline_us"], 1),
             round(r["candidate_us"], 1), round(r["speedup"], 3), "yes" if r["same_bits"] else "no")
            for r in result["results"]]
    note = (f"Baseline: `{shlex.join(result['baseline_flags'])}`; candidate: `{shlex.join(result['candidate_flags'])}`."
            f" Both builds in one process on the same weights ({result['cycled_bytes_per_pass'] / 1e6:.0f} MB of "
            f"copies cycled a pass), {result['rounds']} rounds alternating which goes first, medians; speedup is "
            "baseline time over candidate time.\n\n")
    table = markdown_table(["format", "matrix", "rows", "threads", "baseline us", "candidate us", "speedup",
                            "same bits"], rows)
    write_markdown(stem + ".md", "Kernel builds against each other", result, note + table)
    labels = [f"{r['format']} {r['kind']} {r['rows']}r {r['threads']}t" for r in result["results"]]
    bar_plot(stem + ".png", "Candidate build's speed over the baseline's", labels,
             {"speedup": [r["speedup"] for r in result["results"]]}, "baseline time / candidate time")
