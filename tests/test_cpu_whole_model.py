"""Whole models in every CPU weight format (--expert-dtype with --weight-dtype), the thread setting shared by
generate and serve, and the checkpoint reader that loads them."""

from __future__ import annotations

import json
import os

import pytest
import torch

from services.engine import cpu_kernels
from services.engine.config import EngineConfig
from services.engine.cpu_threads import compute_line, core_threads, intra_op_threads
from services.engine.models.attention import AttentionMetadata
from services.engine.models.checkpoint import Checkpoint
from services.engine.models.loader import load_model
from services.engine.models.native_linear import NativeLinear
from services.engine.offload.settings import OffloadSettings
from services.engine.step_context import Phase, StepContext

native = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: native kernels not built")


def _logits(model_dir: str, fmt: str, prompt: torch.Tensor) -> tuple[torch.Tensor, object]:
    """The prefill logits of a model whose experts and dense matrices are all in `fmt`."""
    expert = {"fp32": "auto"}.get(fmt, fmt)

    offload = OffloadSettings.from_config(EngineConfig(model=model_dir, expert_dtype=expert))  # resident
    loaded = load_model(model_dir, dtype=torch.float32, offload=offload, weight_dtype=fmt)
    model = loaded.model
    n = prompt.shape[0]
    model.allocate_kv_cache(n)
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n), seq_lens=[n])
    hidden = model.forward(prompt, torch.arange(n), meta, StepContext(Phase.PREFILL, ["r"], n))
    return model.compute_logits(hidden), model


@native
# Measured on the demo model (64 positions): bf16 0.2% / 100%, int8 1.8% / 97%, int4 13.6% / 80% (every matrix
# int4 at group 64 in a model of width 256); the bounds leave a margin.
@pytest.mark.parametrize("fmt, max_error, agreement", [("bf16", 0.01, 0.95), ("int8", 0.04, 0.9),
                                                       ("int4", 0.2, 0.7)])
def test_whole_model_formats_keep_the_trained_models_predictions(fmt: str, max_error: float, agreement: float,
                                                                  demo_model_dir: str) -> None:
    """The trained demo model with every matrix in `fmt`: next-token predictions as the fp32 model's, up to
    the format's rounding (stated here: max logit error against the logits' range, top-1 agreement)."""
    prompt = torch.arange(40, 104)
    reference, _ = _logits(demo_model_dir, "fp32", prompt)
    ours, model = _logits(demo_model_dir, fmt, prompt)
    assert isinstance(model.lm_head, NativeLinear) and model.lm_head.matrix.format == fmt
    assert model.experts.native_experts(0) is not None
    error = ((ours - reference).abs().max() / (reference.max() - reference.min())).item()
    same_top1 = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert error < max_error and same_top1 >= agreement, (error, same_top1)


@native
def test_a_quantized_whole_model_holds_no_float_copy(demo_model_dir: str) -> None:
    """int4 everywhere: the dense layers hold only their packed bytes, the float matrices are released."""
    _, model = _logits(demo_model_dir, "int4", torch.arange(8))
    for layer, qkv, o in zip(model.w.layers, model.qkv, model.o):
        assert qkv.weight is None and o.weight is None
        assert layer.attention.q.numel() == layer.attention.o.numel() == 0
    assert model.w.lm_head.numel() == 0 or model.w.lm_head is model.w.embed


@native
def test_a_bf16_run_keeps_bf16_activations_and_decodes_like_fp32(demo_model_dir: str) -> None:
    """`--dtype bfloat16` on the CPU: the native dense layers write fp32, and the bf16 KV cache must get bf16
    (they once raised on the first KV write). Greedy tokens follow fp32's until a near tie (the sixth token of
    one prompt here, where bf16 rounding picks the runner-up)."""
    from services.engine.llm_engine import LLMEngine
    from services.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(40, 60)), list(range(70, 75))]
    tokens = {}
    for dtype in ("bfloat16", "float32"):
        engine = LLMEngine(EngineConfig(model=demo_model_dir, dtype=dtype))
        try:
            tokens[dtype] = engine.generate(prompts, params)
            assert engine.model.k_caches[0].dtype == getattr(torch, dtype)
        finally:
            engine.close()
    assert all(len(t) == 8 for t in tokens["bfloat16"])
    assert [t[:5] for t in tokens["bfloat16"]] == [t[:5] for t in tokens["float32"]]


def test_generate_and_serve_share_one_thread_default(monkeypatch) -> None:
    """No --threads: cores less one (OMP_NUM_THREADS when set), the same for every command."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert core_threads() == max(1, (os.cpu_count() or 1) - 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert core_threads() == 3
    line = compute_line(EngineConfig(threads=5))
    assert line is not None and line.endswith("5 compute thread(s)")
    assert compute_line(EngineConfig(device="cuda")) is None


def test_the_checkpoint_reader_reads_each_tensor_in_place_and_names_a_truncated_shard(tmp_path) -> None:
    from safetensors.torch import save_file

    tensors = {"a.weight": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).bfloat16()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint(str(tmp_path))
    for name, t in tensors.items():
        assert torch.equal(ckpt.get(name), t)
    assert ckpt.dtype() == torch.float32 and sorted(ckpt.names()) == ["a.weight", "b", "c"]
    buffer = torch.empty(15, dtype=torch.float32)
    assert torch.equal(ckpt.read_into("a.weight", buffer), tensors["a.weight"]) and torch.equal(buffer.view(3, 5),
                                                                                                 tensors["a.weight"])
    with pytest.raises(ValueError, match="is 60 bytes; the buffer given holds 64"):
        ckpt.read_into("a.weight", torch.empty(16))
    path = tmp_path / "model.safetensors"
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    offsets = json.loads(path.read_bytes()[8 : 8 + header_len])
    last = max((k for k in offsets if k != "__metadata__"), key=lambda k: offsets[k]["data_offsets"][1])
    path.write_bytes(path.read_bytes()[:-4])  # the last tensor loses its last bytes
    with pytest.raises(ValueError, match="truncated"):
        Checkpoint(str(tmp_path)).get(last)


@native
def test_small_fp32_experts_run_native_for_few_tokens_and_prepacked_for_a_prompt(demo_model_dir: str,
                                                                                 monkeypatch) -> None:
    """The demo model's fp32 experts are read in place by the native kernels and also prepacked for oneDNN
    (resident.PREFILL_PACK_MAX_BYTES): an 80-token prompt's layers take the packed copies, a short one the native
    call, and both give the same logits up to fp32 summation order."""
    from services.engine.models import model as model_module

    calls = {"native": 0, "packed": 0}
    for name, key in (("native_moe_forward", "native"), ("fused_moe_forward", "packed")):
        def counted(*args, _forward=getattr(model_module, name), _key=key):
            calls[_key] += 1
            return _forward(*args)
        monkeypatch.setattr(model_module, name, counted)
    prompt = torch.arange(40, 120)
    with intra_op_threads(1):  # as the serving core runs torch: a core left free, so oneDNN packs
        packed_logits, model = _logits(demo_model_dir, "fp32", prompt)
        assert model.experts.native_experts(0) is not None and model.experts.stacked_experts(0).packed
        layers = model.spec.num_layers
        assert calls == {"native": 0, "packed": layers}
        _logits(demo_model_dir, "fp32", prompt[: model_module.PACKED_MIN_TOKENS - 1])
        assert calls == {"native": layers, "packed": layers}
        monkeypatch.setattr(model_module, "PACKED_MIN_TOKENS", 1 << 20)
        native_logits, _ = _logits(demo_model_dir, "fp32", prompt)
    torch.testing.assert_close(packed_logits, native_logits, rtol=1e-4, atol=1e-3)
