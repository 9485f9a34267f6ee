"""`hintserve bench gateway`: the engine alone, over gRPC, and behind the gateway driven by its load client in a
process of its own (gateway_load_client.py), on the demo model."""

from __future__ import annotations

import json
from pathlib import Path

from services.cli import main


def test_the_three_paths_stream_every_token(demo_model_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "gw.json"
    args = ["--model", demo_model_dir, "--concurrency", "2", "--rounds", "1", "--max-tokens", "3", "--json", str(out)]
    assert main(["bench", "gateway", *args]) == 0
    saved = json.loads(out.read_text())
    for path in ("engine", "grpc", "gateway"):
        assert saved[path]["tokens"] == 2 * 3, path  # the measured round's, every request's every token
        assert 0 < saved[path]["ttft_p50_ms"] <= saved[path]["ttft_p90_ms"]
    gateway = saved["gateway"]
    assert gateway["cpu_s"] > 0 and gateway["cpu_per_100_tok_s"] > 0
    assert gateway["client_cpu_s"] > 0  # reported by the load client from its own process
    assert (tmp_path / "gw.md").is_file() and (tmp_path / "gw.png").stat().st_size > 0
