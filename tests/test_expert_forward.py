"""expert_forward keeps each expert's native call beside its weights: made once, still right after the buffer
under the weights is refilled with another expert (as a cache slot is), and never made for weights the kernels
cannot read in place."""

from __future__ import annotations

import pytest
import torch

from services.engine import cpu_kernels
from services.engine.cpu_kernels import formats, moe_calls
from services.engine.cpu_threads import use_threads
from services.engine.expert_provider import ExpertWeights, StoredWeights
from services.engine.models.moe import expert_forward, swiglu
from services.engine.quant.layout import expert_layout

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: native kernels not built")

HIDDEN, WIDTH = 1024, 512  # gate/up at POOLED_EXPERT_PARAMS: an fp32 expert takes the pooled call too


@pytest.fixture(autouse=True)
def one_torch_thread():
    before_torch, before_pool = torch.get_num_threads(), cpu_kernels.pool_threads()
    use_threads(2)
    yield
    cpu_kernels.set_threads(before_pool or 1)
    torch.set_num_threads(before_torch)


def _dense(seed: int) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    return ExpertWeights(torch.randn(2 * WIDTH, HIDDEN, generator=gen) / HIDDEN**0.5,
                         torch.randn(HIDDEN, WIDTH, generator=gen) / WIDTH**0.5)


def _reference(x: torch.Tensor, w: StoredWeights) -> torch.Tensor:
    """The same expert through the uncached one-expert call."""
    gate_up, down = formats.as_cpu_matrix(w.gate_up), formats.as_cpu_matrix(w.down)
    assert gate_up is not None and down is not None
    return moe_calls.expert(x, gate_up, down)


@pytest.mark.parametrize("dtype", ["auto", "bf16", "int8", "int4"])
def test_the_call_is_made_once_and_follows_a_refilled_buffer(dtype: str) -> None:
    layout = expert_layout(HIDDEN, WIDTH, dtype, 64, torch.float32, "cpu")
    flat = torch.empty(layout.numel, dtype=layout.dtype)
    w = layout.views(flat)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(7))
    layout.pack(_dense(1), flat)
    first = expert_forward(x, w)
    call = w.native
    assert isinstance(call, moe_calls.ExpertCall)
    assert torch.equal(first, _reference(x, w))
    layout.pack(_dense(2), flat)  # the slot now holds another expert, at the same addresses
    second = expert_forward(x, w)
    assert w.native is call
    assert torch.equal(second, _reference(x, w)) and not torch.equal(second, first)


def test_weights_the_kernels_cannot_read_in_place_take_torch_path() -> None:
    dense = _dense(3)
    w = ExpertWeights(dense.gate_up.t().contiguous().t(), dense.down)  # gate/up not row-contiguous
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(8))
    y = expert_forward(x, w)
    assert w.native is False
    torch.testing.assert_close(y, swiglu(x, dense.gate_up, dense.down), rtol=1e-4, atol=1e-5)
