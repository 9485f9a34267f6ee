"""`hintserve gateway` / `hintserve serve` flags and auth policy, the all-in-one server, the admin replay."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from services import cli
from services.gateway.cli import resolve_auth
from services.gateway.engine_client import InProcessEngineClient
from tests.test_gateway_support import API_KEY, MODEL, running_gateway, started_engine

ADMIN_KEY = "admin-secret"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HINTSERVE_API_KEYS", raising=False)
    monkeypatch.delenv("HINTSERVE_ADMIN_KEY", raising=False)


def _args(argv: list[str]) -> object:
    return cli.build_parser().parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gateway", "--engines", "127.0.0.1:1"], "no API keys configured"),
        (["gateway", "--engines", "nonsense", "--no-auth"], "--engines: 'nonsense' is not host:port"),
        (["gateway", "--engines", "a:1,a:1", "--no-auth"], "twice"),
        (["gateway", "--engines", "a:1", "--no-auth", "--max-queue", "-1"], "--max-queue"),
        (["gateway", "--engines", "a:1", "--no-auth", "--batch-window-ms", "5000"], "--batch-window-ms"),
        (["gateway", "--engines", "a:1", "--no-auth", "--port", "70000"], "--port"),
        (["gateway", "--engines", "a:1", "--no-auth", "--api-key-file", "k"], "contradict"),
        (["gateway", "--engines", "a:1", "--api-key-file", "/nonexistent/keys"], "--api-key-file not found"),
        (["serve", "--model", "/nonexistent/model"], "model directory not found"),
        (["serve", "--host", "0.0.0.0"], "only on loopback"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_busy_port_fails_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["gateway", "--engines", "127.0.0.1:1", "--no-auth", "--port", str(port)]) == 2
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err


def test_auth_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, line = resolve_auth(_args(["serve"]), loopback_default_off=True)
    assert keys is None and "authentication is OFF" in line and "loopback" in line
    with pytest.raises(ValueError, match="no API keys"):
        resolve_auth(_args(["serve", "--host", "10.1.2.3"]), loopback_default_off=True)
    keys, line = resolve_auth(_args(["serve", "--host", "0.0.0.0", "--no-auth"]), loopback_default_off=True)
    assert keys is None and "--no-auth" in line
    with pytest.raises(ValueError, match="no API keys"):  # gateway: never off by default, even on loopback
        resolve_auth(_args(["gateway", "--engines", "a:1"]), loopback_default_off=False)

    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nk-file-1\n\nk-file-2\n")
    monkeypatch.setenv("HINTSERVE_API_KEYS", "k-env-1, k-env-2")
    keys, line = resolve_auth(_args(["serve", "--api-key-file", str(key_file)]), loopback_default_off=True)
    assert keys == ["k-env-1", "k-env-2", "k-file-1", "k-file-2"] and "4 API key(s)" in line


def test_serve_all_in_one_subprocess(tiny_mixtral_dir: str) -> None:
    """`hintserve serve` as users run it: loopback without keys (and says so), OpenAI API up, clean Ctrl-C."""
    env = {k: v for k, v in os.environ.items() if k not in ("HINTSERVE_API_KEYS", "HINTSERVE_ADMIN_KEY")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--model", tiny_mixtral_dir, "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        lines = []
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line)
            if match := re.search(r"with the OpenAI API at (http://\S+)/v1", line):
                break
        else:
            pytest.fail("".join(lines))
        assert any("authentication is OFF" in line for line in lines), lines
        url = match.group(1)
        with httpx.Client(base_url=url, timeout=30) as http:
            name = Path(tiny_mixtral_dir).name
            assert http.get("/v1/models").json()["data"][0]["id"] == name
            r = http.post(
                "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
async def admin_gateway(tiny_mixtral_dir: str) -> AsyncIterator[SimpleNamespace]:
    async with started_engine(tiny_mixtral_dir, max_num_seqs=8) as engine:
        async with running_gateway(
            [InProcessEngineClient(engine)], tiny_mixtral_dir, admin_key=ADMIN_KEY
        ) as (
            gateway,
            server,
        ):
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                yield SimpleNamespace(gateway=gateway, server=server, http=http)


def _admin(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_replay_endpoint_auth_and_validation(
    admin_gateway: SimpleNamespace, tiny_mixtral_dir: str
) -> None:
    http = admin_gateway.http
    assert (await http.post("/v1/admin/replay", json={"trace": "conv"})).status_code == 401
    assert (
        await http.post("/v1/admin/replay", json={"trace": "conv"}, headers=_admin(API_KEY))
    ).status_code == 401
    pytest.importorskip("loadgen.replay")
    for body, param in [
        ({"trace": "conv", "bogus": 1}, "bogus"),
        ({"trace": "conv", "url": "http://elsewhere"}, "url"),
        ({"trace": "conv", "json_path": "/tmp/x.json"}, "json_path"),
    ]:
        r = await http.post("/v1/admin/replay", json=body, headers=_admin(ADMIN_KEY))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = await http.post("/v1/admin/replay", json={"trace": "conv", "speedup": -1}, headers=_admin(ADMIN_KEY))
    assert r.status_code == 400 and "speedup" in r.json()["error"]["message"]
    r = await http.post("/v1/admin/replay", content=b"{nope",
                        headers={**_admin(ADMIN_KEY), "content-type": "application/json"})
    assert r.status_code == 400

    # Without HINTSERVE_ADMIN_KEY the admin API is off.
    backend = admin_gateway.gateway.pool.engines[0].client
    async with running_gateway([backend], tiny_mixtral_dir) as (_, server):
        async with httpx.AsyncClient(base_url=server.url) as other:
            r = await other.post("/v1/admin/replay", json={"trace": "conv"}, headers=_admin(ADMIN_KEY))
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"


async def test_replay_endpoint_runs_a_trace_slice(admin_gateway: SimpleNamespace) -> None:
    pytest.importorskip("loadgen.replay")
    body = {"trace": "conv", "max_requests": 3, "speedup": 1000.0, "max_context": 48, "prompts": "synthetic"}
    r = await admin_gateway.http.post("/v1/admin/replay", json=body, headers=_admin(ADMIN_KEY))
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["completed"] == 3 and report["failed"] == 0
    assert report["model_id"] == MODEL
    assert report["mean_ttft_ms"] > 0
