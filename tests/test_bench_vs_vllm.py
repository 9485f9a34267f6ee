"""`hintserve bench vs-vllm` without vLLM: the real server measured in rounds by our loadgen, medians reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.bench.vs_vllm import Workload, run_vs_vllm
from services.cli import main


@pytest.mark.slow
def test_rounds_flip_and_medians_are_reported(demo_model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "vs.json"
    load = Workload(input_len=16, output_len=4, prompts_per_concurrency=1, min_prompts=2)
    result = run_vs_vllm(demo_model_dir, None, [1, 2], str(out), load, rounds=3)
    saved = json.loads(out.read_text())
    assert saved["vllm"] is False and saved["medians"] == result["medians"]
    rounds = saved["rounds"]["hintserve"]
    assert [len(rounds[c]) for c in ("1", "2")] == [3, 3]
    assert all(r["completed"] == 2 for c in ("1", "2") for r in rounds[c])
    throughputs = sorted(r["output_throughput"] for r in rounds["2"])
    assert saved["medians"]["hintserve"]["2"]["output_throughput"] == throughputs[1]
    table = (tmp_path / "vs.md").read_text()
    assert "Medians of 3 rounds." in table and "vLLM skipped" in table
    assert (tmp_path / "vs.png").stat().st_size > 0


def test_bad_rounds_exit_2_with_one_line(demo_model_dir: str, capsys) -> None:
    assert main(["bench", "vs-vllm", "--model", demo_model_dir, "--rounds", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rounds" in err[0]
