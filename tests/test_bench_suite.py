"""`hintserve bench all`: every command it runs parses with the real CLI, and REPORT.md gathers the tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.bench import suite
from services.cli import build_parser


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_every_suite_command_parses(quick: bool, tmp_path: Path) -> None:
    commands = suite.suite_commands("models/demo-moe", str(tmp_path), quick)
    parser = build_parser()
    for argv in commands:
        args = parser.parse_args(argv)
        assert callable(args.func), argv
    kinds = {tuple(argv[:2]) for argv in commands}
    assert {("bench", "engine"), ("bench", "offload"), ("bench", "gateway"), ("bench", "online")} <= kinds
    grids = [argv for argv in commands if argv[:2] == ["bench", "offload"]]
    assert len(grids) == (1 if quick else 2)


def test_report_gathers_tables_and_commands(tmp_path: Path) -> None:
    (tmp_path / "engine.md").write_text("# Engine\n\n| a |\n|---|\n| 1 |\n")
    (tmp_path / "online.md").write_text("# Online\n\nno runs\n")
    report = Path(suite.write_report(str(tmp_path), [["bench", "engine", "--repeats", "2"]])).read_text()
    assert "## Engine throughput\n\n| a |" in report
    assert "## Online serving (Azure conv replay)\n\nno runs" in report
    assert "hintserve bench engine --repeats 2" in report
    assert "Offload policies" not in report  # tables not written are left out
