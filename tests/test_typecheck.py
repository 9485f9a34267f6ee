"""The typed boundaries stay typed: mypy (configured in pyproject.toml) finds nothing, and the few places that
tell it to look away are counted and say why."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

MAX_TYPE_IGNORES = 15
_IGNORE = re.compile(r"#\s*type:\s*ignore\b(?P<rest>.*)$")
# The reason follows the ignore as a comment of its own: `# type: ignore[code]  # why`.
_REASON = re.compile(r"^(\[[\w\-, ]+\])?\s+#\s*\S.{3,}")


def type_ignores() -> list[tuple[str, int, str]]:
    """(file, line, text after `type: ignore`) for every such comment in services and loadgen."""
    found = []
    for path in sorted([*(REPO_ROOT / "services").rglob("*.py"), *(REPO_ROOT / "loadgen").rglob("*.py")]):
        if "generated" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = _IGNORE.search(line)
            if match:
                found.append((str(path.relative_to(REPO_ROOT)), number, match["rest"]))
    return found


@pytest.mark.slow
def test_mypy_finds_no_errors() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO_ROOT, capture_output=True, text=True)
    if "No module named mypy" in result.stderr:
        pytest.skip("mypy not installed (pip install -e '.[dev]')")
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert result.returncode == 0 and not errors, "mypy:\n" + result.stdout[-6000:] + result.stderr[-2000:]


def test_few_type_ignores_each_with_a_reason() -> None:
    found = type_ignores()
    assert len(found) <= MAX_TYPE_IGNORES, f"{len(found)} `type: ignore` comments (at most {MAX_TYPE_IGNORES}):\n" + \
        "\n".join(f"{f}:{n}" for f, n, _ in found)
    unexplained = [f"{f}:{n}" for f, n, rest in found if not _REASON.match(rest)]
    assert not unexplained, "a `type: ignore` says why (`# type: ignore[code]  # reason`):\n" + "\n".join(unexplained)
