"""The codebase stays ruff-clean (part of the one test command)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


def test_ruff_clean() -> None:
    if shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"]).returncode:
        pytest.skip("ruff not installed")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
