"""`demo-model build --shape ... --random`: real-shape random checkpoints our loader and transformers read alike."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from services.cli import main
from services.engine.config import EngineConfig
from services.engine.demo_model import random_model
from services.engine.demo_model.random_model import SHAPES, shape_config
from services.engine.demo_model.tokenizer import SPECIAL_TOKENS, token_id
from services.engine.llm_engine import LLMEngine
from services.engine.models.geometry import expert_bytes
from services.engine.models.spec import spec_from_config
from services.engine.sampling_params import SamplingParams

# One layer of Qwen3-30B-A3B with 8 of its 128 experts and a 512-token vocabulary: 60M params, 0.5 GB RSS to build.
SMALL = ["--layers", "1", "--experts", "8", "--vocab-size", "512"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("qwen3") / "model"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(random_model, "SHARD_BYTES", 32 << 20)  # several shards from a 120 MB model
        assert main(["demo-model", "build", "--shape", "qwen3-30b-a3b", "--random", *SMALL, "--out", str(out)]) == 0
    return str(out)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_full_shapes_read_as_the_released_models(shape: str, tmp_path) -> None:
    """The config our loader reads has each family's real expert size (no weights written)."""
    (tmp_path / "config.json").write_text(json.dumps(shape_config(shape, 4, 8000)))
    spec = spec_from_config(AutoConfig.from_pretrained(tmp_path, local_files_only=True))
    expected = {"qwen3-30b-a3b": 9_437_184, "mixtral-8x7b": 352_321_536, "deepseek-v2-lite": 17_301_504}
    assert expert_bytes(spec, torch.bfloat16) == expected[shape]
    assert spec.num_layers == 4 and spec.vocab_size == 8000


def test_qwen3_build_is_sharded_bf16_with_silent_special_tokens(qwen3_dir: str) -> None:
    cfg = json.loads(open(f"{qwen3_dir}/config.json").read())
    assert (cfg["model_type"], cfg["hidden_size"], cfg["head_dim"], cfg["num_experts"]) == ("qwen3_moe", 2048, 128, 8)
    index = json.loads(open(f"{qwen3_dir}/model.safetensors.index.json").read())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                           for i in range(1, len(shards) + 1)]
    assert max(os.path.getsize(f"{qwen3_dir}/{s}") for s in shards) < 33 << 20
    assert index["metadata"]["total_size"] == json.loads(open(f"{qwen3_dir}/random_model_build.json").read())["bytes"]
    with safe_open(f"{qwen3_dir}/{index['weight_map']['lm_head.weight']}", framework="pt") as f:
        head = f.get_tensor("lm_head.weight")
    assert head.dtype == torch.bfloat16 and head.shape == (cfg["vocab_size"], 2048)
    tokenizer = Tokenizer.from_file(f"{qwen3_dir}/tokenizer.json")
    special = torch.tensor([token_id(tokenizer, t) for t in SPECIAL_TOKENS])
    ordinary = torch.ones(cfg["vocab_size"], dtype=torch.bool).index_fill_(0, special, False)
    assert not head[special].any() and head[ordinary].abs().sum(dim=1).min() > 0


def test_transformers_and_our_engine_agree_to_max_tokens(qwen3_dir: str) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    prompt = [40, 41, 42, 43, 44, 45, 46, 47]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    engine = LLMEngine(EngineConfig(model=qwen3_dir), detokenize=False)
    try:
        ours = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0]
    finally:
        engine.close()
    assert ours == expected and len(ours) == 12  # no special token ever wins: greedy decoding runs to the end


def test_deepseek_build_loads_in_both(tmp_path) -> None:
    out = tmp_path / "ds"
    args = ["--layers", "2", "--experts", "6", "--vocab-size", "512"]  # a dense first layer, then an MoE one
    assert main(["demo-model", "build", "--shape", "deepseek-v2-lite", "--random", *args, "--out", str(out)]) == 0
    _, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    engine = LLMEngine(EngineConfig(model=str(out)), detokenize=False)
    try:
        tokens = engine.generate([[40, 41, 42, 43]], SamplingParams(temperature=0.0, max_tokens=6))[0]
    finally:
        engine.close()
    assert len(tokens) == 6  # no special token ever wins


@pytest.mark.parametrize(
    "extra",
    [["--shape", "qwen3-30b-a3b"], ["--random"], ["--shape", "qwen3-30b-a3b", "--random", "--experts", "4"]],
)
def test_bad_random_builds_exit_2(extra: list[str], tmp_path, capsys) -> None:
    assert main(["demo-model", "build", *extra, "--vocab-size", "512", "--out", str(tmp_path / "x")]) == 2
    assert "error" in capsys.readouterr().err


def test_quantized_experts_are_read_as_stored_and_pack_the_same(qwen3_dir: str, monkeypatch) -> None:
    """Experts that a CPU layer buffer packs (quantized, or dense in another dtype) are read in the checkpoint's
    bf16, not widened to the run dtype first (the load's peak held a float32 copy, and the fp32 load faulted in
    a widened copy of every tensor); the packed bytes are the same either way."""
    from services.engine.models import resident
    from services.engine.models.weights import WeightReader, expert_loader, read_ahead
    from services.engine.quant.checkpoint import open_checkpoint
    from services.engine.quant.layout import ExpertLayout, converts, expert_layout

    spec = spec_from_config(AutoConfig.from_pretrained(qwen3_dir))
    reader = WeightReader(open_checkpoint(qwen3_dir, None), torch.float32, "cpu")
    assert expert_loader(reader, spec, 0, as_stored=True)(0, "cpu").gate_up.dtype == torch.bfloat16
    assert expert_loader(reader, spec, 0)(0, "cpu").gate_up.dtype == torch.float32
    # Transient reads, read ahead (the caller packs each expert before it asks for the one after next): the
    # same tensors, in two sets of buffers taken in turn, each expert intact while the next one is read.
    transient = expert_loader(reader, spec, 0, as_stored=True, transient=True)
    plain = expert_loader(reader, spec, 0, as_stored=True)
    pointers = []
    for e, w in enumerate(read_ahead(transient, 3, "cpu")):
        assert torch.equal(w.gate_up, plain(e, "cpu").gate_up) and torch.equal(w.down, plain(e, "cpu").down)
        pointers.append((w.gate_up.data_ptr(), w.down.data_ptr()))
    assert pointers[0] == pointers[2] != pointers[1]
    int4 = expert_layout(2048, spec.moe_intermediate_size, "int4", 64, torch.float32, "cpu")
    assert converts(int4, torch.float32) and converts(ExpertLayout(2048, 768, torch.bfloat16), torch.float32)
    assert not converts(ExpertLayout(2048, 768, torch.float32), torch.float32) and not converts(None, torch.float32)

    # Every expert packed into a CPU layer buffer, dense fp32 too, is read as stored and converted as it is
    # packed: the same bytes as reading it widened.
    asked: list[bool] = []
    widen = False

    def loader(*args, **kwargs):
        asked.append(kwargs["as_stored"])
        return expert_loader(*args, **{**kwargs, "as_stored": kwargs["as_stored"] and not widen})

    monkeypatch.setattr(resident, "expert_loader", loader)

    def packed_experts(layout) -> list[torch.Tensor]:
        provider = resident.load_resident_experts(reader, spec, layout)
        return [t.clone() for w in provider._experts[0] for m in (w.gate_up, w.down)
                for t in ([m] if isinstance(m, torch.Tensor) else [m.qweight])]

    for layout in (int4, ExpertLayout(2048, spec.moe_intermediate_size, torch.float32)):
        asked.clear()
        as_stored = packed_experts(layout)
        assert asked and all(asked)
        widen = True
        widened = packed_experts(layout)
        widen = False
        assert len(as_stored) == len(widened) and all(torch.equal(a, b) for a, b in zip(as_stored, widened))
