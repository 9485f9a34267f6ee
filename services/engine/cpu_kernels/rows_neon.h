/* rows.c's loops for Arm: NEON for the float formats, and SDOT (the Armv8.2 dot-product extension: Graviton 2
 * on, Ampere Altra, Apple M1 on) for int8 and int4. Included by rows.c (from rows_float.h), after
 * rows_tuning.h, which defines INLINE and PREFETCH_BYTES (hs.h: TILE, MB, QB; the layouts: matmul.c,
 * formats.py); tests/native/check_kernels.c holds them to a scalar reference, built for aarch64 and run under
 * qemu (tests/test_native_isa.py).
 *
 * The integer tiles keep x86's layout: one 16-byte vector is 4 weight rows x 4 inputs, and SDOT's lane form
 * multiplies it by 4 activations taken from one lane of a loaded vector (no broadcast needed). The int8 weights
 * are stored + 128 for x86's unsigned-by-signed product; flipping the top bit gives the signed weight, so
 * here no correction term applies. int4 nibbles (0..15) are non-negative int8 already. */
#include <arm_neon.h>

#define HAVE_NEON 1
#if defined(__ARM_FEATURE_DOTPROD)
#define HAVE_NEON_DOT 1
#endif

/* 4 bf16 widened to fp32: a bf16 is an fp32's high half, so a shift is exact. */
INLINE float32x4_t bf16x4(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }

/* 4 weights as fp32: fp32 loaded, bf16 widened. */
INLINE float32x4_t neon_load4(const void *w, int is_bf16, int64_t k) {
    return is_bf16 ? bf16x4((const uint16_t *)w + k) : vld1q_f32((const float *)w + k);
}

/* The float formats against fp32 activations (bf16 weights widened, as the AVX2 loop: the activations are not
 * rounded). One row: four chains and the stream prefetched; more rows: one weight load serves every row. */
INLINE void neon_dots(const void *w, int is_bf16, const acts *a, const int64_t *rows, int mm, int64_t K,
                      float *out) {
    int64_t elt = is_bf16 ? 2 : 4;
    if (mm == 1) {
        const float *x = a->f32 + rows[0] * a->ld;
        float32x4_t c0 = vdupq_n_f32(0.0f), c1 = c0, c2 = c0, c3 = c0;
        for (int64_t k = 0; k < K; k += 16) {
            __builtin_prefetch((const char *)w + k * elt + 2 * PREFETCH_BYTES, 0, 3);
            c0 = vfmaq_f32(c0, neon_load4(w, is_bf16, k), vld1q_f32(x + k));
            c1 = vfmaq_f32(c1, neon_load4(w, is_bf16, k + 4), vld1q_f32(x + k + 4));
            c2 = vfmaq_f32(c2, neon_load4(w, is_bf16, k + 8), vld1q_f32(x + k + 8));
            c3 = vfmaq_f32(c3, neon_load4(w, is_bf16, k + 12), vld1q_f32(x + k + 12));
        }
        out[0] = vaddvq_f32(vaddq_f32(vaddq_f32(c0, c1), vaddq_f32(c2, c3)));
        return;
    }
    float32x4_t acc[MB];
    const float *x[MB];
    for (int r = 0; r < mm; r++) {
        acc[r] = vdupq_n_f32(0.0f);
        x[r] = a->f32 + rows[r] * a->ld;
    }
    for (int64_t k = 0; k < K; k += 4) {
        float32x4_t wv = neon_load4(w, is_bf16, k);
        for (int r = 0; r < mm; r++)
            acc[r] = vfmaq_f32(acc[r], wv, vld1q_f32(x[r] + k));
    }
    for (int r = 0; r < mm; r++)
        out[r] = vaddvq_f32(acc[r]);
}

#if defined(HAVE_NEON_DOT)
/* One activation row's integer dot products with a tile over 16 inputs: d[j] (rows 4j..4j+3) += the 4 vectors
 * at p, each against the lane of x that holds its 4 inputs. Two sets of chains (d, e) so SDOT's latency never
 * paces the loop. */
#define DOT4(acc, p, xv, lane, prep)                                                                            \
    for (int j = 0; j < 4; j++)                                                                                \
        acc[j] = vdotq_laneq_s32(acc[j], prep(vld1q_u8((p) + 16 * j)), xv, lane)

INLINE int8x16_t q8_signed(uint8x16_t v) { return vreinterpretq_s8_u8(veorq_u8(v, vdupq_n_u8(0x80))); }
INLINE int8x16_t q4_low(uint8x16_t v) { return vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0f))); }
INLINE int8x16_t q4_high(uint8x16_t v) { return vreinterpretq_s8_u8(vshrq_n_u8(v, 4)); }

/* Zeroes the tile's accumulators of its first mm activation rows. */
INLINE void neon_zero(float32x4_t acc[MB][4], int mm) {
    for (int r = 0; r < mm; r++)
        for (int j = 0; j < 4; j++)
            acc[r][j] = vdupq_n_f32(0.0f);
}

/* The tile's 16 results of one row, columns past `valid` padding, to y. */
INLINE void neon_store(float *y, const float32x4_t acc[4], const float *mul, const float *bias, int valid) {
    float res[TILE];
    for (int j = 0; j < 4; j++)
        vst1q_f32(res + 4 * j, acc[j]);
    for (int i = 0; i < valid; i++)
        y[i] = (mul ? mul[i] * res[i] : res[i]) + (bias ? bias[i] : 0.0f);
}

/* int8 tile [K/4][TILE][4]: per block of QB inputs, each row's dot products scaled by its block's scale. */
INLINE void q8_tile(const uint8_t *w, const float *ws, const acts *a, const int64_t *rows, int mm, int64_t K,
                    float *y, int64_t ldy, const float *bias, int valid) {
    int64_t blocks = K / QB;
    float32x4_t acc[MB][4];
    neon_zero(acc, mm);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *wb = w + b * QB * TILE;
        for (int64_t line = 0; line < QB * TILE; line += 64) /* the block's 1 KB, 8 KB on */
            __builtin_prefetch((const char *)wb + 2 * PREFETCH_BYTES + line, 0, 3);
        for (int r = 0; r < mm; r++) {
            const int8_t *x = a->q + rows[r] * K + b * QB;
            int32x4_t d[4], e[4];
            for (int j = 0; j < 4; j++)
                d[j] = e[j] = vdupq_n_s32(0);
            for (int64_t k = 0; k < QB; k += 16) { /* 16 inputs: 4 groups of 4, 64 bytes each */
                int8x16_t xv = vld1q_s8(x + k);
                const uint8_t *p = wb + k * TILE;
                DOT4(d, p, xv, 0, q8_signed);
                DOT4(e, p + 64, xv, 1, q8_signed);
                DOT4(d, p + 128, xv, 2, q8_signed);
                DOT4(e, p + 192, xv, 3, q8_signed);
            }
            float32x4_t scale = vdupq_n_f32(a->d[rows[r] * blocks + b]);
            for (int j = 0; j < 4; j++)
                acc[r][j] = vfmaq_f32(acc[r][j], vcvtq_f32_s32(vaddq_s32(d[j], e[j])), scale);
        }
    }
    for (int r = 0; r < mm; r++)
        neon_store(y + r * ldy, acc[r], ws, bias, valid);
}

/* int4 tile, group after group: [g/8][TILE][4] (low nibble input t, high 4 + t of each 8), then (scale, zero)
 * bf16 [2][TILE]: w = (q - 8) * scale + zero, so a group adds scale * d * sum(q x) + (zero - 8 scale) * d * sum(x). */
INLINE void q4_tile(const uint8_t *w, int64_t g, const acts *a, const int64_t *rows, int mm, int64_t K, float *y,
                    int64_t ldy, const float *bias, int valid) {
    int64_t G = K / g, gb = q4_group_bytes(g);
    float32x4_t acc[MB][4];
    neon_zero(acc, mm);
    for (int64_t jg = 0; jg < G; jg++) {
        const uint8_t *wg = w + jg * gb; /* the group's nibbles, then its scales and zeros */
        const uint16_t *sz = (const uint16_t *)(wg + g / 2 * TILE);
        for (int64_t line = 0; line < gb; line += 64)
            __builtin_prefetch((const char *)wg + PREFETCH_BYTES + line, 0, 3);
        float32x4_t scale[4], zero8[4];
        for (int j = 0; j < 4; j++) {
            scale[j] = bf16x4(sz + 4 * j);
            /* the offset's and the zero's share */
            zero8[j] = vfmsq_f32(bf16x4(sz + TILE + 4 * j), vdupq_n_f32(8.0f), scale[j]);
        }
        for (int r = 0; r < mm; r++) {
            const int8_t *x = a->q + rows[r] * K + jg * g;
            int32x4_t d[4], e[4];
            for (int j = 0; j < 4; j++)
                d[j] = e[j] = vdupq_n_s32(0);
            for (int64_t k = 0; k < g; k += 16) { /* 16 inputs: two groups of 8, 64 bytes each */
                int8x16_t xv = vld1q_s8(x + k);
                const uint8_t *p = wg + k / 2 * TILE;
                DOT4(d, p, xv, 0, q4_low);
                DOT4(e, p, xv, 1, q4_high);
                DOT4(d, p + 64, xv, 2, q4_low);
                DOT4(e, p + 64, xv, 3, q4_high);
            }
            int64_t at = rows[r] * G + jg;
            float32x4_t dx = vdupq_n_f32(a->d[at]), ds = vdupq_n_f32(a->dsum[at]);
            for (int j = 0; j < 4; j++) {
                float32x4_t dot = vcvtq_f32_s32(vaddq_s32(d[j], e[j]));
                acc[r][j] = vfmaq_f32(acc[r][j], dot, vmulq_f32(scale[j], dx));
                acc[r][j] = vfmaq_f32(acc[r][j], zero8[j], ds);
            }
        }
    }
    for (int r = 0; r < mm; r++)
        neon_store(y + r * ldy, acc[r], NULL, bias, valid);
}
#endif
