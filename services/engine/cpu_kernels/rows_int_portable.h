/* Part of rows.c: the int8 and int4 tiles (layouts: rows.c, formats.py) in plain C, for builds without AVX2,
 * AVX-512 VNNI or Arm's SDOT. */
/* Portable loops over the same tiles. */
INLINE void q8_tile(const uint8_t *w, const float *ws, const acts *a, const int64_t *rows, int mm, int64_t K,
                    float *y, int64_t ldy, const float *bias, int valid) {
    int64_t blocks = K / QB;
    for (int r = 0; r < mm; r++)
        for (int i = 0; i < valid; i++) {
            const int8_t *x = a->q + rows[r] * K;
            float t = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                int32_t s = 0;
                for (int64_t k = b * QB; k < (b + 1) * QB; k++)
                    s += (int32_t)w[(k / 4) * TILE * 4 + i * 4 + k % 4] * x[k];
                t += a->d[rows[r] * blocks + b] * (float)s;
            }
            y[r * ldy + i] = ws[i] * (t - a->corr[rows[r]]) + (bias ? bias[i] : 0.0f);
        }
}

INLINE void q4_tile(const uint8_t *w, int64_t g, const acts *a, const int64_t *rows, int mm, int64_t K, float *y,
                    int64_t ldy, const float *bias, int valid) {
    int64_t G = K / g;
    for (int r = 0; r < mm; r++)
        for (int i = 0; i < valid; i++) {
            const int8_t *x = a->q + rows[r] * K;
            float t = 0.0f;
            for (int64_t j = 0; j < G; j++) {
                const uint8_t *wj = w + j * q4_group_bytes(g);
                const uint16_t *sz = (const uint16_t *)(wj + g / 2 * TILE);
                int32_t s = 0;
                for (int64_t k = 0; k < g; k++) {
                    uint8_t byte = wj[(k / 8) * TILE * 4 + i * 4 + k % 4];
                    s += (int32_t)(k % 8 < 4 ? byte & 15 : byte >> 4) * x[j * g + k];
                }
                float scale = bf16f(sz[i]), zero = bf16f(sz[TILE + i]);
                int64_t at = rows[r] * G + j;
                t += scale * a->d[at] * (float)s + (zero - 8.0f * scale) * a->dsum[at];
            }
            y[r * ldy + i] = t + (bias ? bias[i] : 0.0f);
        }
}
