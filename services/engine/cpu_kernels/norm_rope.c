/* A decode step's small fp32 passes between the matrices: fused add + RMSNorm, and RoPE with the KV cache
 * write (and Qwen3's per-head norms before it). */
#include <stdint.h>
#include <string.h>

#include "hs.h"

/* out = x / rms(x) * w per row of H (fp32 throughout, as transformers computes it); with `add`, x = a + add
 * is formed first and written to `sum` (the residual stream), the fused add-and-norm between sublayers. */
void rms_norm_f32(const float *a, const float *add, const float *w, float eps, float *sum, float *out, int64_t T,
                  int64_t H) {
    for (int64_t t = 0; t < T; t++) {
        const float *x = a + t * H;
        if (add) {
            float *s = sum + t * H;
            const float *b = add + t * H;
            for (int64_t h = 0; h < H; h++) s[h] = x[h] + b[h];
            x = s;
        }
        float squares = 0.0f;
        for (int64_t h = 0; h < H; h++) squares += x[h] * x[h];
        float inv = 1.0f / __builtin_sqrtf(squares / (float)H + eps);
        float *o = out + t * H;
        for (int64_t h = 0; h < H; h++) o[h] = x[h] * inv * w[h];
    }
}

/* Rotates the q and k heads of each token's fused projection row in place (rotate-half RoPE; cos and sin
 * tables [max_positions, D]) and writes k and v into the head-major caches [Hkv, S, D] at the token's slot. */
/* q_norm / k_norm (NULL: none): Qwen3's RMSNorm of each head, applied before the rotation. */
int rope_write_kv_f32(float *qkv, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float *cos_table,
                      const float *sin_table, int64_t max_positions, const int64_t *positions, const int64_t *slots,
                      float *k_cache, float *v_cache, int64_t S, const float *q_norm, const float *k_norm,
                      float eps) {
    int64_t half = D / 2, width = (Hq + 2 * Hkv) * D;
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_positions || slots[t] < 0 || slots[t] >= S) return -1;
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * width;
        const float *c = cos_table + positions[t] * D, *s = sin_table + positions[t] * D;
        for (int64_t head = 0; head < Hq + Hkv; head++) {
            float *x = row + head * D;
            const float *norm = head < Hq ? q_norm : k_norm;
            if (norm) rms_norm_f32(x, NULL, norm, eps, NULL, x, 1, D); /* in place: one row of D */
            for (int64_t i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
        for (int64_t h = 0; h < Hkv; h++) {
            memcpy(k_cache + (h * S + slots[t]) * D, row + (Hq + h) * D, (size_t)D * sizeof(float));
            memcpy(v_cache + (h * S + slots[t]) * D, row + (Hq + Hkv + h) * D, (size_t)D * sizeof(float));
        }
    }
    return 0;
}
