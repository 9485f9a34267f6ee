"""`hintserve bench offload` end to end on a tiny model: rows, token identity, and the oracle's alignment
with the recorded trace after the warm-up run."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.bench.offload_bench import run_offload_bench


def test_offload_bench_rows_and_oracle_alignment(tiny_mixtral_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "offload.json"
    threads = torch.get_num_threads()
    result = run_offload_bench(
        tiny_mixtral_dir, ["resident", "lru", "lru@next-use", "oracle", "oracle@lookahead"], [0.5], [2.0], [2], str(out), new_tokens=6
    )
    assert torch.get_num_threads() == threads  # the run's serving thread count is its own, not the process's
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows.keys() == {"resident", "lru", "lru@next-use", "oracle", "oracle@lookahead"} and result["rows"]
    assert all(r["tokens_identical_to_resident"] for r in rows.values())
    # The oracle replays the reference's routing step by step: a warm-up that shifted the steps would make
    # it guess wrong (a full cache still misses the odd expert when every slot is pinned or loading).
    for oracle in ("oracle", "oracle@lookahead"):
        assert rows[oracle]["hit_rate"] >= max(0.9, rows["lru"]["hit_rate"]), rows[oracle]
    for r in rows.values():
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["tpot_ms"] > 0 and r["mb_per_token"] >= 0
    assert rows["resident"]["mb_per_token"] == 0.0 and rows["lru"]["mb_per_token"] > 0
    assert (tmp_path / "offload.md").is_file() and (tmp_path / "offload.png").is_file()
    # No emulated policy beats the physical bound of its configuration; the bound's device time is the resident
    # engine's one measured TPOT, so a policy as fast as resident may come under it by this machine's noise.
    for r in rows.values():
        assert 0 < r["bound_tpot_ms"] and r["of_bound"] <= 1.15, r
    assert result["host_path"]["1"]["host_path_s"] >= 0 and result["host_path"]["16"]["tokens"] == 16


def test_each_repeat_starts_one_policy_further_on(tiny_mixtral_dir: str, tmp_path: Path, monkeypatch) -> None:
    """A policy that always ran right after the same one would carry that one's after-effects in every sample."""
    from services.bench import offload_bench

    order: list[str] = []  # the reference engine first, then the measured ones
    engine = offload_bench.LLMEngine

    def recorded(config, *args, **kwargs):
        if config.offload_policy:
            order.append(config.offload_policy)
        return engine(config, *args, **kwargs)

    monkeypatch.setattr(offload_bench, "LLMEngine", recorded)
    result = run_offload_bench(tiny_mixtral_dir, ["resident", "lru", "layer"], [0.5], [2.0], [1],
                               str(tmp_path / "o.json"), new_tokens=3, repeats=3)
    assert order[1:] == ["resident", "lru", "layer", "lru", "layer", "resident", "layer", "resident", "lru"]
    for row in result["rows"]:  # every repeat kept, the median reported, the range beside it
        assert len(row["tpot_samples_ms"]) == 3 and sorted(row["tpot_samples_ms"])[1] == row["tpot_ms"]
    table = (tmp_path / "o.md").read_text()
    assert "| TPOT range ms |" in table
    low, high = min(result["rows"][0]["tpot_samples_ms"]), max(result["rows"][0]["tpot_samples_ms"])
    assert f"| {low:.3g}-{high:.3g} |" in table
