"""`hintserve bench vs-llamacpp`: both systems on one tiny real-shape checkpoint, rounds kept, medians reported.

llama.cpp's side needs llama-cpp-python in its own virtualenv ($HINTSERVE_LLAMA_PYTHON) and llama.cpp's source
tree for the converter ($HINTSERVE_LLAMA_CPP_SRC); without them that test skips and HintServe's side is still
tested here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.bench.llamacpp import llama_importable
from services.bench.vs_llamacpp import FORMATS, Workload, gguf_file, run_hintserve
from services.cli import main

LLAMA_PYTHON = os.environ.get("HINTSERVE_LLAMA_PYTHON", "")
LLAMA_SRC = os.environ.get("HINTSERVE_LLAMA_CPP_SRC", "")


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> str:
    """One Qwen3-30B-A3B layer with 8 experts and 512 tokens (120 MB)."""
    out = tmp_path_factory.mktemp("vs-llamacpp") / "qwen3"
    args = ["--layers", "1", "--experts", "8", "--vocab-size", "512", "--out", str(out)]
    assert main(["demo-model", "build", "--shape", "qwen3-30b-a3b", "--random", *args]) == 0
    return str(out)


def test_hintserve_case_reports_its_figures(tiny_qwen3: str) -> None:
    case = Workload(prompt_len=8, new_tokens=5, prefill_len=24).case(512)
    figures = run_hintserve(tiny_qwen3, "q4_0", 1, case)
    assert len(figures["tokens"]) == 5 and figures["decode_tok_s"] > 0 and figures["prefill_tok_s"] > 0
    assert figures["max_rss_mb"] > 100  # the 120 MB checkpoint, in fp32 around its int4 experts
    assert 30 < figures["tensor_mb"] < figures["max_rss_mb"] - figures["start_rss_mb"]


def _llama_or_skip() -> None:
    if not (LLAMA_PYTHON and llama_importable(LLAMA_PYTHON)):
        pytest.skip("llama-cpp-python not importable: set HINTSERVE_LLAMA_PYTHON to its virtualenv's python")
    if not (LLAMA_SRC and os.path.isfile(os.path.join(LLAMA_SRC, "convert_hf_to_gguf.py"))):
        pytest.skip("no llama.cpp source tree: set HINTSERVE_LLAMA_CPP_SRC to the folder of convert_hf_to_gguf.py")


@pytest.mark.slow
def test_both_systems_in_alternating_rounds(tiny_qwen3: str, tmp_path: Path) -> None:
    _llama_or_skip()
    out = tmp_path / "vs.json"
    args = ["--model", tiny_qwen3, "--llama-python", LLAMA_PYTHON, "--llama-cpp-src", LLAMA_SRC, "--gguf-dir",
            str(tmp_path / "gguf"), "--formats", "f32,bf16", "--threads", "1", "--rounds", "2", "--prompt-len", "8",
            "--new-tokens", "6", "--prefill-len", "32", "--json", str(out)]
    assert main(["bench", "vs-llamacpp", *args]) == 0
    saved = json.loads(out.read_text())
    for system in ("llama.cpp", "hintserve"):
        for fmt in ("f32", "bf16"):
            rounds = saved["rounds_kept"][system][fmt]["1"]
            assert len(rounds) == 2 and all(len(r["tokens"]) == 6 for r in rounds), rounds
            decode = sorted(r["decode_tok_s"] for r in rounds)
            assert saved["medians"][system][fmt]["1"]["decode_tok_s"] == pytest.approx(sum(decode) / 2)
    assert saved["formats"]["bf16"]["gguf_bytes"] < saved["formats"]["f32"]["gguf_bytes"] * 0.6
    # The same f32 math on the same checkpoint: greedy decoding agrees from the start.
    assert saved["rounds_kept"]["hintserve"]["f32"]["1"][0]["tokens"][:3] == \
        saved["rounds_kept"]["llama.cpp"]["f32"]["1"][0]["tokens"][:3]
    assert "| bf16 / BF16 | 1 |" in (tmp_path / "vs.md").read_text()
    assert (tmp_path / "vs.png").stat().st_size > 0


@pytest.mark.slow
def test_q4_0_comes_from_llamacpps_quantizer(tiny_qwen3: str, tmp_path: Path) -> None:
    _llama_or_skip()
    gguf = gguf_file(tiny_qwen3, tmp_path, "q4_0", LLAMA_PYTHON, LLAMA_SRC)
    base = tmp_path / "qwen3-BF16.gguf"  # what it is quantized from, converted on the way
    assert gguf.name == "qwen3-Q4_0.gguf" and gguf.stat().st_size < base.stat().st_size / 2.5
    assert gguf_file(tiny_qwen3, tmp_path, "q4_0", LLAMA_PYTHON, None) == gguf  # kept: no source needed again


@pytest.mark.parametrize("bad", [["--formats", "q5_k"], ["--rounds", "0"], ["--llama-python", "/nonexistent/python"]])
def test_bad_arguments_exit_2_with_one_line(bad: list[str], tiny_qwen3: str, capsys) -> None:
    args = {"--llama-python": "/nonexistent/python", "--formats": "f32", "--rounds": "1"}
    args.update(dict(zip(bad[::2], bad[1::2], strict=True)))
    assert main(["bench", "vs-llamacpp", "--model", tiny_qwen3, *[x for kv in args.items() for x in kv]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0]


def test_every_format_names_engine_settings() -> None:
    assert set(FORMATS) == {"f32", "bf16", "q8_0", "q4_0"} and all(p.engine.get("dtype") for p in FORMATS.values())
