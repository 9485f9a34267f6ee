"""Demo MoE model: a tiny end-to-end build, and checks of the committed artefact in models/demo-moe."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from services.engine.demo_model import cli  # noqa: E402
from services.engine.demo_model.corpus import build_corpus, gsm8k_messages  # noqa: E402
from services.engine.demo_model.stats import STATS_FILE  # noqa: E402
from services.engine.demo_model.tokenizer import render_chat  # noqa: E402
from services.engine.demo_model.train import TrainSettings, build  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "models" / "demo-moe"
TINY_ARCH = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "tiny-moe"
    settings = TrainSettings(
        max_steps=4, batch_size=4, seq_len=64, warmup_steps=2, eval_windows=4, arch=TINY_ARCH
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only adds sync stalls on a busy CI box
    try:
        build(out, settings, vocab_size=512, max_corpus_mb=0.2)
    finally:
        torch.set_num_threads(threads)
    return out


def test_corpus_is_deterministic_and_split_by_document() -> None:
    a = build_corpus(seed=3, max_bytes=150_000)
    b = build_corpus(seed=3, max_bytes=150_000)
    assert [d.name for d in a.train] == [d.name for d in b.train]
    assert not {d.name for d in a.train} & {d.name for d in a.val}
    assert sum(d.size() for d in a.train + a.val) <= 150_000


def test_gsm8k_answer_becomes_chat() -> None:
    user, assistant = gsm8k_messages("Q?", "She has 2+3=<<2+3=5>>5 eggs.\n#### 5")
    assert user == {"role": "user", "content": "Q?"}
    assert assistant["content"] == "She has 2+3=5 eggs.\nThe answer is 5."


def test_tiny_build_loads_in_transformers(tiny_model: Path) -> None:
    model = transformers.MixtralForCausalLM.from_pretrained(tiny_model)
    assert model.config.num_hidden_layers == 2 and model.config.num_local_experts == 8
    assert model.config.tie_word_embeddings is False
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["MixtralForCausalLM"]
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model)
    assert config["vocab_size"] == len(tok)
    assert config["bos_token_id"] == tok.bos_token_id and config["pad_token_id"] == tok.pad_token_id
    ids = tok("def f(x):\n    return x", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3 or out[0, -1].item() in model.generation_config.eos_token_id
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", STATS_FILE):
        assert (tiny_model / name).is_file(), name


def test_tiny_build_chat_template_and_round_trip(tiny_model: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|endoftext|><|system|>\nBe brief.<|end|>\n<|user|>\n2+3?<|end|>\n<|assistant|>\n"
    assert text == render_chat(messages, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[:2] == ["<|endoftext|>", "<|system|>"]
    sample = "héllo wörld ✓ — 日本語\n\tdef f():  return 1"
    assert tok.decode(tok(sample, add_special_tokens=False)["input_ids"]) == sample


def test_tiny_build_safetensors_per_expert_layout(tiny_model: Path) -> None:
    with safe_open(str(tiny_model / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.block_sparse_moe.experts.7.w1.weight").dtype == torch.bfloat16
    for layer in range(2):
        for expert in range(8):
            for w in ("w1", "w2", "w3"):
                assert f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight" in names
        assert f"model.layers.{layer}.block_sparse_moe.gate.weight" in names
    assert "lm_head.weight" in names


def test_tiny_build_stats(tiny_model: Path) -> None:
    stats = json.loads((tiny_model / STATS_FILE).read_text())
    assert stats["val_perplexity"] > 1
    layers = stats["routing"]["layers"]
    assert len(layers) == 2 and "skip_gate_exact_hit" not in layers[0]
    assert 0 <= layers[1]["skip_gate_exact_hit"] <= layers[1]["skip_gate_recall"] <= 1
    assert all(
        0 < row["router_entropy_nats"] <= stats["routing"]["max_entropy_nats"] + 1e-6 for row in layers
    )


def test_cli_errors_on_missing_model(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["demo-model", "stats", "--model", str(tmp_path / "nope")])
    with pytest.raises(FileNotFoundError):
        args.func(args)
    args = parser.parse_args(
        ["demo-model", "build", "--out", str(tmp_path), "--prompts-dir", str(tmp_path / "x")]
    )
    with pytest.raises(FileNotFoundError, match="prompts-dir"):
        args.func(args)


@pytest.mark.skipif(not (COMMITTED / "config.json").is_file(), reason="models/demo-moe not built")
def test_committed_demo_model() -> None:
    config = transformers.AutoConfig.from_pretrained(COMMITTED)
    assert (
        config.num_hidden_layers,
        config.num_local_experts,
        config.num_experts_per_tok,
        config.hidden_size,
    ) == (6, 8, 2, 256)
    model = transformers.MixtralForCausalLM.from_pretrained(COMMITTED)
    assert model.lm_head.weight.shape == (config.vocab_size, 256)
    tok = transformers.AutoTokenizer.from_pretrained(COMMITTED)
    assert len(tok) == config.vocab_size
    stats = json.loads((COMMITTED / STATS_FILE).read_text())
    layers = stats["routing"]["layers"]
    assert len(layers) == 6
    assert all(row["router_entropy_nats"] < 1.6 for row in layers), [
        row["router_entropy_nats"] for row in layers
    ]
    size = sum(p.stat().st_size for p in COMMITTED.iterdir() if p.is_file())
    assert size < 50 * 2**20
