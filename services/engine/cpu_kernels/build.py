"""Building the native CPU kernels: the sources compiled with the system C compiler into a per-user cache keyed by
the sources, flags and CPU (`cache_dir`), loaded with every entry point's C signature declared."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("services.engine.cpu_kernels")

SOURCES = [Path(__file__).with_name(name) for name in (
    "expert_f32.c", "attention.c", "norm_rope.c", "threadpool.c", "matmul.c", "rows.c", "moe.c", "layer.c", "amx.c",
    "amx_q4.c", "quantize.c", "convert.c")]
HEADERS = [Path(__file__).with_name(name) for name in (
    "hs.h", "vec.h", "amx.h", "dequant_avx512.h", "rows_tuning.h", "rows_float.h", "rows_float_tiles.h",
    "rows_int_avx512.h", "rows_int_avx2.h", "rows_int_portable.h", "rows_neon.h")]
# The second where the compiler knows no -march=native. -fno-math-errno: lrintf inline, not a libm call per element.
FLAG_SETS: tuple[list[str], ...] = (["-O3", "-march=native", "-fno-math-errno"], ["-O3", "-fno-math-errno"])
_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def cache_dir() -> Path:
    """Where built kernels live: $HINTSERVE_KERNEL_CACHE, else $XDG_CACHE_HOME/hintserve/kernels."""
    if os.environ.get("HINTSERVE_KERNEL_CACHE"):
        return Path(os.environ["HINTSERVE_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hintserve" / "kernels"


def _cpu_identity() -> str:
    """-march=native builds for this CPU: the cache must not hand its library to another one."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(line for line in f if line.startswith(("model name", "flags", "Features")))[:8192]
    except OSError:
        return os.uname().machine


def _build(compiler: str, flags: list[str]) -> Path:
    source = b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(flags).encode(),
                                     _cpu_identity().encode()])).hexdigest()[:16]
    target = cache_dir() / f"hintserve_kernels_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-fPIC", "-shared", "-o", tmp, *map(str, SOURCES), "-lpthread", "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)  # atomic: a concurrent builder's copy is as good as ours
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def build_library(flag_sets: Sequence[list[str]]) -> ctypes.CDLL | None:
    """The kernels built with the first of `flag_sets` that compiles (cached per flags), or None (said once)."""
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        log.warning("no C compiler found ($CC or cc): native CPU kernels off, torch's path runs instead")
        return None
    error = ""
    for flags in flag_sets:
        try:
            lib = ctypes.CDLL(str(_build(compiler, flags)))
            break
        except subprocess.CalledProcessError as exc:
            lines = (exc.stderr or "").strip().splitlines()
            error = lines[-1] if lines else str(exc)
        except (OSError, subprocess.TimeoutExpired) as exc:
            error = str(exc)
    else:
        log.warning("building native CPU kernels failed (%s): torch's path runs instead", error)
        return None
    return _declared(lib)


def _declared(lib: ctypes.CDLL) -> ctypes.CDLL:
    """lib with every entry point's C signature (ctypes converts the arguments by them)."""
    lib.moe_swiglu_f32.restype = ctypes.c_int
    lib.moe_swiglu_f32.argtypes = [_ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr]
    lib.paged_decode_attention_f32.restype = ctypes.c_int
    lib.paged_decode_attention_f32.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64,
                                               _i64, _i64, _i64, _f32, _ptr]
    lib.linear_rows_f32.restype = None
    lib.linear_rows_f32.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64]
    lib.expert_rows_f32.restype = None
    lib.expert_rows_f32.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr]
    lib.rms_norm_f32.restype = None
    lib.rms_norm_f32.argtypes = [_ptr, _ptr, _ptr, _f32, _ptr, _ptr, _i64, _i64]
    lib.hs_linear.restype = ctypes.c_int
    lib.hs_linear.argtypes = [_ptr, _ptr, _i64, _ptr, _i64, _i64]
    lib.hs_moe.restype = ctypes.c_int
    lib.hs_moe.argtypes = [_ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr]
    lib.hs_quantize.restype = ctypes.c_int
    lib.hs_quantize.argtypes = [_i64, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr]
    lib.hs_quantize_grid.restype = ctypes.c_int
    lib.hs_quantize_grid.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr]
    lib.hs_route_softmax.restype = ctypes.c_int
    lib.hs_route_softmax.argtypes = [_ptr, _ptr, _i64, _i64, _i64, ctypes.c_int, _ptr, _ptr, _ptr]
    lib.hs_decode_layer.restype = ctypes.c_int
    lib.hs_decode_layer.argtypes = [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr,
                                    _ptr, _ptr, _ptr]
    lib.hs_decode_layer_work.restype = _i64
    lib.hs_decode_layer_work.argtypes = [_ptr, _i64]
    lib.hs_convert.restype = ctypes.c_int
    lib.hs_convert.argtypes = [_ptr, _ptr, _i64, ctypes.c_int]
    lib.hs_isa.restype = ctypes.c_char_p
    lib.hs_amx_rows.restype = ctypes.c_int
    lib.hs_amx_rows.argtypes = [_i64]
    lib.hs_set_threads.restype = ctypes.c_int
    lib.hs_set_threads.argtypes = [ctypes.c_int]
    lib.hs_threads.restype = ctypes.c_int
    lib.hs_read_probe.restype = ctypes.c_uint64
    lib.hs_read_probe.argtypes = [_ptr, _i64]
    lib.rope_write_kv_f32.restype = ctypes.c_int
    lib.rope_write_kv_f32.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64,
                                      _ptr, _ptr, _f32]
    return lib
