"""The engine's allocator settings: large host activations come from the reused heap, not fresh mmaps."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None, reason="glibc's mallopt"
)

# Bytes glibc holds in mmapped chunks while an 8 MiB tensor lives, with and without the settings.
_PROBE = """
import ctypes, ctypes.util, sys, torch
from services.engine.host_allocator import keep_large_allocations
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = Mallinfo2
if sys.argv[1] == "keep":
    assert keep_large_allocations() and keep_large_allocations()  # once per process, then cached
before = libc.mallinfo2().hblkhd
x = torch.empty(2 << 20)  # 8 MiB
print(libc.mallinfo2().hblkhd - before)
"""


def _mmapped_bytes(mode: str) -> int:
    run = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return int(run.stdout.strip())


def test_large_allocations_leave_mmap() -> None:
    if not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2"):
        pytest.skip("glibc < 2.33 has no mallinfo2")
    assert _mmapped_bytes("default") >= 8 << 20  # glibc's default: a fresh mapping for every such tensor
    assert _mmapped_bytes("keep") == 0
