"""`hintserve bench host-kernels`: every case timed through the project's kernels, against the probe it ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.bench import bandwidth, host_kernels
from services.cli import main
from services.engine import cpu_kernels
from services.engine.cpu_threads import use_threads


def test_every_case_reports_gbs_against_its_probe(tmp_path: Path) -> None:
    out = tmp_path / "hk.json"
    args = ["--formats", "fp32,int4", "--rows", "1,3", "--threads", "1", "--min-seconds", "0.001",
            "--cycle-mb", "16", "--json", str(out)]
    assert main(["bench", "host-kernels", *args]) == 0
    saved = json.loads(out.read_text())
    cases = {(r["format"], r["kind"], r["rows"], r["threads"]) for r in saved["results"]}
    kinds = ("expert", "moe8", "q_proj", "o_proj", "lm_head")
    assert cases == {(f, k, r, 1) for f in ("fp32", "int4") for k in kinds for r in (1, 3)}
    probe = saved["probe_gb_per_s"]["1"]
    assert probe == max(saved["probe_runs_gb_per_s"][when]["1"] for when in ("before", "after"))
    for r in saved["results"]:  # each case: its slice of median share, against the probes beside that slice
        assert r["probe_gb_per_s"] > 0 and r["of_probe"] == pytest.approx(r["gb_per_s"] / r["probe_gb_per_s"])
        shares = sorted(s["of_probe"] for s in r["slices"])
        assert len(shares) == bandwidth.SLICES and r["of_probe"] == shares[len(shares) // 2]
        assert r["gb_per_s"] > 0
        assert r["gb_per_s"] == pytest.approx(r["weight_bytes"] / r["us_per_call"] / 1e3)
    experts = {r["format"]: r["weight_bytes"] for r in saved["results"] if r["kind"] == "expert"}
    layers = {r["format"]: r["weight_bytes"] for r in saved["results"] if r["kind"] == "moe8"}
    assert layers == {f: 8 * b for f, b in experts.items()}  # a decode layer's top-8 experts a call
    assert experts["fp32"] == 3 * 2048 * 768 * 4 and experts["int4"] < experts["fp32"] / 6  # Qwen3's expert
    assert "| int4 | expert | 3 | 1 |" in (tmp_path / "hk.md").read_text()
    assert (tmp_path / "hk.png").stat().st_size > 0


@pytest.mark.parametrize("bad", [["--formats", "fp16"], ["--rows", "0"], ["--min-seconds", "0"]])
def test_bad_arguments_exit_2_with_one_line(bad: list[str], tmp_path: Path, capsys) -> None:
    assert main(["bench", "host-kernels", *bad, "--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0]


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: the kernels are off here")
@pytest.mark.parametrize("threads", [1, 2])
def test_the_native_read_probe_reads_every_line_once(threads: int) -> None:
    words = torch.randint(0, 1 << 20, (3 * (4 << 20) // 8,), generator=torch.Generator().manual_seed(0))
    lines = words.view(-1, 8)
    expected = (lines[:, :4] ^ lines[:, 4:]).sum().item()  # small values: no wrap-around
    use_threads(threads)
    try:
        assert cpu_kernels.read_probe(words) == expected
    finally:
        use_threads(1)


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: the kernels are off here")
def test_the_probe_takes_the_faster_of_torchs_sum_and_the_native_read(monkeypatch) -> None:
    buffer = torch.ones(1 << 20)
    calls = []
    monkeypatch.setattr(bandwidth, "_timed", lambda fn: calls.append(fn) or (1.0 if len(calls) <= 2 else 0.5))
    gbs = bandwidth.bandwidth_probe(buffer, 1, repeats=2)
    assert gbs == pytest.approx(buffer.numel() * 4 / 0.5 / 1e9)  # the native read's (second) timings
    assert calls[0] == buffer.sum and calls[2] != buffer.sum


def test_each_slice_is_held_against_the_better_probe_beside_it() -> None:
    # The host's bandwidth doubles after the first slice and halves again after the third: a slice's share is of
    # the bandwidth around it, not of the run's best, and the row is the slice of median share.
    gb = 1e9
    best, slices = bandwidth.median_share(int(30 * gb), [1.0, 0.5, 0.5, 1.0, 1.0], [30, 30, 60, 60, 30, 30])
    assert [s.probe_gb_per_s for s in slices] == [30, 60, 60, 60, 30]
    assert [round(s.of_probe, 3) for s in slices] == [1.0, 1.0, 1.0, 0.5, 1.0]
    assert best in slices and best.of_probe == pytest.approx(1.0)
    with pytest.raises(ValueError):
        bandwidth.median_share(1, [1.0, 1.0], [30.0, 30.0])


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: the kernels are off here")
def test_moe8_groups_stream_the_whole_cycle() -> None:
    gen = torch.Generator().manual_seed(0)
    cycle = 9 * 2654208  # nine int4 experts: one group and a remainder that must not be dropped
    experts, one = host_kernels.expert_copies("int4", gen, cycle, minimum=host_kernels.TOP_K,
                                              multiple=host_kernels.TOP_K)
    groups = host_kernels.moe_groups(experts)
    assert len(experts) == len(groups) * host_kernels.TOP_K
    assert len(groups) * host_kernels.TOP_K * one >= cycle
