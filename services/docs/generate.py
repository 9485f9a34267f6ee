"""Writes (or, with check, compares) every generated page and every generated block in the hand-written pages.

A hand-written page (docs/**/*.md, README.md) asks for a generated figure with a block:

    <!-- generated: pivot offload_hybrid.json rows=policy cols=batch value=tpot_ms bold=min -->
    (filled in by `hintserve docs generate`)
    <!-- end generated -->

`headline [link-prefix]` gives the headline results table, `grafana PATH` a dashboard's panels (PATH from the
repository root), `calibration` the simulator's published-figure checks (`hintserve simulate --calibration`,
computed, deterministic); the other kinds are bench_tables.render_directive's.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

from services.docs import bench_tables, cli_reference, dashboards, headlines, http_api, knobs, policies

GENERATED_PAGES = ("docs/reference/cli.md", "docs/reference/knobs.md", "docs/reference/http-api.md",
                   "docs/reference/benchmark-results.md")
BLOCK = re.compile(r"(<!-- generated: (?P<directive>[^>]*?) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


def _pages(root: Path, build_parser: Callable[[], argparse.ArgumentParser]) -> dict[str, Callable[[], str]]:
    """Whole generated pages, relative to the repository root. `build_parser` is the command line's: it is
    passed down (services/cli.py sits above this package and registers its command)."""
    results = root / "bench" / "results"
    return {
        "docs/reference/cli.md": lambda: cli_reference.render(build_parser()),
        "docs/reference/knobs.md": lambda: knobs.render(build_parser(), root),
        "docs/reference/http-api.md": lambda: http_api.render(http_api.openapi_schema()),
        "docs/reference/benchmark-results.md": lambda: bench_tables.render_all(results),
    }


def fill_blocks(text: str, root: Path) -> str:
    """`text` with every generated block's body rendered afresh from the saved results (and dashboards)."""
    results = root / "bench" / "results"

    def fill(match: re.Match[str]) -> str:
        directive = match["directive"].strip()
        kind, _, rest = directive.partition(" ")
        if kind == "headline":
            body = headlines.render(results, link_prefix=rest.strip())
        elif kind == "policies":
            body = policies.render()
        elif kind == "grafana":
            body = dashboards.render(root / rest.strip())
        elif kind == "calibration":
            from services.simulator.cli import calibration_markdown

            body = calibration_markdown()
        else:
            body = bench_tables.render_directive(results, directive)
        return f"{match[1]}{body}\n{match[4]}"

    return BLOCK.sub(fill, text)


def hand_written_pages(root: Path) -> list[Path]:
    generated = {root / p for p in GENERATED_PAGES}
    return [root / "README.md", *(p for p in sorted((root / "docs").rglob("*.md")) if p not in generated)]


def generate(root: Path, build_parser: Callable[[], argparse.ArgumentParser], check: bool = False) -> list[str]:
    """Writes every generated page and block; with `check`, writes nothing and returns the stale paths."""
    pages = _pages(root, build_parser)
    assert set(pages) == set(GENERATED_PAGES)
    wanted = {root / path: render() + "\n" for path, render in pages.items()}
    for page in hand_written_pages(root):
        if page.is_file():
            wanted[page] = fill_blocks(page.read_text(), root)
    stale = []
    for path, text in wanted.items():
        if path.is_file() and path.read_text() == text:
            continue
        stale.append(str(path.relative_to(root)))
        if not check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return stale
