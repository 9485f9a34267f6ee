"""Reads a checkpoint's tensors into our layer structures, accepting per-expert and fused 3-D expert layouts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.engine.expert_provider import ExpertWeights
from services.engine.models.checkpoint import Checkpoint
from services.engine.models.spec import ModelSpec

if TYPE_CHECKING:
    from services.engine.quant.checkpoint import QuantizedCheckpoint

# Per-expert names (gate, up, down): Mixtral's original and the gate_proj/up_proj/down_proj convention.
_PER_EXPERT_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


@dataclass
class AttentionWeights:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


@dataclass
class MlaWeights:
    """DeepSeek's Multi-head Latent Attention projections (transformers' names after each field)."""

    q: torch.Tensor | None  # q_proj: hidden -> heads * qk_head_dim, when q_lora_rank is None
    q_a: torch.Tensor | None  # q_a_proj: hidden -> q_lora_rank (then q_a_layernorm, q_b_proj)
    q_a_bias: torch.Tensor | None
    q_a_norm: torch.Tensor | None
    q_b: torch.Tensor | None  # q_b_proj: q_lora_rank -> heads * qk_head_dim
    kv_a: torch.Tensor  # kv_a_proj_with_mqa: hidden -> kv_lora_rank + qk_rope_head_dim
    kv_a_bias: torch.Tensor | None
    kv_a_norm: torch.Tensor  # kv_a_layernorm over the latent
    kv_b: torch.Tensor  # kv_b_proj: kv_lora_rank -> heads * (qk_nope_head_dim + v_head_dim)
    o: torch.Tensor  # o_proj: heads * v_head_dim -> hidden
    o_bias: torch.Tensor | None


@dataclass
class MlpWeights:
    """A dense SwiGLU MLP (dense layers, shared experts)."""

    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    attention: AttentionWeights | MlaWeights
    router: torch.Tensor | None  # [num_experts, hidden]; None for dense layers
    router_bias: torch.Tensor | None  # DeepSeek-V3's e_score_correction_bias, fp32 as transformers keeps it
    dense_mlp: MlpWeights | None
    shared_expert: MlpWeights | None  # always resident: never handed to the expert provider
    shared_expert_gate: torch.Tensor | None  # Qwen2-MoE's sigmoid gate; DeepSeek's are ungated


@dataclass
class NonExpertWeights:
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerWeights]


class WeightReader:
    """Converts checkpoint tensors to the run dtype and device as they are read."""

    def __init__(
        self, checkpoint: Checkpoint | QuantizedCheckpoint, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.ckpt = checkpoint
        self.dtype = dtype
        self.device = device

    def tensor(
        self, name: str, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
        as_stored: bool = False,
    ) -> torch.Tensor:
        """as_stored: a float tensor keeps the checkpoint's dtype (what a layout packs anew needs no wider copy)."""
        t = self.ckpt.get(name)
        return t.to(device=device or self.device, dtype=self.read_dtype(t.dtype, as_stored, dtype)).contiguous()

    def read_dtype(self, stored: torch.dtype, as_stored: bool, dtype: torch.dtype | None = None) -> torch.dtype:
        """The dtype a tensor stored as `stored` is read in: a float one (wider than 8 bits) as stored when
        `as_stored`, else `dtype`, else the run dtype."""
        if as_stored and stored.is_floating_point and stored.itemsize > 1:
            return stored
        return dtype or self.dtype

    def optional(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return self.tensor(name, dtype=dtype) if name in self.ckpt else None


def _moe_prefix(ckpt: Checkpoint | QuantizedCheckpoint, layer: int) -> str:
    for prefix in (f"model.layers.{layer}.block_sparse_moe", f"model.layers.{layer}.mlp"):
        if f"{prefix}.gate.weight" in ckpt:
            return prefix
    raise KeyError(f"no router weight for layer {layer} (looked for block_sparse_moe.gate / mlp.gate)")


def _mlp(reader: WeightReader, prefix: str) -> MlpWeights:
    gate = reader.tensor(f"{prefix}.gate_proj.weight")
    up = reader.tensor(f"{prefix}.up_proj.weight")
    return MlpWeights(torch.cat([gate, up], dim=0), reader.tensor(f"{prefix}.down_proj.weight"))


def _attention_weights(reader: WeightReader, a: str) -> AttentionWeights:
    return AttentionWeights(
        q=reader.tensor(f"{a}.q_proj.weight"),
        k=reader.tensor(f"{a}.k_proj.weight"),
        v=reader.tensor(f"{a}.v_proj.weight"),
        o=reader.tensor(f"{a}.o_proj.weight"),
        q_bias=reader.optional(f"{a}.q_proj.bias"),
        k_bias=reader.optional(f"{a}.k_proj.bias"),
        v_bias=reader.optional(f"{a}.v_proj.bias"),
        o_bias=reader.optional(f"{a}.o_proj.bias"),
        q_norm=reader.optional(f"{a}.q_norm.weight"),
        k_norm=reader.optional(f"{a}.k_norm.weight"),
    )


def _mla_weights(reader: WeightReader, a: str) -> MlaWeights:
    return MlaWeights(
        q=reader.optional(f"{a}.q_proj.weight"),
        q_a=reader.optional(f"{a}.q_a_proj.weight"),
        q_a_bias=reader.optional(f"{a}.q_a_proj.bias"),
        q_a_norm=reader.optional(f"{a}.q_a_layernorm.weight"),
        q_b=reader.optional(f"{a}.q_b_proj.weight"),
        kv_a=reader.tensor(f"{a}.kv_a_proj_with_mqa.weight"),
        kv_a_bias=reader.optional(f"{a}.kv_a_proj_with_mqa.bias"),
        kv_a_norm=reader.tensor(f"{a}.kv_a_layernorm.weight"),
        kv_b=reader.tensor(f"{a}.kv_b_proj.weight"),
        o=reader.tensor(f"{a}.o_proj.weight"),
        o_bias=reader.optional(f"{a}.o_proj.bias"),
    )


def load_router(reader: WeightReader, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A MoE layer's router weight [num_experts, hidden] and DeepSeek-V3's selection bias (fp32) or None."""
    moe = _moe_prefix(reader.ckpt, layer)
    return reader.tensor(f"{moe}.gate.weight"), reader.optional(f"{moe}.gate.e_score_correction_bias", torch.float32)


def load_non_expert_weights(reader: WeightReader, spec: ModelSpec) -> NonExpertWeights:
    read_attention = _mla_weights if spec.mla else _attention_weights
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        router = router_bias = dense = shared = shared_gate = None
        if spec.moe_layers[i]:
            moe = _moe_prefix(reader.ckpt, i)
            router, router_bias = load_router(reader, i)
            if spec.shared_expert_intermediate_size:
                # Qwen2-MoE names one gated "shared_expert"; DeepSeek fuses its n_shared_experts into one MLP.
                name = "shared_expert" if spec.model_type == "qwen2_moe" else "shared_experts"
                shared = _mlp(reader, f"{moe}.{name}")
                shared_gate = reader.optional(f"{moe}.shared_expert_gate.weight")
        else:
            dense = _mlp(reader, f"{p}.mlp")
        layers.append(
            LayerWeights(
                input_norm=reader.tensor(f"{p}.input_layernorm.weight"),
                post_attention_norm=reader.tensor(f"{p}.post_attention_layernorm.weight"),
                attention=read_attention(reader, f"{p}.self_attn"),
                router=router,
                router_bias=router_bias,
                dense_mlp=dense,
                shared_expert=shared,
                shared_expert_gate=shared_gate,
            )
        )
    embed = reader.tensor("model.embed_tokens.weight")
    lm_head = (
        embed
        if spec.tie_word_embeddings or "lm_head.weight" not in reader.ckpt
        else reader.tensor("lm_head.weight")
    )
    return NonExpertWeights(embed, reader.tensor("model.norm.weight"), lm_head, layers)


def expert_loader(
    reader: WeightReader, spec: ModelSpec, layer: int, as_stored: bool = False, transient: bool = False
) -> Callable[[int, torch.device | str], ExpertWeights]:
    """A function reading one expert of `layer` (by index) onto a device, whatever the on-disk layout.
    as_stored: in the checkpoint's float dtype, not the run dtype (for a layout that converts it anyway:
    quantizing a bf16 expert read as fp32 held twice the bytes at the load's peak). transient: the caller copies
    each expert into memory of its own before it asks for the one after next (read_ahead's order), so its
    tensors may be reused buffers."""
    prefix = _moe_prefix(reader.ckpt, layer)
    fused = f"{prefix}.experts.gate_up_proj"
    if fused in reader.ckpt:
        # Fused 3-D layout ([E, 2I, H] and [E, H, I]): read once, slice per expert.
        gate_up_all = reader.ckpt.get(fused)
        down_all = reader.ckpt.get(f"{prefix}.experts.down_proj")
        dtype = reader.read_dtype(gate_up_all.dtype, as_stored)

        def load_fused(expert: int, device: torch.device | str) -> ExpertWeights:
            return ExpertWeights(
                gate_up_all[expert].to(device=device, dtype=dtype).contiguous(),
                down_all[expert].to(device=device, dtype=dtype).contiguous(),
            )

        return load_fused
    names = next((n for n in _PER_EXPERT_NAMES if f"{prefix}.experts.0.{n[0]}.weight" in reader.ckpt), None)
    if names is None:
        raise KeyError(f"no expert weights found under {prefix}.experts")
    gate_name, up_name, down_name = names
    first = [f"{prefix}.experts.0.{n}.weight" for n in names]
    reused = _ReusedExpertReads.of(reader, first, as_stored) if transient else None

    def load_per_expert(expert: int, device: torch.device | str) -> ExpertWeights:
        e = f"{prefix}.experts.{expert}"
        if reused is not None and torch.device(device).type == "cpu":
            return reused.read(f"{e}.{gate_name}.weight", f"{e}.{up_name}.weight", f"{e}.{down_name}.weight")
        gate = reader.tensor(f"{e}.{gate_name}.weight", device, as_stored=as_stored)
        up = reader.tensor(f"{e}.{up_name}.weight", device, as_stored=as_stored)
        return ExpertWeights(torch.cat([gate, up], dim=0),
                             reader.tensor(f"{e}.{down_name}.weight", device, as_stored=as_stored))

    return load_per_expert


class _ReusedExpertReads:
    """An expert's three tensors read into buffers that the reads reuse, gate and up straight into their rows of
    gate_up; two sets taken in turn, so an expert stays valid while the next one is read (read_ahead). Why: a
    fresh buffer per tensor page-faulted 3-9 MB in (and out again) per expert, and joining gate and up copied
    them once more; the int4 load of a 30B-parameter bf16 checkpoint spent more time in the kernel than in
    reading and packing."""

    def __init__(self, ckpt: Checkpoint, gate_rows: int, gate_up: tuple[int, int], down: list[int],
                 dtype: torch.dtype) -> None:
        self.ckpt = ckpt
        self.gate_rows = gate_rows
        self.sets = [(torch.empty(gate_up, dtype=dtype), torch.empty(down, dtype=dtype)) for _ in range(2)]
        self.reads = 0

    @classmethod
    def of(cls, reader: WeightReader, names: list[str], as_stored: bool) -> _ReusedExpertReads | None:
        """For experts stored as `names` (gate, up, down) and read as they are stored; else None."""
        ckpt = reader.ckpt
        if not isinstance(ckpt, Checkpoint):
            return None
        (gate_dtype, gate), (up_dtype, up), (down_dtype, down) = (ckpt.spec(n) for n in names)
        if (len({gate_dtype, up_dtype, down_dtype}) != 1 or reader.read_dtype(gate_dtype, as_stored) != gate_dtype
                or len(gate) != 2 or len(up) != 2 or gate[1] != up[1]):
            return None
        return cls(ckpt, gate[0], (gate[0] + up[0], gate[1]), down, gate_dtype)

    def read(self, gate: str, up: str, down: str) -> ExpertWeights:
        """The expert in one of the reused sets: valid until the read after next."""
        gate_up, down_buffer = self.sets[self.reads % 2]
        self.reads += 1
        self.ckpt.read_into(gate, gate_up[: self.gate_rows])
        self.ckpt.read_into(up, gate_up[self.gate_rows :])
        self.ckpt.read_into(down, down_buffer)
        return ExpertWeights(gate_up, down_buffer)


def read_ahead(
    load: Callable[[int, torch.device | str], ExpertWeights], count: int, device: torch.device | str
) -> Iterator[ExpertWeights]:
    """Experts 0 .. count-1 of `load` in order, each next one read on a helper thread while the caller packs
    the one before (file reads and the native packing both leave the GIL). A transient loader's expert stays
    valid until the read after next, so the caller must be done with it when it asks for the one after."""
    with ThreadPoolExecutor(1, thread_name_prefix="hintserve-read-ahead") as pool:
        pending = pool.submit(load, 0, device) if count else None
        for expert in range(count):
            assert pending is not None
            weights = pending.result()
            pending = pool.submit(load, expert + 1, device) if expert + 1 < count else None
            yield weights
