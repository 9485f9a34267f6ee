"""loadgen pieces without a server: trace parsing and slicing, clipping, Poisson arrivals, exact prompt lengths,
metrics, and the command line's exit code 2 on bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loadgen import cli, trace
from loadgen.client import RequestResult
from loadgen.metrics import compute_metrics, format_table, parse_goodput
from loadgen.prompts import SHAREGPT_PATH, PromptBuilder, load_tokenizer, make_builder
from tests.conftest import REPO_ROOT

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,0
2023-11-16 18:16:46.6805901,5000,300
"""


def test_load_trace_relative_times_exact(tmp_path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(CSV)
    rows = trace.load_trace(path)
    assert [r[1:] for r in rows] == [(374, 44), (396, 109), (879, 0), (5000, 300)]
    assert [r[0] for r in rows] == pytest.approx([0.0, 4.314579, 4.541877, 60.0000001], abs=1e-9)


def test_named_traces_are_committed_and_complete() -> None:
    assert trace.resolve_trace("conv") == REPO_ROOT / "data" / "azure" / "AzureLLMInferenceTrace_conv.csv"
    assert len(trace.load_trace(trace.resolve_trace("code"))) == 8819
    assert (REPO_ROOT / "data" / "azure" / "LICENSE-CC-BY-4.0.txt").is_file()
    assert "Splitwise" in (REPO_ROOT / "data" / "azure" / "ATTRIBUTION.md").read_text()


def test_trace_errors_are_clear(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(trace, "TRACE_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="AzurePublicDataset"):
        trace.resolve_trace("conv")
    with pytest.raises(FileNotFoundError, match="not found"):
        trace.resolve_trace(str(tmp_path / "nope.csv"))
    bad = tmp_path / "bad.csv"
    bad.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(ValueError, match="missing column"):
        trace.load_trace(bad)


@pytest.mark.parametrize(
    ("inp", "out", "limit", "want"),
    [
        (100, 20, None, (100, 20)),
        (100, 20, 120, (100, 20)),
        (5000, 200, 4096, (3896, 200)),  # input is cut first, the output (decode work) kept
        (10, 5000, 4096, (1, 4095)),  # output alone too long: 1 input token, the rest output
        (0, 0, 8, (1, 1)),
        (3, 4, 2, (1, 1)),
    ],
)
def test_clip_lengths(inp: int, out: int, limit: int | None, want: tuple[int, int]) -> None:
    assert trace.clip_lengths(inp, out, limit) == want


def test_trace_slice_offset_speedup_duration_and_count() -> None:
    rows = [(float(t), 10 + t, 5) for t in range(10)]
    reqs = trace.trace_requests(rows, speedup=2.0, start_offset_s=3.0, duration_s=2.5, max_context=14)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert [(r.input_len, r.output_len) for r in reqs] == [(9, 5)] * 5  # 13..17 input clipped to 14 - 5
    assert len(trace.trace_requests(rows, max_requests=3)) == 3


def test_poisson_is_seeded_and_bounded() -> None:
    a = trace.poisson_requests(5.0, 8, 4, num_requests=200, seed=3)
    assert a == trace.poisson_requests(5.0, 8, 4, num_requests=200, seed=3)
    assert a[0].arrival_s == 0.0 and len(a) == 200
    assert 200 / a[-1].arrival_s == pytest.approx(5.0, rel=0.25)
    assert all(r.arrival_s < 2.0 for r in trace.poisson_requests(5.0, 8, 4, duration_s=2.0))
    assert {r.arrival_s for r in trace.poisson_requests(float("inf"), 8, 4, num_requests=4)} == {0.0}
    with pytest.raises(ValueError):
        trace.poisson_requests(float("inf"), 8, 4, duration_s=1.0)


LENGTHS = [1, 2, 3, 7, 31, 128, 777, 3000]


@pytest.mark.parametrize("source", ["sharegpt", "synthetic"])
def test_exact_prompt_lengths_with_tokenizer(tiny_mixtral_dir: str, source: str) -> None:
    if source == "sharegpt" and not SHAREGPT_PATH.is_file():
        pytest.skip("ShareGPT prompts not available")
    builder = make_builder(source, tiny_mixtral_dir, seed=1)
    tok = load_tokenizer(tiny_mixtral_dir)
    prompts = [builder.build(n) for n in LENGTHS]
    assert [len(tok(p)["input_ids"]) for p in prompts] == LENGTHS
    assert builder.inexact == 0
    assert len(set(prompts[-3:])) == 3  # random offsets: no shared prompts across requests


def test_exact_lengths_count_special_tokens(tiny_mixtral_dir: str) -> None:
    """A tokenizer that adds BOS (as Llama/Mixtral ones do): the prompt text is one token shorter, so the server
    counts exactly the wanted length."""
    from tokenizers import processors

    tok = load_tokenizer(tiny_mixtral_dir)
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    assert tok("hello")["input_ids"][0] == bos
    builder = PromptBuilder(["The quick brown fox jumps over the lazy dog."] * 50, tok, seed=0)
    assert [len(tok(builder.build(n))["input_ids"]) for n in (2, 9, 100)] == [2, 9, 100]


def test_prompts_without_tokenizer_approximate() -> None:
    builder = make_builder("synthetic", None, seed=0)
    assert len(builder.build(40).split()) == 40  # 1 common word ~ 1 token


def _result(i: int, ttft: float, latency: float, n: int, ok: bool = True) -> RequestResult:
    r = RequestResult(i, 0.0, 10, n, success=ok, ttft=ttft, latency=latency, completion_tokens=n,
                      itl=[(latency - ttft) / max(n - 1, 1)] * (n - 1), error="" if ok else "HTTP 500: boom")
    return r


def test_metrics_match_vllm_definitions() -> None:
    results = [_result(0, 0.1, 1.0, 10), _result(1, 0.3, 0.3, 1), _result(2, 0, 0, 5, ok=False)]
    m = compute_metrics(results, 2.0, parse_goodput(["ttft:200", "tpot:100"]))
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 20, 11)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 5.5
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # single-token outputs have no TPOT
    assert m["request_goodput"] == 0.5  # request 1 misses the TTFT SLO
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["p99_e2el_ms"] == pytest.approx(993.0)
    assert m["error_counts"] == {"HTTP 500": 1} and m["error_samples"] == ["HTTP 500: boom"]
    table = format_table(m)
    assert "Request goodput (req/s):                 0.50" in table and "P90 ITL (ms):" in table


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "--model", "m"],  # no --url
        ["replay", "--url", "http://x", "--model", "m", "--speedup", "-1"],
        ["replay", "--url", "http://x", "--model", "m", "--goodput", "ttft:abc"],
        ["replay", "--url", "http://x", "--model", "m", "--goodput", "latency:5"],
        ["replay", "--url", "http://x", "--model", "m", "--max-context", "1"],
        ["replay", "--url", "http://x", "--model", "m", "--trace", "/nonexistent.csv"],
        ["replay", "--url", "x", "--model", "m"],
        ["poisson", "--url", "http://x", "--model", "m", "--rate", "0"],
        ["poisson", "--url", "http://x", "--model", "m", "--rate", "1", "--prompts", "/nonexistent.json"],
        ["bogus"],
    ],
)
def test_cli_bad_input_exits_2(argv: list[str], capsys) -> None:
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "error:" in err


def test_module_entry_point_exits_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "loadgen", "replay", "--url", "http://x", "--model", "m",
                           "--max-requests", "0"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "max_requests must be >= 1" in proc.stderr
