"""Our model code against transformers' own, for every supported family and both expert layouts."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from services.engine.config import EngineConfig
from services.engine.cpu_threads import intra_op_threads
from services.engine.llm_engine import LLMEngine
from services.engine.models.attention import AttentionMetadata
from services.engine.models.loader import load_model
from services.engine.models.router import route
from services.engine.models.spec import PLAIN_ROPE_FAMILIES, rope_inv_freq, spec_from_config
from services.engine.sampling_params import SamplingParams
from services.engine.step_context import Phase, StepContext
from tests.tiny_models import FAMILIES, VOCAB, build_tiny_model, deepseek_config


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


# One torch thread is the serving core's setting on a small box: there the native CPU kernels run the layers
# (cpu_kernels); with more threads, torch's path does.
THREADS = pytest.mark.parametrize("threads", [None, 1], ids=["torch-threads", "one-thread"])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@THREADS
def test_logits_match_transformers(family: str, fused: bool, threads: int | None, tmp_path) -> None:
    model_dir = build_tiny_model(family, str(tmp_path / family), fused=fused)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(_prompt(24, seed=3))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]

    with intra_op_threads(threads):
        model = load_model(model_dir, dtype=torch.float32).model
        model.allocate_kv_cache(64)
        meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(24), seq_lens=[24])
        hidden = model.forward(ids, torch.arange(24), meta, StepContext(Phase.PREFILL, ["r"], 24))
        ours = model.compute_logits(hidden)
    assert (ours - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
@THREADS
def test_greedy_tokens_match_transformers_generate(family: str, threads: int | None,
                                                   tiny_model_dirs: dict[str, str]) -> None:
    model_dir = tiny_model_dirs[family]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [_prompt(n, seed=n) for n in (7, 19)]
    with intra_op_threads(threads):
        engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", block_size=4))
        ours = engine.generate(prompts, params)
    for prompt, tokens in zip(prompts, ours):
        # ignore_eos: the reference must neither stop at EOS nor suppress it (as min_new_tokens would).
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
        assert len(expected) == 32 and tokens == expected


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("deepseek_v2", {"topk_method": "greedy"}),
        ("deepseek_v2", {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}),
        ("deepseek_v3", {"n_group": 1, "topk_group": 1}),
        ("deepseek_v3", {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 3}),
        ("deepseek_v3", {"norm_topk_prob": False}),
    ],
)
def test_deepseek_router_rules_match_transformers(family: str, overrides: dict) -> None:
    """Grouped top-k, scaling, renormalisation and V3's selection-only bias, on many tokens at once."""
    torch.manual_seed(0)
    cfg, _ = deepseek_config(family, **overrides)
    reference = (DeepseekV3TopkRouter if family == "deepseek_v3" else DeepseekV2TopkRouter)(cfg)
    torch.nn.init.normal_(reference.weight, std=0.2)
    bias = getattr(reference, "e_score_correction_bias", None)
    if bias is not None:
        bias.normal_(std=0.1)
    x = torch.randn(512, cfg.hidden_size)
    with torch.no_grad():
        logits, ref_weights, ref_experts = reference(x)
        ours = route(spec_from_config(cfg), x, reference.weight, bias)
    ref_experts, order = ref_experts.sort(dim=-1)
    our_experts, our_order = ours.experts.sort(dim=-1)
    assert torch.equal(our_experts, ref_experts)
    torch.testing.assert_close(ours.weights.gather(1, our_order), ref_weights.gather(1, order))
    scores = logits.sigmoid() if family == "deepseek_v3" else logits.softmax(dim=-1)
    torch.testing.assert_close(ours.probs, scores)  # what StepContext.router_probs records


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lengths", [[9, 9], [5, 13, 2]], ids=["equal", "ragged"])
@THREADS
def test_pruned_last_layer_gives_the_last_rows_of_the_full_forward(
    family: str, lengths: list[int], threads: int | None, tiny_model_dirs: dict[str, str]
) -> None:
    """A prefill's last layer computing only each sequence's last row (when nothing watches the routing):
    the same hidden rows as the whole forward pass, and the same KV cache."""
    ids = torch.tensor([t for n in lengths for t in _prompt(n, seed=n)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    last = torch.tensor(lengths).cumsum(0) - 1
    results = []
    with intra_op_threads(threads):
        model = load_model(tiny_model_dirs[family], dtype=torch.float32).model
        model.allocate_kv_cache(64)
        for prune in (False, True):
            meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(len(ids)), seq_lens=lengths)
            ctx = StepContext(Phase.PREFILL, [str(n) for n in lengths], len(ids))
            hidden = model.forward(ids, positions, meta, ctx, output_rows=last, prune=prune)
            routed = ctx.selected_experts[len(model.w.layers) - 1]
            results.append((hidden, [c.clone() for c in model.kv_cache_tensors], routed.shape[0]))
    (full, full_cache, full_routed), (pruned, pruned_cache, pruned_routed) = results
    torch.testing.assert_close(pruned, full, atol=1e-5, rtol=1e-5)
    for a, b in zip(full_cache, pruned_cache):
        torch.testing.assert_close(a, b)
    assert full_routed == len(ids)
    assert pruned_routed == (len(lengths) if model._prunable(len(model.w.layers) - 1) else len(ids))


def test_engine_keeps_every_row_while_a_step_observer_records(tiny_mixtral_dir: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_mixtral_dir, dtype="float32", block_size=4))
    seen: list[int] = []
    last_layer = engine.model.spec.num_layers - 1
    engine.runner.step_observers.append(lambda ctx: seen.append(ctx.selected_experts[last_layer].shape[0]))
    engine.generate([_prompt(7, seed=1)], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert seen == [7, 1]  # the prefill's 7 rows routed in the last layer, then one decode row


@pytest.mark.parametrize("family", sorted(PLAIN_ROPE_FAMILIES))
@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}])
def test_rotary_frequencies_without_the_modeling_module_are_transformers(family: str, rope: dict | None) -> None:
    """The plain families' frequencies, computed without importing their modeling code, are its bits."""
    import importlib

    from transformers import AutoConfig

    cfg = AutoConfig.for_model(family, hidden_size=256, num_attention_heads=4,
                               **({"rope_parameters": rope} if rope else {}))
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary = next(getattr(module, name) for name in dir(module) if name.endswith("RotaryEmbedding"))(cfg)
    inv_freq, scaling = rope_inv_freq(cfg)
    assert torch.equal(inv_freq, rotary.inv_freq.float()) and scaling == float(rotary.attention_scaling)
