"""The engine's allocator settings: large host activations come from the reused heap, not fresh mmaps, and the
weights the CPU kernels stream sit on memory of their own, aligned to huge pages."""

from __future__ import annotations

import ctypes.util
import gc
import subprocess
import sys

import pytest
import torch

from services.engine.cpu_kernels import formats
from services.engine.expert_format import ExpertLayout
from services.engine.host_allocator import HUGE_PAGE_BYTES, HugePageArena, huge_page_empty, pinned_empty
from services.engine.models.resident import _layer_buffer

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


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        return any(int(lo, 16) <= address < int(hi, 16)
                   for lo, hi in (line.split()[0].split("-") for line in maps))


def test_huge_page_tensors_start_on_a_huge_page_and_unmap_when_freed() -> None:
    t = huge_page_empty((5, 1 << 20), torch.float32)  # 20 MiB
    assert t.shape == (5, 1 << 20) and t.dtype == torch.float32
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    t.fill_(1.0)
    assert t.sum().item() == 5 << 20
    address = t.data_ptr()
    row = t[2]
    del t
    gc.collect()
    assert _mapped(address)  # a view keeps the mapping
    del row
    gc.collect()
    assert not _mapped(address)
    assert huge_page_empty((3, 7), torch.bfloat16).shape == (3, 7)  # below a huge page: torch's own memory


def test_weights_the_kernels_stream_are_placed_on_huge_pages() -> None:
    for fmt in ("bf16", "int8", "int4"):
        matrix = formats.pack(torch.randn(2048, 2048), fmt, 64)
        assert matrix.weight.data_ptr() % HUGE_PAGE_BYTES == 0, fmt
    layer = _layer_buffer(ExpertLayout(2048, 768, torch.bfloat16), 4, "cpu")
    assert layer is not None and layer.data_ptr() % HUGE_PAGE_BYTES == 0


def test_an_arena_hands_out_its_buffer_in_turn_and_refuses_more() -> None:
    sizes = [3 << 20, 1000, 5 << 20]
    arena = HugePageArena(HugePageArena.bytes_for(sizes))
    a = arena.take((3 << 18,), torch.float32)
    b = arena.take((10, 100), torch.uint8)
    c = arena.take((5 << 19,), torch.bfloat16)
    assert a.data_ptr() % HUGE_PAGE_BYTES == 0  # the buffer's start
    assert b.data_ptr() == a.data_ptr() + (3 << 20) and c.data_ptr() == b.data_ptr() + 1024  # cache lines
    c.fill_(2.0)
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()  # one buffer
    with pytest.raises(ValueError, match="cannot hold"):
        arena.take((1,), torch.uint8)
    matrix = formats.pack(torch.randn(64, 256), "int4", 64, alloc=HugePageArena(1 << 20).take)
    assert matrix.weight.numel() == formats.packed_nbytes((64, 256), "int4", 64)


class _RecordingCudart:
    """cudaHostRegister / cudaHostUnregister as calls recorded, for a machine without CUDA; `status` is what
    registering returns."""

    def __init__(self, status: int = 0) -> None:
        self.calls: list[tuple] = []
        self.status = status

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", ptr, nbytes, flags))
        return self.status

    def cudaGetErrorString(self, status: int) -> str:  # noqa: N802 - CUDA's name
        return f"error {status}"

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("unregister", ptr))
        return 0


def test_pinned_memory_is_exactly_its_bytes_and_unregistered_once_no_tensor_holds_it(monkeypatch) -> None:
    """A CUDA engine's host store: page-locked for exactly its bytes (torch's pinned allocator rounds up to a
    power of two: a 9 MiB expert took 16), on huge pages, and unpinned when its last view is freed, before its
    mapping is unmapped."""
    cudart = _RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    layer = pinned_empty((3, 9 * 2**20 // 2), torch.bfloat16)  # three Qwen3-30B-A3B bf16 experts
    assert layer.data_ptr() % HUGE_PAGE_BYTES == 0
    assert cudart.calls == [("register", layer.data_ptr(), 27 * 2**20, 1)]
    expert = layer[2]
    expert.fill_(1.5)  # the memory is there to write
    del layer
    gc.collect()
    assert len(cudart.calls) == 1  # a view still holds it
    address = cudart.calls[0][1]
    del expert
    gc.collect()
    assert cudart.calls[1:] == [("unregister", address)]


def test_memory_that_cannot_be_page_locked_is_a_clear_error(monkeypatch) -> None:
    """No fallback: the failed call stays CUDA's last error, which torch's next kernel launch would raise."""
    cudart = _RecordingCudart(status=2)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    with pytest.raises(RuntimeError, match=r"cannot page-lock 4096 bytes .*error 2.*ulimit -l"):
        pinned_empty((1024,), torch.float32)
    gc.collect()
    assert [call[0] for call in cudart.calls] == ["register"]  # nothing registered, so nothing to unregister


def test_an_odd_size_registers_whole_pages(monkeypatch) -> None:
    cudart = _RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    t = pinned_empty((1000,), torch.uint8)
    assert t.numel() == 1000 and cudart.calls[0][2] == __import__("mmap").PAGESIZE and cudart.calls[0][1] == t.data_ptr()


def test_a_cuda_engines_host_store_pins_one_buffer_a_layer(tiny_mixtral_dir: str, monkeypatch) -> None:
    """Pinned (a CUDA engine's copy engine reads it): one registered buffer per MoE layer, of its experts'
    bytes to the page, each expert a view of it, with the same bytes as the unpinned store."""
    import mmap

    from services.engine.models.spec import load_hf_config, spec_from_config
    from services.engine.models.weights import WeightReader
    from services.engine.offload.host_store import HostExpertStore
    from services.engine.quant.checkpoint import open_checkpoint
    from services.engine.quant.layout import expert_layout

    cudart = _RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    spec = spec_from_config(load_hf_config(tiny_mixtral_dir))
    reader = WeightReader(open_checkpoint(tiny_mixtral_dir, None), torch.float32, "cpu")
    layout = expert_layout(spec.hidden_size, spec.moe_intermediate_size, "int4", 32, torch.float32, "cpu")
    pinned = HostExpertStore(reader, spec, pin=True, layout=layout)
    plain = HostExpertStore(reader, spec, pin=False, layout=layout)
    layers = [layer for layer in range(spec.num_layers) if spec.moe_layers[layer]]
    layer_bytes = spec.num_experts * layout.numel
    assert [call[2] for call in cudart.calls] == [-(-layer_bytes // mmap.PAGESIZE) * mmap.PAGESIZE] * len(layers)
    for layer, call in zip(layers, cudart.calls, strict=True):
        for expert in range(spec.num_experts):
            buffer = pinned.buffers[(layer, expert)]
            assert buffer.data_ptr() == call[1] + expert * layout.numel  # a view of its layer's buffer
            assert torch.equal(buffer, plain.buffers[(layer, expert)])
