"""`hintserve bench prefill`: runs end to end on a tiny model, keeps its tokens, refuses bad flags."""

from __future__ import annotations

import json

import pytest

from services.cli import main


def test_prefill_bench_writes_its_results_and_keeps_tokens(tiny_mixtral_dir: str, tmp_path) -> None:
    out = tmp_path / "prefill.json"
    assert main(["bench", "prefill", "--model", tiny_mixtral_dir, "--budgets", "512,8", "--long-tokens", "40",
                 "--prefix-tokens", "72", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    chunked, whole = result["chunking"][1], result["chunking"][0]
    assert result["chunking_tokens_identical"] and result["prefix_tokens_identical"]
    assert whole["prefill_steps"] == 1 and chunked["prefill_steps"] == 5  # 40 tokens in chunks of 8
    assert whole["running_tokens"] == 1 and chunked["running_tokens"] == 5  # a token in every step that prefills
    off, on = result["prefix_caching"]
    assert off["hit_tokens"] == 0 and on["hit_tokens"] == 3 * 64  # the later three reuse two 32-token blocks
    assert (tmp_path / "prefill.md").exists() and (tmp_path / "prefill.png").exists()


def test_prefill_bench_runs_several_long_running_requests_beside_the_chunks(tiny_mixtral_dir: str, tmp_path) -> None:
    out = tmp_path / "prefill.json"
    assert main(["bench", "prefill", "--model", tiny_mixtral_dir, "--budgets", "8", "--long-tokens", "40",
                 "--prefix-tokens", "40", "--running", "3", "--running-context", "100", "--json", str(out)]) == 0
    # (the first running requests decode while the others' 300 prompt tokens prefill, 8 a step: they must still
    # be running when the long prompt arrives)
    (case,) = json.loads(out.read_text())["chunking"]
    assert case["running"] == 3 and case["running_context"] == 100
    # Every chunk step carries the three running requests' next tokens: 40 tokens in 5 chunks of 8.
    assert case["prefill_steps"] == 5 and case["running_tokens"] == 5
    assert 0 < case["median_wait_s"] <= case["longest_wait_s"]


@pytest.mark.parametrize("flags", [["--budgets", "0"], ["--long-tokens", "1"], ["--prefix-tokens", "0"],
                                   ["--running", "0"], ["--running-context", "0"]])
def test_bad_prefill_bench_flags_exit_2(tiny_mixtral_dir: str, flags: list[str], capsys) -> None:
    assert main(["bench", "prefill", "--model", tiny_mixtral_dir, *flags]) == 2
    assert "error" in capsys.readouterr().err
