"""The start-up contract: every bad model directory, path or permission is one line on stderr naming the file
and the problem, and exit code 2 (issue 30: a truncated model.safetensors or a bad config.json gave 42-93
lines of tracebacks and exit 1). One test per case, through the real CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from services import cli
from tests.live_processes import hintserve

Breakage = Callable[[Path], None]


def _truncate(model: Path) -> None:
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _index_with_missing_shard(model: Path) -> None:
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    weight_map = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


# (case, how the copy of a good model directory is broken, what the line must say besides the file's name)
MODEL_CASES: list[tuple[str, Breakage, str, str]] = [
    ("config-missing", lambda m: (m / "config.json").unlink(), "no config.json", ""),
    ("config-empty", lambda m: (m / "config.json").write_text(""), "config.json", "is empty"),
    ("config-not-json", lambda m: (m / "config.json").write_text("{model_type: mixtral"), "config.json",
     "not valid JSON"),
    ("config-not-an-object", lambda m: (m / "config.json").write_text("[1, 2]"), "config.json", "JSON object"),
    ("unsupported-family", lambda m: (m / "config.json").write_text('{"model_type": "llama"}'), "config.json",
     "unsupported model_type 'llama'"),
    ("weights-missing", lambda m: (m / "model.safetensors").unlink(), "no model.safetensors", ""),
    ("weights-truncated", _truncate, "model.safetensors", "truncated"),
    ("weights-corrupt-header", lambda m: (m / "model.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"garbage!" * 2),
     "model.safetensors", "corrupt safetensors header"),
    ("weights-not-safetensors", lambda m: (m / "model.safetensors").write_bytes(b"PK\x03\x04"), "model.safetensors",
     "truncated or not a safetensors file"),
    ("shard-missing", _index_with_missing_shard, "model.safetensors.index.json",
     "model-00002-of-00002.safetensors"),
    ("tokenizer-broken", lambda m: (m / "tokenizer.json").write_text("{not json"), "", "tokenizer does not load"),
]


def _broken_model(good: str, tmp_path: Path, breakage: Breakage) -> Path:
    model = tmp_path / "model"
    shutil.copytree(good, model)
    breakage(model)
    return model


def _one_line(capfd: pytest.CaptureFixture[str], *must_say: str) -> str:
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for text in must_say:
        assert text in err[0], (text, err[0])
    return err[0]


@pytest.mark.parametrize("case,breakage,names,says", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_bad_model_directory_is_one_line_and_exit_2(
    case: str, breakage: Breakage, names: str, says: str, tiny_mixtral_dir: str, tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    model = _broken_model(tiny_mixtral_dir, tmp_path, breakage)
    assert cli.main(["engine", "--model", str(model), "--port", "0"]) == 2
    _one_line(capfd, str(model), *(n for n in (names, says) if n))


def test_model_directory_missing(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["engine", "--model", str(tmp_path / "nope"), "--port", "0"]) == 2
    _one_line(capfd, str(tmp_path / "nope"), "not found")


@pytest.mark.parametrize("command", ["engine", "serve"])
def test_truncated_weights_as_a_real_process(command: str, tiny_mixtral_dir: str, tmp_path: Path) -> None:
    """End to end, nothing in process: no traceback from the engine core's process either."""
    model = _broken_model(tiny_mixtral_dir, tmp_path, _truncate)
    done = subprocess.run(hintserve(command, "--model", str(model), "--port", "0"), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.safetensors: truncated" in lines[0], lines


def test_bad_kernel_cache_dir(tiny_mixtral_dir: str, tmp_path: Path, capfd: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HINTSERVE_KERNEL_CACHE", str(blocker / "kernels"))
    assert cli.main(["engine", "--model", tiny_mixtral_dir, "--port", "0"]) == 2
    _one_line(capfd, "HINTSERVE_KERNEL_CACHE", str(blocker / "kernels"), "not usable")


def test_gateway_tokenizer_that_does_not_load(tiny_mixtral_dir: str, tmp_path: Path,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    model = _broken_model(tiny_mixtral_dir, tmp_path, lambda m: (m / "tokenizer.json").write_text("{not json"))
    argv = ["gateway", "--engines", "127.0.0.1:1", "--tokenizer", str(model), "--no-auth", "--port", "0"]
    assert cli.main(argv) == 2
    _one_line(capfd, str(model), "tokenizer does not load")


@pytest.mark.parametrize("content,says", [(b"\xff\xfe\x00bad", "not UTF-8"), (None, "not found")],
                         ids=["not-utf8", "a-directory"])
def test_bad_api_key_file(content: bytes | None, says: str, tmp_path: Path,
                          capfd: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    assert cli.main(["gateway", "--engines", "127.0.0.1:1", "--api-key-file", str(path), "--port", "0"]) == 2
    _one_line(capfd, str(path), says)


@pytest.mark.parametrize("where", ["is-a-file", "under-a-file"])
def test_bad_snapshot_dir(where: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = blocker if where == "is-a-file" else blocker / "snapshots"
    argv = ["predictor", "--redis-url", "redis://127.0.0.1:6379/0", "--grpc-port", "-1", "--metrics-port", "-1",
            "--snapshot-dir", str(path)]
    assert cli.main(argv) == 2
    _one_line(capfd, "--snapshot-dir", str(path))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_experts_a_torch_cannot_run_are_refused_at_start_up(dtype: str, monkeypatch) -> None:
    """On CUDA an older torch lacks the int8 kernel (before 2.9) or packs int4 otherwise (before 2.5): the
    check runs one tiny product through the engine's path and says so, not the first request. Here on the
    CPU's path, with the product made to fail as such a torch's does."""
    from services.engine import startup_checks
    from services.engine.quant import kernels

    startup_checks.check_expert_kernels("cpu", dtype, 64)  # this torch runs it
    startup_checks.check_expert_kernels("cpu", "bf16", 64)  # nothing to check

    def missing(*_: object) -> None:
        raise NotImplementedError("Could not run 'aten::_weight_int8pack_mm' with arguments from the 'CUDA' backend")

    monkeypatch.setattr(kernels, "packed_linear", missing)
    with pytest.raises(ValueError, match=f"--expert-dtype {dtype} on cpu: torch .* cannot run it .*torch >= 2.9"):
        startup_checks.check_expert_kernels("cpu", dtype, 64)
