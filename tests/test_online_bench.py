"""`hintserve bench online` end to end on the tiny model: a real server per policy, loadgen's replay against it."""

from __future__ import annotations

import json
from pathlib import Path

from services.bench.online_bench import run_online_bench


def test_online_bench_serves_the_replay_and_says_where_its_prompts_came_from(
    tiny_mixtral_dir: str, tmp_path: Path
) -> None:
    out = tmp_path / "online.json"
    result = run_online_bench(tiny_mixtral_dir, ["lru"], str(out), duration=3.0, max_context=64,
                              prompts="synthetic")
    assert result["prompts"] == "synthetic"  # what the rows were measured on, not what auto would pick here
    assert json.loads(out.read_text())["prompts"] == "synthetic"
    assert "Prompts: synthetic." in (tmp_path / "online.md").read_text()
    (row,) = result["rows"]
    assert row["policy"] == "lru" and row["completed"] > 0 and row["failed"] == 0
