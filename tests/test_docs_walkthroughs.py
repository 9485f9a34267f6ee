"""The four walk-throughs, run as written: every bash and python block of each page, in order (blocks marked
`<!-- needs: gpu|docker -->` are skipped here and listed as skipped tests)."""

from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, SHARED_DIR
from tests.docs_pages import PageRunner, blocks

WALKTHROUGHS = ("demo.md", "quantized-checkpoint.md", "pick-a-policy.md", "compose-grafana.md")
TRACE = SHARED_DIR / "data" / "routing" / "mixtral-speculative-moe" / "humaneval_2_routing.jsonl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_page(page: str, env: dict[str, str] | None = None, cwd: Path = REPO_ROOT) -> PageRunner:
    runner = PageRunner(_free_port(), env or {}, cwd)
    try:
        for block in blocks(f"walkthroughs/{page}"):
            if block.needs is None and block.lang in ("bash", "python"):
                runner.run_block(block)
    finally:
        runner.close()
    return runner


def test_start_the_demo() -> None:
    runner = _run_page("demo.md")
    assert any("services.cli serve --port" in cmd for cmd in runner.ran) and len(runner.ran) >= 5


def test_serve_a_quantized_checkpoint(tmp_path: Path) -> None:
    from tests.quant_checkpoints import quantize_checkpoint
    from tests.tiny_models import build_tiny_model

    dense = build_tiny_model("mixtral", str(tmp_path / "dense"))
    model, _, _ = quantize_checkpoint(dense, str(tmp_path / "gptq"), "gptq")
    runner = _run_page("quantized-checkpoint.md", {"MODEL": model})
    assert len(runner.ran) == 4


def test_pick_a_policy() -> None:
    if not TRACE.is_file():
        pytest.skip(f"routing trace not here: {TRACE}")
    runner = _run_page("pick-a-policy.md")
    rows = {line.split("|")[1].strip() for line in runner.last_output.splitlines() if line.startswith("| ")}
    assert {"lru", "cpu-experts", "fiddler", "hintserve"} <= rows


def test_compose_walkthrough_matches_the_stack(tmp_path: Path) -> None:
    """The non-Docker commands run (in a scratch copy), and every variable and panel the page names exists."""
    shutil.copy(REPO_ROOT / ".env.example", tmp_path / ".env.example")
    _run_page("compose-grafana.md", cwd=tmp_path)
    assert (tmp_path / ".env").read_text() == (REPO_ROOT / ".env.example").read_text()
    page = (REPO_ROOT / "docs" / "walkthroughs" / "compose-grafana.md").read_text()
    settings = (REPO_ROOT / ".env.example").read_text()
    for name in set(re.findall(r"`((?:HINTSERVE|GRAFANA|REDIS)_[A-Z_]+)`", page)) - {"HINTSERVE_<FIELD>"}:
        assert re.search(rf"^{name}=", settings, re.M), f"{name} is not in .env.example"
    api_key = re.search(r"^HINTSERVE_API_KEYS=(.*)$", settings, re.M)[1]
    assert f"Bearer {api_key}" in page
    dashboard = json.loads((REPO_ROOT / "deploy" / "grafana" / "dashboards" / "hintserve.json").read_text())
    titles = {p.get("title") for p in dashboard["panels"]} | {dashboard.get("title")}
    for name in re.findall(r"\*\*([^*]+)\*\*", page):
        assert name in titles, f"panel {name!r} is not on the dashboard"


@pytest.mark.parametrize("page,index", [(p, i) for p in WALKTHROUGHS for i, b in enumerate(blocks(f"walkthroughs/{p}"))
                                        if b.needs])
def test_marked_blocks(page: str, index: int) -> None:
    """Blocks that need a GPU or Docker: run where one is, skipped here."""
    block = blocks(f"walkthroughs/{page}")[index]
    if block.needs == "docker" and shutil.which("docker"):
        pytest.skip("Docker blocks start a whole stack: run them by hand")
    pytest.skip(f"needs {block.needs}")
