"""The docs site builds strictly, its generated pages are fresh, every flag and knob is in the references,
every figure comes from a saved result through the generator, and the README stays short."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import build_parser
from services.docs.bench_tables import render_all, render_directive
from services.docs.cli_reference import options, subcommands
from services.docs.generate import BLOCK, generate, hand_written_pages
from tests.conftest import REPO_ROOT

DOCS = REPO_ROOT / "docs"
# Pages that keep dated measurements on purpose (histories), and the generated references.
HISTORY = {DOCS / "benchmarks" / "history.md", REPO_ROOT / "CHANGELOG.md"}
# A measured-looking figure: a number with a time or rate unit, or a ratio like 0.49x.
MEASURED = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|us|µs|tok/s|tokens/s)\b|\b\d+\.\d+x\b")


def test_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "knobs" / "index.html").is_file()


def test_generated_pages_are_fresh() -> None:
    stale = generate(REPO_ROOT, build_parser, check=True)
    assert not stale, f"run `hintserve docs generate` and commit: {stale}"
    assert str(REPO_ROOT) not in (DOCS / "reference" / "cli.md").read_text()  # the same in every checkout


def test_readme_is_short_and_keeps_the_ci_command() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    command = 'pip install torch==2.13.0 && pip install -e ".[dev]" && python -m pytest -q -n 2 --dist loadfile'
    assert command in readme and command in ci


def test_the_changelog_keeps_its_shape() -> None:
    """Keep a Changelog's layout, each entry once: a scripted edit once replaced an empty string and wrote one
    entry between every two characters of the file (10 MB)."""
    text = (REPO_ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog\n") and "## [Unreleased]" in text
    assert len(text) < 200_000 and max(map(len, text.splitlines())) <= 120
    entries = [e for e in re.split(r"^- ", text, flags=re.M)[1:] if len(e) > 80]
    assert len(entries) == len(set(entries)), "an entry appears twice"


def _sections(page: Path) -> dict[str, str]:
    parts = re.split(r"^## `([^`]+)`$", page.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_cli_flag_is_in_the_reference() -> None:
    from services.cli import build_parser

    sections = _sections(DOCS / "reference" / "cli.md")
    for path, parser, _ in subcommands(build_parser()):
        if not path:
            continue
        section = sections[" ".join(("hintserve", *path))]
        for action in options(parser):
            for flag in action.option_strings or [action.dest]:
                assert f"`{flag}`" in section, f"hintserve {' '.join(path)} {flag} missing from cli.md"


def test_every_knob_is_in_the_reference() -> None:
    from services.engine.config import EngineConfig
    from services.gateway.config import GatewayConfig

    knobs = (DOCS / "reference" / "knobs.md").read_text()
    for f in dataclasses.fields(EngineConfig):
        if f.name != "extra":
            row = next(line for line in knobs.splitlines() if f"| `{f.name}` |" in line)
            assert f"`HINTSERVE_{f.name.upper()}`" in row
    for f in dataclasses.fields(GatewayConfig):
        assert f"| `{f.name}` |" in knobs


def test_every_saved_result_is_on_the_results_page() -> None:
    page = (DOCS / "reference" / "benchmark-results.md").read_text()
    for path in (REPO_ROOT / "bench" / "results").glob("*.json"):
        assert f"## {path.stem}\n" in page


def _prose(text: str) -> str:
    """Text outside generated blocks, fenced code and inline code."""
    text = BLOCK.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def test_every_figure_comes_from_a_saved_result() -> None:
    """Measured figures appear only inside generated blocks (or on the history pages)."""
    found = []
    for page in hand_written_pages(REPO_ROOT):
        if page in HISTORY:
            continue
        for match in MEASURED.finditer(_prose(page.read_text())):
            found.append(f"{page.relative_to(REPO_ROOT)}: {match[0]!r}")
    assert not found, "type figures through a generated block, not by hand:\n" + "\n".join(found)


def test_every_block_names_a_saved_result() -> None:
    results = REPO_ROOT / "bench" / "results"
    for page in hand_written_pages(REPO_ROOT):
        for match in BLOCK.finditer(page.read_text()):
            kind, *rest = match["directive"].split()
            if kind in ("run", "record", "table", "pivot"):
                assert (results / rest[0]).is_file(), f"{page}: {rest[0]} is not in bench/results"


def test_generic_over_new_result_files(tmp_path: Path) -> None:
    """A result file the generator has never seen is rendered from its shape: run record, rows, pivots."""
    results = tmp_path / "results"
    results.mkdir()
    rows = [{"policy": p, "batch": b, "tpot_ms": t} for p, b, t in
            (("a", 1, 2.0), ("a", 4, 5.0), ("b", 1, 1.5), ("b", 4, 6.25), ("ref", 1, 1.0), ("ref", 4, 1.0))]
    (results / "new_bench.json").write_text(json.dumps({"machine": "box", "date": "2026-01-02", "rows": rows,
                                                        "cases": {"x": {"ok": 3}, "y": {"ok": 4}}}))
    page = render_all(results)
    assert "## new_bench" in page and "machine: box; date: 2026-01-02" in page and "| b | 4 | 6.25 |" in page
    assert "| x | 3 |" in page
    table = render_directive(results, "pivot new_bench.json rows=policy cols=batch value=tpot_ms bold=min "
                                      "unranked=ref")
    assert "| a | 2 | **5** |" in table and "| b | **1.5** | 6.25 |" in table and "| ref | 1 | 1 |" in table
    assert render_directive(results, "table new_bench.json where=batch=4;policy=b columns=tpot_ms").endswith(
        "| 6.25 |")
    with pytest.raises(ValueError, match="no list"):
        render_directive(results, "table new_bench.json list=missing")


def test_check_finds_stale_blocks_and_generate_fixes_them(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from services.cli import main

    root = tmp_path / "repo"
    (root / "bench").mkdir(parents=True)
    shutil.copytree(REPO_ROOT / "bench" / "results", root / "bench" / "results")
    (root / "docs").mkdir()
    (root / "README.md").write_text("<!-- generated: run engine.json -->\nhand-typed\n<!-- end generated -->\n")
    command = ["docs", "generate", "--root", str(root)]
    assert main([*command, "--check"]) == 1
    assert "stale: README.md" in capsys.readouterr().err
    assert main(command) == 0
    assert "Source: `bench/results/engine.json`" in (root / "README.md").read_text()
    assert main([*command, "--check"]) == 0
    capsys.readouterr()
    assert main(["docs", "generate", "--root", str(tmp_path / "nowhere")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
