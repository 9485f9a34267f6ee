/* A whole decoder layer of a decode step in one call: attention (fused q/k/v projection, Qwen3's head norms and
 * RoPE with the KV write, paged attention, output projection), the add-and-norm, softmax routing, the layer's
 * routed experts and the add-and-norm into the next layer's input. The same kernels run as from Python, in the
 * same order on the same inputs, so the results are the layered path's bit for bit.
 *
 * Why: from Python a decode layer was eight native calls with tensor allocations and checks between them. The
 * weight streams leave the caches cold, so each hand-off cost 5-15 us, and the glue between calls (~70 us a
 * layer at Qwen3-30B-A3B's shapes) was a tenth of a two-thread int4 token. */
#include <stddef.h>
#include <stdint.h>

#include "hs.h"

int hs_decode_layer(const hs_layer *L, const float *h, const float *x, int64_t B, const int64_t *positions,
                    const int64_t *slots, const int64_t *tables, int64_t max_blocks, const int64_t *lens,
                    int64_t block_size, float *work, float *h_mid, float *probs, float *weights, int64_t *ids,
                    float *h_out, float *x_out) {
    int64_t H = L->hidden, width = (L->q_heads + 2 * L->kv_heads) * L->head_dim, q_width = L->q_heads * L->head_dim;
    float *qkv = work, *attn = qkv + B * width, *o = attn + B * q_width, *x_mid = o + B * H, *moe = x_mid + B * H;
    if (hs_linear(L->qkv, x, H, qkv, width, B))
        return -2;
    if (rope_write_kv_f32(qkv, B, L->q_heads, L->kv_heads, L->head_dim, L->cos, L->sin, L->max_positions,
                          positions, slots, L->k_cache, L->v_cache, L->slots, L->q_norm, L->k_norm, L->eps))
        return -1;
    int status = paged_decode_attention_f32(qkv, width, L->head_dim, L->k_cache, L->v_cache, L->slots, tables,
                                            max_blocks, lens, block_size, B, L->q_heads, L->kv_heads, L->head_dim,
                                            L->scale, attn);
    if (status)
        return status;
    if (hs_linear(L->o, attn, q_width, o, H, B))
        return -2;
    rms_norm_f32(h, o, L->post_attention_norm, L->eps, h_mid, x_mid, B, H);
    if (hs_route_softmax(L->router, x_mid, H, B, L->top_k, (int)L->renormalize, probs, weights, ids))
        return -2;
    status = hs_moe(L->gate_up, L->down, L->experts, NULL, L->experts, x_mid, H, B, ids, weights, L->top_k, moe);
    if (status)
        return status == -1 ? -3 : -2;
    rms_norm_f32(h_mid, moe, L->next_norm, L->eps, h_out, x_out, B, H);
    return 0;
}

/* Floats of `work` hs_decode_layer needs for B tokens. */
int64_t hs_decode_layer_work(const hs_layer *L, int64_t B) {
    return B * ((L->q_heads + 2 * L->kv_heads) * L->head_dim + L->q_heads * L->head_dim + 3 * L->hidden);
}
