"""Checks of directories a service writes to, made at start so a bad path is one line and exit 2, not a
traceback later (the predictor's snapshot directory, the CPU kernel cache)."""

from __future__ import annotations

import os
import tempfile


def os_reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def check_writable_dir(path: str, what: str) -> None:
    """`path` is (or can be made) a directory this process can create files in; ValueError naming it."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".hintserve-write-check-"):
            pass
    except FileExistsError:
        raise ValueError(f"{what} {path}: exists and is not a directory") from None
    except OSError as exc:
        raise ValueError(f"{what} {path}: not usable: {os_reason(exc)}") from None
