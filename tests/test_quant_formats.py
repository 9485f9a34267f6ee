"""Quantized checkpoint formats: each loads, matches its reference dequantisation and decodes like it."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from services import cli
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.quant.checkpoint import open_checkpoint
from services.engine.sampling_params import SamplingParams
from tests.quant_checkpoints import FORMATS, quantize_checkpoint
from tests.tiny_models import VOCAB

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Our dequantisation against each format's reference code: the same arithmetic in another order.
MAX_ABS_ERROR = 1e-6


@pytest.fixture(scope="module", params=list(FORMATS))
def checkpoints(request, tiny_mixtral_dir: str, tmp_path_factory) -> tuple[str, str, str, dict]:
    out = str(tmp_path_factory.mktemp("quant") / request.param)
    return (request.param, *quantize_checkpoint(tiny_mixtral_dir, out, request.param))


def test_dequantisation_matches_the_format_reference(checkpoints) -> None:
    fmt, quant_dir, _, refs = checkpoints
    import json

    with open(os.path.join(quant_dir, "config.json")) as f:
        ckpt = open_checkpoint(quant_dir, json.load(f)["quantization_config"])
    worst = max((ckpt.get(name).float() - ref).abs().max().item() for name, ref in refs.items())
    print(f"{fmt}: max abs error vs reference dequantisation over {len(refs)} expert linears: {worst:.2e}")
    assert worst <= MAX_ABS_ERROR


def test_quantized_checkpoint_decodes_like_its_dequantised_weights(checkpoints) -> None:
    """auto keeps the checkpoint's bit width: same tokens as the dense reference packed the same way."""
    fmt, quant_dir, ref_dir, _ = checkpoints
    dtype = "int8" if fmt in ("fp8", "compressed-int8") else "int4"
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 15)]
    quant = LLMEngine(EngineConfig(model=quant_dir, offload_policy="lru", expert_cache_experts=4, link_gbps=2.0))
    dense = LLMEngine(EngineConfig(model=ref_dir, expert_dtype=dtype, expert_group_size=32))
    try:
        experts = quant.model.experts
        assert experts.store.layout.scheme.bits == int(dtype[3:])
        assert quant.generate(prompts, GREEDY) == dense.generate(prompts, GREEDY)
    finally:
        quant.close()
        dense.close()


@pytest.mark.parametrize("fmt, tensor, bad", [
    ("gptq", "qzeros", lambda t: t[:, :1]),
    ("awq", "scales", lambda t: t[:1]),
    ("compressed-int4", "weight_scale", lambda t: t[:, :2]),
    ("fp8", "weight_scale_inv", lambda t: torch.cat([t, t])),
    ("gptq", "scales", None),
])
def test_malformed_checkpoint_is_a_one_line_error_naming_the_tensor(
    tiny_mixtral_dir: str, tmp_path, capsys, fmt: str, tensor: str, bad
) -> None:
    quant_dir, _, _ = quantize_checkpoint(tiny_mixtral_dir, str(tmp_path / fmt), fmt)
    path = os.path.join(quant_dir, "model.safetensors")
    state = load_file(path)
    name = f"model.layers.1.block_sparse_moe.experts.3.w2.{tensor}"
    if bad is None:
        del state[name]
    else:
        state[name] = bad(state[name]).contiguous()
    save_file(state, path, metadata={"format": "pt"})
    argv = ["generate", "--model", quant_dir, "--prompt", "hi", "--max-tokens", "2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0] and "malformed" in err[0], err
