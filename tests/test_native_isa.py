"""The native matmul's loops for each instruction set they have, against a scalar reference
(tests/native/check_kernels.c): this machine's -march=native build, the portable build, and aarch64 (NEON, and
NEON with SDOT) built with Debian's cross compiler and run under qemu-user, where those are installed (.ci/run
installs them)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from services.engine import cpu_kernels

CHECK = Path(__file__).parent / "native" / "check_kernels.c"
KERNELS = Path(cpu_kernels.__file__).parent
SOURCES = [KERNELS / name for name in ("expert_f32.c", "attention.c", "norm_rope.c", "matmul.c", "rows.c",
                                           "threadpool.c", "moe.c", "amx.c", "amx_q4.c")]
CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
HOST_CC = shutil.which("cc")


def build_and_run(compiler: str, flags: list[str], tmp_path: Path, runner: list[str] | None = None) -> str:
    exe = tmp_path / "check_kernels"
    subprocess.run([compiler, *flags, "-fno-math-errno", f"-I{KERNELS}", "-o", str(exe), str(CHECK),
                    *map(str, SOURCES), "-lpthread", "-lm"], check=True, capture_output=True, text=True, timeout=300)
    done = subprocess.run([*(runner or []), str(exe)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ", 0 failed" in done.stdout
    return done.stdout


# The native build under AddressSanitizer: a scratch buffer sized short (the MoE's packed AMX rows were, for
# experts at the fewest rows the tiles take) is a write past its end, caught here however the heap lies.
SANITIZED = ["-O1", "-march=native", "-fsanitize=address", "-fno-omit-frame-pointer"]


@pytest.mark.skipif(HOST_CC is None, reason="no C compiler")
@pytest.mark.parametrize("flags", [["-O3", "-march=native"], ["-O3"], SANITIZED],
                         ids=["native", "portable", "native-asan"])
def test_this_machines_builds_match_the_reference(flags: list[str], tmp_path: Path) -> None:
    assert HOST_CC is not None
    out = build_and_run(HOST_CC, flags, tmp_path)
    if flags == ["-O3"] and platform.machine() == "x86_64":  # the x86-64 baseline: no AVX2, the plain C loops
        assert "isa portable C" in out


@pytest.mark.skipif(CROSS is None or QEMU is None,
                    reason="no aarch64 cross compiler or qemu-user (Debian: gcc-aarch64-linux-gnu, qemu-user-static)")
@pytest.mark.parametrize(("march", "isa"), [("armv8.2-a+dotprod", "neon+dotprod"), ("armv8-a", "neon")])
def test_aarch64_builds_match_the_reference_under_qemu(march: str, isa: str, tmp_path: Path) -> None:
    assert CROSS is not None and QEMU is not None
    out = build_and_run(CROSS, ["-O3", f"-march={march}", "-static"], tmp_path, [QEMU, "-cpu", "max"])
    assert f"isa {isa}\n" in out
    # The whole library, as cpu_kernels builds it on an Arm host (its other kernels have no check here).
    subprocess.run([CROSS, "-O3", f"-march={march}", "-fno-math-errno", "-fPIC", "-shared", "-o",
                    str(tmp_path / "kernels.so"), *map(str, cpu_kernels.SOURCES), "-lpthread", "-lm"],
                   check=True, capture_output=True, text=True, timeout=300)
