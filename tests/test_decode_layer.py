"""A decode step's whole decoder layer in one native call (cpu_kernels/layer.c): the layered path's results bit
for bit, where it runs and where it does not."""

from __future__ import annotations

import pytest
import torch

from services.engine import cpu_kernels
from services.engine.config import EngineConfig
from services.engine.cpu_threads import use_threads
from services.engine.models.attention import AttentionMetadata, decode_metadata
from services.engine.models.loader import load_model
from services.engine.models.model import MoECausalLM
from services.engine.offload.settings import OffloadSettings
from services.engine.step_context import Phase, StepContext
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: native kernels not built")

BLOCK, BLOCKS_PER_SEQ = 16, 4
LENGTHS = (5, 23, 40)  # one sequence each, contexts inside one block and across blocks
# Every matrix's input width a multiple of 64, as the native kernels read them (the tiny models' 48 and 96 are
# not): hidden 128, 4 heads of 32, experts of width 64.
NATIVE_WIDTHS = dict(hidden_size=128, intermediate_size=128, head_dim=32)


@pytest.fixture(scope="module")
def native_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("native-width-models")
    return {"qwen3_moe": build_tiny_model("qwen3_moe", str(root / "qwen3"), moe_intermediate_size=64, **NATIVE_WIDTHS),
            "mixtral": build_tiny_model("mixtral", str(root / "mixtral"), **NATIVE_WIDTHS),
            "olmoe": build_tiny_model("olmoe", str(root / "olmoe"), **NATIVE_WIDTHS),
            "qwen2_moe": build_tiny_model("qwen2_moe", str(root / "qwen2"), moe_intermediate_size=64,
                                          shared_expert_intermediate_size=128, **NATIVE_WIDTHS)}


def _model(model_dir: str, fmt: str) -> MoECausalLM:
    expert = {"fp32": "auto"}.get(fmt, fmt)
    offload = OffloadSettings.from_config(EngineConfig(model=model_dir, expert_dtype=expert))
    return load_model(model_dir, dtype=torch.float32, offload=offload, weight_dtype=fmt).model


def _decode_step(model: MoECausalLM, whole: bool) -> tuple[torch.Tensor, StepContext]:
    """Prefills LENGTHS' sequences (each in its own blocks), then one decode token each: its logits and context."""
    model.allocate_kv_cache(len(LENGTHS) * BLOCKS_PER_SEQ * BLOCK)
    gen = torch.Generator().manual_seed(0)
    for b, n in enumerate(LENGTHS):
        ids = torch.randint(3, 200, (n,), generator=gen)
        slots = b * BLOCKS_PER_SEQ * BLOCK + torch.arange(n)
        meta = AttentionMetadata(is_prefill=True, slot_mapping=slots, seq_lens=[n])
        model.forward(ids, torch.arange(n), meta, StepContext(Phase.PREFILL, ["r"], n))
    positions = torch.tensor(LENGTHS)
    tables = torch.tensor([[b * BLOCKS_PER_SEQ + j for j in range(BLOCKS_PER_SEQ)] for b in range(len(LENGTHS))])
    slots = tables[:, 0] * BLOCK + positions
    if not whole:  # the layered path: no layer runs as one call
        model._decode_layers = [None] * model.spec.num_layers
    ctx = StepContext(Phase.DECODE, [str(b) for b in range(len(LENGTHS))], len(LENGTHS), keep_layer_inputs=True)
    ids = torch.randint(3, 200, (len(LENGTHS),), generator=gen)
    hidden = model.forward(ids, positions, decode_metadata(positions, slots, tables, BLOCK), ctx)
    return model.compute_logits(hidden), ctx


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
def test_a_whole_layer_call_is_the_layered_paths_decode_bit_for_bit(native_dirs: dict[str, str], fmt: str,
                                                                      threads: int) -> None:
    """Qwen3 (head norms; its first layer dense, so layered): logits, routing and the residual stream that the
    step context hands to prefetchers, identical in every weight format."""
    use_threads(threads)
    try:
        model = _model(native_dirs["qwen3_moe"], fmt)
        whole_logits, whole_ctx = _decode_step(model, whole=True)
        assert [layer is not None for layer in model._decode_layers or []] == [False, True, True]
        layered_logits, layered_ctx = _decode_step(model, whole=False)
    finally:
        use_threads(1)
    assert torch.equal(whole_logits, layered_logits)
    for i in (1, 2):
        assert torch.equal(whole_ctx.layer_inputs[i], layered_ctx.layer_inputs[i])
        assert torch.equal(whole_ctx.router_probs[i], layered_ctx.router_probs[i])
        assert torch.equal(whole_ctx.selected_experts[i], layered_ctx.selected_experts[i])


@pytest.mark.parametrize("family, whole_layers", [("mixtral", [True] * 3), ("olmoe", [False] * 3),
                                                  ("qwen2_moe", [False] * 3), ("deepseek_v2_lite", [False] * 3)])
def test_layers_run_whole_only_where_the_kernels_run_every_part(native_dirs: dict[str, str],
                                                                tiny_model_dirs: dict[str, str], family: str,
                                                                whole_layers: list[bool]) -> None:
    """Mixtral runs whole; OLMoE's full-width q/k norms, Qwen2-MoE's shared experts (and its dense layer) and
    DeepSeek's MLA keep the layered path, with the same logits either way."""
    model = _model(native_dirs.get(family) or tiny_model_dirs[family], "fp32")
    whole_logits, _ = _decode_step(model, whole=True)
    assert [layer is not None for layer in model._decode_layers or [None] * 3] == whole_layers
    layered_logits, _ = _decode_step(model, whole=False)
    assert torch.equal(whole_logits, layered_logits)


def test_a_slot_outside_the_cache_is_an_error_not_a_write(native_dirs: dict[str, str]) -> None:
    model = _model(native_dirs["mixtral"], "int8")
    _decode_step(model, whole=True)
    assert all(layer is not None for layer in model._decode_layers or [None])
    positions, tables = torch.tensor([3]), torch.tensor([[0, 1, 2, 3]])
    meta = decode_metadata(positions, torch.tensor([10**6]), tables, BLOCK)
    with pytest.raises(ValueError, match="outside"):
        model.forward(torch.tensor([5]), positions, meta, StepContext(Phase.DECODE, ["r"], 1))
