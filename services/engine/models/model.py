"""One decoder for every supported MoE family: embed -> [attention, MoE or dense MLP] x L -> norm -> logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine import cpu_kernels
from services.engine.cpu_kernels import formats
from services.engine.cpu_kernels.decode_layer import NativeDecodeLayer
from services.engine.expert_provider import ExpertProvider
from services.engine.models.attention import (
    AttentionMetadata,
    add_rms_norm,
    apply_rope,
    cached_kv,
    decode_attention,
    last_token_attention,
    prefill_attention,
    rms_norm,
    write_kv,
)
from services.engine.models.dense_layers import DenseLayers
from services.engine.models.fused_moe import fused_moe_forward
from services.engine.models.mla_attention import mla_attention
from services.engine.models.moe import moe_forward, record_routing, swiglu
from services.engine.models.native_linear import NativeLinear
from services.engine.models.native_moe import native_moe_forward
from services.engine.models.packed_linear import PackedLinear
from services.engine.models.router import Routing, route
from services.engine.models.spec import ModelSpec
from services.engine.models.weights import AttentionWeights, LayerWeights, MlaWeights, NonExpertWeights
from services.engine.step_context import StepContext

# Tokens from which a layer whose experts are also prepacked for oneDNN (resident.py: PREFILL_PACK_MAX_BYTES)
# runs them there rather than on the native kernels: a prompt's many rows per expert, not a decode step's few.
PACKED_MIN_TOKENS = 64


class MoECausalLM:
    def __init__(
        self,
        spec: ModelSpec,
        weights: NonExpertWeights,
        experts: ExpertProvider,
        inv_freq: torch.Tensor,
        rope_scaling: float,
        max_len: int,
        dense: DenseLayers,
    ) -> None:
        """dense: the attention projections and LM head, built from `weights` as they loaded (dense_layers)."""
        self.spec = spec
        self.w = weights
        self.experts = experts
        self.scale = spec.softmax_scale
        device, dtype = weights.embed.device, weights.embed.dtype
        positions = torch.arange(max_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * rope_scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * rope_scaling).to(device=device, dtype=dtype)
        self.k_caches: list[torch.Tensor] = []
        self.v_caches: list[torch.Tensor] = []
        self.latent_caches: list[torch.Tensor] = []  # MLA: [slots, kv_lora_rank + qk_rope_head_dim] per layer
        self.lm_head, self.qkv, self.o = dense.lm_head, dense.qkv, dense.o
        self.qkv_sizes = (spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim,
                          spec.num_kv_heads * spec.head_dim)
        # The native CPU kernels' layer path: fp32 on the CPU (each step also asks for one torch thread).
        self.native_ready = device.type == "cpu" and dtype == torch.float32 and all(
            n is None or (n.dtype == torch.float32 and n.is_contiguous()) for layer in weights.layers
            for n in (layer.input_norm, layer.post_attention_norm, *_head_norms(layer.attention)))
        # Softmax routers as the native kernels read them (the same memory): one call routes a layer's tokens.
        self.native_routers = [
            formats.as_cpu_matrix(layer.router) if self.native_ready and layer.router is not None
            and spec.router_rule == "softmax" else None for layer in weights.layers]
        # q and k rotated in one pass over their heads (nothing to clip between projection and RoPE; Qwen3's
        # per-head norms run inside the native pass)
        self.one_pass_rope = spec.mla is None and spec.qk_norm in ("none", "head") and spec.clip_qkv is None
        # Each layer's decode step in one native call where its parts allow (cpu_kernels/decode_layer.py):
        # built on the first decode step, once the KV caches and the experts are in place.
        self._decode_layers: list[NativeDecodeLayer | None] | None = None
        self._decode_epoch = 0  # the experts' native_epoch the decode layers were built at

    def allocate_kv_cache(self, num_slots: int) -> None:
        e, layers = self.w.embed, range(self.spec.num_layers)
        if self.spec.mla is not None:
            shape: tuple[int, ...] = (num_slots, self.spec.mla.latent_width)
            self.latent_caches = [torch.zeros(shape, dtype=e.dtype, device=e.device) for _ in layers]
            return
        shape = (self.spec.num_kv_heads, num_slots, self.spec.head_dim)  # head-major: see write_kv
        self._decode_layers = None  # they point into the caches
        self.k_caches = [torch.zeros(shape, dtype=e.dtype, device=e.device) for _ in layers]
        self.v_caches = [torch.zeros(shape, dtype=e.dtype, device=e.device) for _ in layers]

    def warm_up(self, max_tokens: int, max_seqs: int) -> None:
        """Builds oneDNN's kernels for every row count a step can bring (see packed_linear), once per shape, and
        the native CPU kernels (cpu_kernels), so no request waits for a compiler."""
        if self.w.embed.device.type == "cpu" and self.w.embed.dtype == torch.float32:
            cpu_kernels.library()
        linears = [lin for lin in (*self.qkv, *self.o) if lin is not None]
        for i in range(self.spec.num_layers):
            stacked = self.experts.stacked_experts(i) if self.spec.moe_layers[i] else None
            linears += [lin for pair in (stacked.packed if stacked else []) for lin in pair]
        built = set()
        for lin in (lin for lin in linears if isinstance(lin, PackedLinear)):  # native layers build nothing
            key = (tuple(lin.weight.shape), lin.bias is None)
            if key not in built:
                built.add(key)
                lin.warm_up(max_tokens)
        self.lm_head.warm_up(max_seqs)  # a no-op for a native layer

    @property
    def kv_cache_tensors(self) -> list[torch.Tensor]:
        return [*self.k_caches, *self.v_caches, *self.latent_caches]

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, ctx: StepContext,
        output_rows: torch.Tensor | None = None, prune: bool = False,
    ) -> torch.Tensor:
        """Hidden states after the final norm: one row per input token, or only output_rows' (a prefill needs
        each sequence's last). prune: past its KV write, the last layer computes those rows only, as llama.cpp
        does (a sixth of a demo-model prefill); the caller says whether anything watches the full routing."""
        spec, layers = self.spec, self.w.layers
        last = len(layers) - 1
        prune = prune and output_rows is not None and not ctx.layer_observers and self._prunable(last)
        prune_rows = output_rows if prune else None  # the last layer attends only these rows
        h = F.embedding(input_ids, self.w.embed)
        ctx.embeddings = h
        # One torch thread, fp32 on the CPU: norms, RoPE and the KV write through the native kernels (RoPE from
        # the full tables, so no rows are selected here).
        native = self.native_ready and cpu_kernels.usable(h)
        rope = None if native and self.one_pass_rope else (self.cos.index_select(0, positions),
                                                           self.sin.index_select(0, positions))
        h, x = add_rms_norm(h, None, layers[0].input_norm, spec.rms_norm_eps, native)
        # Observers watch layer by layer and a pruned prefill attends a subset: the layered path serves both.
        whole = self._whole_decode_layers() if native and not meta.is_prefill and not ctx.layer_observers else None
        for i, layer in enumerate(layers):
            if whole is not None and (fused := whole[i]) is not None:
                assert meta.block_tables is not None and meta.context_lens is not None  # decode metadata's
                out = fused(h, x, positions, meta.slot_mapping, meta.block_tables, meta.context_lens,
                            meta.block_size)
                ctx.record_layer_input(i, out.residual_mid)
                record_routing(i, Routing(out.weights, out.experts, out.probs), ctx)
                h, x = out.residual, out.normed
                continue
            if isinstance(layer.attention, MlaWeights):
                assert rope is not None  # MLA never rotates in one native pass (one_pass_rope)
                attn = mla_attention(x, layer.attention, self.latent_caches[i], rope[0], rope[1], meta, spec)
            else:
                attn = self._attention(i, layer.attention, x, positions, rope, meta,
                                       prune_rows if i == last else None)
            if prune_rows is not None and i == last:
                h = h.index_select(0, prune_rows)
            h, x = add_rms_norm(h, attn, layer.post_attention_norm, spec.rms_norm_eps, native)
            ctx.record_layer_input(i, h)
            next_norm = layers[i + 1].input_norm if i + 1 < len(layers) else self.w.final_norm
            h, x = add_rms_norm(h, self._mlp(i, layer, x, ctx), next_norm, spec.rms_norm_eps, native)
        self.experts.end_step(ctx)
        return x if output_rows is None or prune else x.index_select(0, output_rows)

    def _whole_decode_layers(self) -> list[NativeDecodeLayer | None]:
        epoch = self.experts.native_epoch
        if self._decode_layers is None or epoch != self._decode_epoch:
            self._decode_layers = [self._whole_decode_layer(i) for i in range(self.spec.num_layers)]
            self._decode_epoch = epoch
        return self._decode_layers

    def _whole_decode_layer(self, i: int) -> NativeDecodeLayer | None:
        """Layer i's decode step as one native call, where the kernels run every part of it; else None."""
        spec, layer, layers = self.spec, self.w.layers[i], self.w.layers
        qkv, o, router, native = self.qkv[i], self.o[i], self.native_routers[i], self.experts.native_experts(i)
        a = layer.attention
        if (not self.one_pass_rope or not self.k_caches or not isinstance(a, AttentionWeights)
                or not isinstance(qkv, NativeLinear) or not isinstance(o, NativeLinear) or router is None
                or native is None or layer.dense_mlp is not None or layer.shared_expert is not None):
            return None
        next_norm = layers[i + 1].input_norm if i + 1 < len(layers) else self.w.final_norm
        head_norms = None
        if spec.qk_norm == "head":
            assert a.q_norm is not None and a.k_norm is not None  # loaded whenever spec.qk_norm names them
            head_norms = (a.q_norm, a.k_norm)
        return NativeDecodeLayer.build(
            qkv.matrix, o.matrix, router, native.gate_up, native.down, (layer.post_attention_norm, next_norm),
            head_norms, (self.cos, self.sin), (self.k_caches[i], self.v_caches[i]),
            (spec.num_heads, spec.num_kv_heads, spec.head_dim), spec.top_k, spec.norm_topk_prob,
            spec.rms_norm_eps, self.scale)

    def _prunable(self, i: int) -> bool:
        """Layer i can compute a subset of its rows: standard attention, and a dense MLP or resident experts
        (offload providers and MLA keep every row)."""
        layer = self.w.layers[i]
        return isinstance(layer.attention, AttentionWeights) and (
            layer.dense_mlp is not None or self.experts.stacked_experts(i) is not None
            or self.experts.native_experts(i) is not None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def _attention(
        self,
        i: int,
        a: AttentionWeights,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """rope: this step's (cos, sin) rows; None when the native kernels rotate from the full tables.
        output_rows (a prefill's last tokens): every row's k and v are cached, only these rows attend."""
        spec = self.spec
        tokens = x.shape[0]
        qkv_proj = self.qkv[i]
        assert qkv_proj is not None  # None only for an MLA layer, which mla_attention runs
        qkv = qkv_proj(x)
        q_width, kv_width, _ = self.qkv_sizes
        if rope is None:  # one native pass: Qwen3's head norms, the rotation, the KV write
            norms = None
            if spec.qk_norm == "head":
                assert a.q_norm is not None and a.k_norm is not None  # loaded whenever spec.qk_norm names them
                norms = (a.q_norm, a.k_norm)
            cpu_kernels.rope_write_kv(qkv, spec.num_heads, spec.num_kv_heads, spec.head_dim, self.cos, self.sin,
                                      positions, meta.slot_mapping, self.k_caches[i], self.v_caches[i], norms,
                                      spec.rms_norm_eps)
            q = qkv[:, :q_width].view(tokens, spec.num_heads, spec.head_dim)
            k = qkv[:, q_width : q_width + kv_width].view(tokens, spec.num_kv_heads, spec.head_dim)
            v = qkv[:, q_width + kv_width :].view(tokens, spec.num_kv_heads, spec.head_dim)
            return self._attend(i, q, k, v, meta, written=True, output_rows=output_rows)
        if self.one_pass_rope and spec.qk_norm == "none":
            cos, sin = rope
            qk = apply_rope(qkv[:, : q_width + kv_width].view(tokens, -1, spec.head_dim), cos, sin)
            q, k = qk[:, : spec.num_heads], qk[:, spec.num_heads :]
            v = qkv[:, q_width + kv_width :].view(tokens, spec.num_kv_heads, spec.head_dim)
            return self._attend(i, q, k, v, meta, output_rows=output_rows)
        cos, sin = rope
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q_norm, k_norm = a.q_norm, a.k_norm
        if spec.qk_norm == "full":  # OLMoE normalises the whole projection before splitting heads
            assert q_norm is not None and k_norm is not None  # loaded whenever spec.qk_norm names them
            q = rms_norm(q, q_norm, spec.rms_norm_eps)
            k = rms_norm(k, k_norm, spec.rms_norm_eps)
        if spec.clip_qkv is not None:
            q, k, v = (t.clamp(-spec.clip_qkv, spec.clip_qkv) for t in (q, k, v))
        q = q.view(tokens, spec.num_heads, spec.head_dim)
        k = k.view(tokens, spec.num_kv_heads, spec.head_dim)
        v = v.view(tokens, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm == "head":  # Qwen3 normalises each head
            assert q_norm is not None and k_norm is not None  # loaded whenever spec.qk_norm names them
            q = rms_norm(q, q_norm, spec.rms_norm_eps)
            k = rms_norm(k, k_norm, spec.rms_norm_eps)
        return self._attend(i, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, meta, output_rows=output_rows)

    def _attend(
        self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
        written: bool = False, output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotated q [T, Hq, D], k and v [T, Hkv, D] -> the layer's attention output [T, hidden] (output_rows:
        those rows' only, each a prefilled sequence's last); written: k and v are in the cache already."""
        if not written:
            write_kv(self.k_caches[i], self.v_caches[i], k, v, meta.slot_mapping)
        n = meta.num_decode_rows()
        if n:  # a mixed step's running sequences: the paged decode path, then the prompts' rows as below
            assert meta.decode_rows is not None
            decoded = decode_attention(q[:n], self.k_caches[i], self.v_caches[i], meta.decode_rows, self.scale)
            q, k, v = q[n:], k[n:], v[n:]
            output_rows = None if output_rows is None else output_rows[n:] - n
        seq_lens = meta.chunk_seq_lens()
        kv_lens = seq_lens
        if meta.prefill_kv_slots is not None:  # a chunk after cached tokens: every key from the cache
            k, v = cached_kv(self.k_caches[i], self.v_caches[i], meta.prefill_kv_slots)
            kv_lens = meta.prefill_kv_lens or kv_lens
        if output_rows is not None:
            out = last_token_attention(q.index_select(0, output_rows), k, v, kv_lens, self.scale)
        elif meta.is_prefill:
            out = prefill_attention(q, k, v, seq_lens, self.scale, kv_lens)
        else:
            out = decode_attention(q, self.k_caches[i], self.v_caches[i], meta, self.scale)
        if n:
            out = torch.cat((decoded, out))
        o_proj = self.o[i]
        assert o_proj is not None  # None only for an MLA layer
        return o_proj(out.reshape(out.shape[0], -1))

    def _mlp(self, i: int, layer: LayerWeights, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if layer.dense_mlp is not None:
            return swiglu(x, layer.dense_mlp.gate_up, layer.dense_mlp.down)
        assert layer.router is not None  # a layer without a dense MLP has routed experts
        usable = cpu_kernels.usable(x)
        routing = route(self.spec, x, layer.router, layer.router_bias, self.native_routers[i] if usable else None)
        stacked = self.experts.stacked_experts(i)
        native = self.experts.native_experts(i)
        if native is not None and usable and (stacked is None or not stacked.packed or x.shape[0] < PACKED_MIN_TOKENS):
            out = native_moe_forward(x, i, routing, native, ctx)
        elif stacked is not None:
            out = fused_moe_forward(x, i, routing, stacked, ctx)
        else:
            out = moe_forward(x, i, routing, self.experts, ctx)
        if layer.shared_expert is not None:
            shared = swiglu(x, layer.shared_expert.gate_up, layer.shared_expert.down)
            if layer.shared_expert_gate is not None:  # Qwen2-MoE gates its shared expert per token
                shared = torch.sigmoid(F.linear(x, layer.shared_expert_gate)) * shared
            out = out + shared
        return out


def _head_norms(attention: AttentionWeights | MlaWeights) -> tuple[torch.Tensor | None, ...]:
    """The q and k norm weights the native RoPE pass reads (none for MLA)."""
    return (attention.q_norm, attention.k_norm) if isinstance(attention, AttentionWeights) else ()
