"""`hintserve doctor`: the machine probes, the model check from headers only, the recommendation, the CLI
contract (one-line errors, exit 2, --json) and its time budget."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.cli import main
from services.common.cpu import cpu_info
from services.doctor import machine
from services.doctor.model_check import check_model
from services.doctor.recommend import recommend
from services.engine import cpu_kernels
from services.engine.host_allocator import huge_page_status
from tests.conftest import REPO_ROOT


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "doctor", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_doctor_json_on_the_demo_model_within_15_seconds(demo_model_dir: str) -> None:
    start = time.perf_counter()
    done = _doctor("--model", demo_model_dir, "--json")
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert elapsed < 15, f"doctor took {elapsed:.1f} s"
    config = json.loads((Path(demo_model_dir) / "config.json").read_text())
    model = report["model"]
    assert (model["family"], model["moe_layers"], model["experts_per_layer"], model["top_k"], model["format"]) == (
        "mixtral", config["num_hidden_layers"], config["num_local_experts"], config["num_experts_per_tok"], "bf16")
    weights = (Path(demo_model_dir) / "model.safetensors").stat().st_size
    assert 0.99 * weights < model["total_bytes"] <= weights  # the tensors: the file less its header
    assert model["all_experts_bytes"] == model["expert_bytes"] * model["moe_layers"] * model["experts_per_layer"]
    assert set(report["cpu"]["features"]) == {"avx2", "avx512", "vnni", "bf16", "amx"}
    assert set(report["huge_pages"]) == {"mode", "weights", "why"}
    kernels = report["native_kernels"]  # which loops, and from how many rows each format takes AMX tiles
    assert not kernels["built"] or kernels["runs"] == cpu_kernels.describe()
    assert report["host_bandwidth_gbps"] > 0
    if not report["cuda"]:
        assert report["recommendation"]["policy"] == "resident" and report["link_gbps"] is None


def test_doctor_text_report_plans_for_a_described_gpu(demo_model_dir: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["doctor", "--model", demo_model_dir, "--gpu-memory-gb", "1.04", "--link-gbps", "25"]) == 0
    out = capsys.readouterr().out
    assert "recommended (for the described 1.04 GB GPU):" in out
    assert "--offload-policy hintserve --expert-cache-gb" in out


@pytest.mark.parametrize("case", ["missing", "no-config", "truncated", "unsupported", "bad-gpu"])
def test_bad_input_is_one_line_and_exit_2(case: str, tmp_path: Path, demo_model_dir: str,
                                          capsys: pytest.CaptureFixture) -> None:
    model = tmp_path / "model"
    if case != "missing":
        model.mkdir()
    if case in ("truncated", "unsupported"):
        config = json.loads((Path(demo_model_dir) / "config.json").read_text())
        if case == "unsupported":
            config["model_type"] = "llama"
        (model / "config.json").write_text(json.dumps(config))
        (model / "model.safetensors").write_bytes((Path(demo_model_dir) / "model.safetensors").read_bytes()[:6])
    args = ["--model", str(model)] if case != "bad-gpu" else ["--gpu-memory-gb", "0"]
    assert main(["doctor", *args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hintserve doctor: error:"), err
    expected = {"missing": "not found", "no-config": "no config.json", "truncated": "not a safetensors file",
                "unsupported": "unsupported model_type 'llama'", "bad-gpu": "--gpu-memory-gb must be positive"}
    assert expected[case] in lines[0]


def test_recommendation_rules(demo_model_dir: str) -> None:
    facts = check_model(demo_model_dir)
    cpu = recommend(facts, None, 16.0, 10.0, None)
    assert cpu.policy == "resident" and cpu.fits and "--device" not in cpu.flags
    assert not recommend(facts, None, 0.01, 10.0, None).fits  # the fp32 copy does not fit 10 MB
    big = recommend(facts, 80.0, 64.0, 10.0, 25.0)
    assert big.policy == "resident" and "--device cuda" in big.flags
    # 1 GB reserve + non-expert weights + room for 20 experts:
    device_gb = 1.0 + (facts.non_expert_bytes + 20.5 * facts.expert_bytes) / 1e9
    hybrid = recommend(facts, device_gb, 64.0, 10.0, 25.0)
    assert hybrid.policy == "hintserve" and "20 of 48 experts" in hybrid.why
    assert hybrid.link_expert_ms == pytest.approx(facts.expert_bytes / 25e9 * 1e3)
    # the expert's bytes at the host's bandwidth (its dispatch is charged per layer, simulator.host.HOST_PATH_S)
    assert hybrid.host_expert_ms >= facts.expert_bytes / 10e9 * 1e3
    tiny = recommend(facts, 1.0 + (facts.non_expert_bytes + 1.5 * facts.expert_bytes) / 1e9, 64.0, 10.0, 25.0)
    assert tiny.policy == "cpu-experts"


def test_cpu_features_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Test CPU\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n\n"
                       "model name\t: Test CPU\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n")
    info = cpu_info(str(cpuinfo))
    assert info["model"] == "Test CPU"
    assert info["features"] == {"avx2": True, "avx512": True, "vnni": True, "bf16": False, "amx": False}


def test_saved_results_name_the_cpu_and_its_vector_features(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every bench JSON's `machine`: which CPU, since the kernels' rates depend on its ISA."""
    from services.common import report

    monkeypatch.setattr(report, "cpu_info", lambda: {"model": "Test CPU", "cores": 2, "features": {
        "avx2": True, "avx512": True, "vnni": True, "bf16": False, "amx": False}})
    monkeypatch.setattr(report.torch.cuda, "is_available", lambda: False)
    assert report.machine_description().startswith("Test CPU x2 (avx2+avx512+vnni), torch ")


def test_kernels_report_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HINTSERVE_CPU_KERNELS", "0")
    assert machine.native_kernels() == {"built": False, "why": "turned off by HINTSERVE_CPU_KERNELS=0"}


def test_kernels_report_a_missing_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.engine import cpu_kernels

    monkeypatch.setenv("CC", "no-such-compiler-here")
    cpu_kernels.forget_library()
    try:
        report = machine.native_kernels()
    finally:
        cpu_kernels.forget_library()
    assert not report["built"] and "no C compiler" in report["why"]


def test_redis_unreachable_is_reported() -> None:
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}"
        status = machine.redis_status(url)
    assert status["reachable"] is False and status["why"]


def test_redis_reachable_is_reported() -> None:
    status = machine.redis_status("redis://127.0.0.1:6379")
    if not status["reachable"]:
        pytest.skip(f"no Redis on 127.0.0.1:6379: {status['why']}")
    assert status["ping_ms"] > 0


@pytest.mark.parametrize(("text", "mode", "weights"), [
    ("always [madvise] never\n", "madvise", True), ("[always] madvise never\n", "always", True),
    ("always madvise [never]\n", "never", False), (None, None, False)])
def test_huge_pages_report_the_kernel_mode(text: str | None, mode: str | None, weights: bool, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    mode_file = tmp_path / "enabled"
    if text is not None:
        mode_file.write_text(text)
    status = huge_page_status(str(mode_file))
    assert (status["mode"], status["weights"]) == (mode, weights)
    assert bool(status["why"]) != weights
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert huge_page_status(str(mode_file))["why"] == "turned off by THP_MEM_ALLOC_ENABLE=0"
