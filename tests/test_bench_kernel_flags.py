"""`hintserve bench kernel-flags`: two builds of the kernels timed in one process, each case saying whether their
outputs are the same bits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli import main
from services.engine import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="native kernels not built here")
SMALL = ["--threads", "1", "--rounds", "2", "--min-seconds", "0.001", "--cycle-mb", "8"]


def test_a_tuning_macro_times_both_builds_and_keeps_the_bits(tmp_path: Path) -> None:
    out, engine_build = tmp_path / "kf.json", cpu_kernels.library()
    assert main(["bench", "kernel-flags", "--flags=-DPREFETCH_BYTES=2048", "--formats", "int4", "--kinds",
                 "expert,q_proj", "--rows", "1,2", *SMALL, "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["candidate_flags"] == [*saved["baseline_flags"], "-DPREFETCH_BYTES=2048"]
    assert {(r["kind"], r["rows"]) for r in saved["results"]} == {(k, n) for k in ("expert", "q_proj") for n in (1, 2)}
    for case in saved["results"]:
        assert case["same_bits"]  # a prefetch distance moves no arithmetic
        assert all(len(case["rounds_us"][build]) == 2 for build in ("baseline", "candidate"))
        assert case["speedup"] == pytest.approx(case["baseline_us"] / case["candidate_us"])
    assert "| int4 | q_proj | 2 | 1 |" in (tmp_path / "kf.md").read_text()
    assert (tmp_path / "kf.png").stat().st_size > 0
    assert cpu_kernels.library() is engine_build  # the engine's build again afterwards


def test_the_candidate_build_is_the_one_timed(tmp_path: Path) -> None:
    """The portable C loops sum in another order than this machine's vector loops: were the candidate never
    swapped in, both builds' outputs would be the same bits."""
    out = tmp_path / "kf.json"
    assert main(["bench", "kernel-flags", "--replace-flags=-O3 -fno-math-errno", "--formats", "fp32", "--rows", "1",
                 *SMALL, "--json", str(out)]) == 0
    (case,) = json.loads(out.read_text())["results"]
    assert case["same_bits"] is False


@pytest.mark.parametrize("args", [
    ["--flags=-DSW_PREFETCH=0", "--replace-flags=-O2"],
    [],
    ["--flags=-DSW_PREFETCH=0", "--kinds", "moe9"],
    ["--flags=-DSW_PREFETCH=0", "--rounds", "0"],
    ["--replace-flags=-O3 -mno-such-flag", "--formats", "int8", "--rows", "1", "--threads", "1"],
], ids=["both", "neither", "bad-kind", "no-rounds", "build-fails"])
def test_bad_input_is_a_one_line_error(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "kernel-flags", *args, "--json", str(tmp_path / "kf.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hintserve bench: error:")
    assert not (tmp_path / "kf.json").exists()
