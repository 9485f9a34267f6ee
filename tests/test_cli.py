"""`hintserve generate` and `hintserve engine` through the real command line entry points."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services import cli

TIMING = re.compile(
    r"^\[hintserve\] prompt (\d+) tok, (\d+) tok generated in [\d.]+ s \(TTFT \d+ ms, [\d.]+ tok/s decode\)$"
)
PROMPT = "The quick brown fox"


def _expected_text(model_dir: str, prompt: str, max_tokens: int, **penalties: float) -> str:
    """The greedy completion from an in-process engine, to compare with what the CLI printed."""
    from services.engine.async_engine import AsyncLLMEngine
    from services.engine.config import EngineConfig
    from services.engine.sampling_params import SamplingParams

    async def run() -> str:
        engine = AsyncLLMEngine(EngineConfig(model=model_dir))
        await engine.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **penalties)
            return "".join([o.delta_text async for o in engine.generate("expected", prompt, params)])
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def _timing(stderr: str) -> tuple[int, int]:
    lines = [line for line in stderr.splitlines() if line.startswith("[hintserve]")]
    # the start-up line naming the kernels, then the timing line: nothing else
    assert len(lines) == 2 and "CPU kernels" in lines[0], stderr
    match = TIMING.match(lines[1])
    assert match, lines[1]
    return int(match.group(1)), int(match.group(2))


def test_generate_streams_text_and_timing(tiny_mixtral_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", tiny_mixtral_dir, "--prompt", PROMPT, "--max-tokens", "12", "--no-chat"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == _expected_text(tiny_mixtral_dir, PROMPT, 12) + "\n"
    prompt_tokens, completion_tokens = _timing(err)
    assert prompt_tokens > 0
    assert 1 <= completion_tokens <= 12


def test_generate_penalty_flags(tiny_mixtral_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--frequency-penalty", "1.5", "--presence-penalty", "-0.5", "--repetition-penalty", "1.3"]
    argv = ["generate", "--model", tiny_mixtral_dir, "--prompt", PROMPT, "--max-tokens", "12", "--no-chat"]
    assert cli.main([*argv, *flags]) == 0
    out, _ = capsys.readouterr()
    penalties = {"frequency_penalty": 1.5, "presence_penalty": -0.5, "repetition_penalty": 1.3}
    assert out == _expected_text(tiny_mixtral_dir, PROMPT, 12, **penalties) + "\n"
    assert out != _expected_text(tiny_mixtral_dir, PROMPT, 12) + "\n"


def test_generate_applies_chat_template_by_default(
    tiny_mixtral_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["generate", "--model", tiny_mixtral_dir, "--prompt", PROMPT, "--max-tokens", "2"]
    assert cli.main([*base, "--no-chat"]) == 0
    raw_prompt_tokens, _ = _timing(capsys.readouterr().err)
    assert cli.main(base) == 0
    chat_prompt_tokens, _ = _timing(capsys.readouterr().err)
    assert chat_prompt_tokens > raw_prompt_tokens  # the template wrapped the prompt in role markers


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "{missing}"], "model directory not found"),
        (["--model", "{empty}"], "no config.json"),
        (["--model", "{model}", "--max-tokens", "0"], "max_tokens"),
        (["--model", "{model}", "--temperature", "-1"], "temperature"),
        (["--model", "{model}", "--frequency-penalty", "2.5"], "frequency_penalty"),
        (["--model", "{model}", "--presence-penalty", "-3"], "presence_penalty"),
        (["--model", "{model}", "--repetition-penalty", "0"], "repetition_penalty"),
    ],
    ids=[
        "missing-dir",
        "no-config",
        "max-tokens-0",
        "negative-temperature",
        "frequency-penalty",
        "presence-penalty",
        "repetition-penalty",
    ],
)
def test_generate_bad_input_exits_2(
    tiny_mixtral_dir: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    paths = {"missing": str(tmp_path / "nope"), "empty": str(tmp_path), "model": tiny_mixtral_dir}
    argv = ["generate", "--prompt", "hi", *(a.format(**paths) for a in args)]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hintserve generate: error: ")
    assert message in lines[0]


def test_engine_bad_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["engine", "--model", str(tmp_path / "nope"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hintserve engine: error: ")


# Runs the `engine` subcommand in a child process via register() directly, so the test does not depend on
# every other service's CLI module being importable.
_ENGINE_MAIN = (
    "import argparse, sys\n"
    "from services.engine.cli import register\n"
    "parser = argparse.ArgumentParser(); register(parser.add_subparsers(dest='command'))\n"
    "args = parser.parse_args(sys.argv[1:]); sys.exit(args.func(args))\n"
)


@pytest.mark.slow
def test_engine_serves_until_sigterm(tiny_mixtral_dir: str) -> None:
    from services.engine.grpc_client import EngineClient
    from services.engine.sampling_params import SamplingParams

    repo_root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", _ENGINE_MAIN, "engine", "--model", tiny_mixtral_dir, "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=repo_root,  # `python -c` puts the working directory on sys.path
    )
    try:
        address = None
        assert proc.stderr is not None
        for line in proc.stderr:  # blocks until the server announces itself (or the process exits)
            match = re.search(r"engine serving \S+ on (\S+:\d+)", line)
            if match:
                address = match.group(1)
                break
        assert address, "engine exited before serving"

        async def talk() -> str:
            async with EngineClient(address) as client:
                assert await client.health()
                params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
                outs = [o async for o in client.generate("cli-engine", PROMPT, params)]
                return outs[-1].finish_reason

        assert asyncio.run(talk()) == "length"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
