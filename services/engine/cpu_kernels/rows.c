/* The inner loops: weight rows [n0, n1) of one matrix against prepared activation rows (formats: matmul.c).
 *
 * Each weight row is read once from memory and serves every activation row, MB at a time from registers; MB is
 * a compile-time constant in each loop (`ROWS_SWITCH`), so the accumulators live in registers (with the count
 * known only at run time they went through the stack, a store-load chain per step: 29 cycles per 64 int8
 * weights). int8 and int4 run a tile of TILE rows at a time (below). */
#include <stdint.h>
#include <string.h>

#include "hs.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define HAVE_AVX512 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAVE_VNNI512 1
#endif

#define INLINE static inline __attribute__((always_inline))
/* How far ahead the lighter streams (int4, one-row bf16) prefetch: a DRAM latency's worth of bytes. At 1 KB
 * int4 streamed 55-75% of the read probe on one thread (Zen 5), at 4 KB 83-93%. */
#define PREFETCH_BYTES 4096


INLINE float bf16f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The float formats' portable loop: w is fp32, or bf16 widened (is_bf16, a constant where it is inlined). */
INLINE float portable_dot(const void *w, int is_bf16, const float *x, int64_t K) {
    float s[16] = {0};
    for (int64_t k = 0; k < K; k += 16)
        for (int i = 0; i < 16; i++)
            s[i] += (is_bf16 ? bf16f(((const uint16_t *)w)[k + i]) : ((const float *)w)[k + i]) * x[k + i];
    float t = 0.0f;
    for (int i = 0; i < 16; i++)
        t += s[i];
    return t;
}

/* Calls body(mm) with mm a constant 1..MB for each block of activation rows. */
#define ROWS_SWITCH(M, body)                                                                                     \
    for (int64_t m = 0; m < (M); m += MB) {                                                                    \
        switch ((M) - m < MB ? (M) - m : MB) {                                                                 \
        case 1: body(1); break;                                                                                \
        case 2: body(2); break;                                                                                \
        case 3: body(3); break;                                                                                \
        case 4: body(4); break;                                                                                \
        case 5: body(5); break;                                                                                \
        case 6: body(6); break;                                                                                \
        case 7: body(7); break;                                                                                \
        default: body(8); break;                                                                               \
        }                                                                                                      \
    }

/* ---- fp32 ---- */
INLINE void f32_block(const float *w, const acts *a, const int64_t *rows, int mm, int64_t K, float *out) {
#if defined(HAVE_AVX512)
    __m512 acc[MB];
    const float *x[MB];
    for (int r = 0; r < mm; r++) {
        acc[r] = _mm512_setzero_ps();
        x[r] = a->f32 + rows[r] * a->ld;
    }
    if (mm == 1) { /* one row: four chains, so the FMA latency never paces the stream */
        __m512 a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 64) {
            acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x[0] + k), acc[0]);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x[0] + k + 16), a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 32), _mm512_loadu_ps(x[0] + k + 32), a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 48), _mm512_loadu_ps(x[0] + k + 48), a3);
        }
        out[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], a1), _mm512_add_ps(a2, a3)));
        return;
    }
    for (int64_t k = 0; k < K; k += 16) {
        __m512 wv = _mm512_loadu_ps(w + k);
        for (int r = 0; r < mm; r++)
            acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x[r] + k), acc[r]);
    }
    for (int r = 0; r < mm; r++)
        out[r] = _mm512_reduce_add_ps(acc[r]);
#else
    for (int r = 0; r < mm; r++)
        out[r] = portable_dot(w, 0, a->f32 + rows[r] * a->ld, K);
#endif
}

/* ---- bf16: activations rounded to bf16 where the CPU has a bf16 dot product, else widened weights ---- */
INLINE void bf16_block(const uint16_t *w, const acts *a, const int64_t *rows, int mm, int64_t K, float *out) {
#if defined(__AVX512BF16__)
    __m512 acc[MB];
    const uint16_t *x[MB];
    for (int r = 0; r < mm; r++) {
        acc[r] = _mm512_setzero_ps();
        x[r] = a->bf16 + rows[r] * K;
    }
    if (mm == 1) { /* one row: two chains */
        __m512 a1 = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 64) {
            _mm_prefetch((const char *)(w + k) + 2 * PREFETCH_BYTES, _MM_HINT_T0);
            acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_loadu_si512(w + k),
                                      (__m512bh)_mm512_loadu_si512(x[0] + k));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + k + 32),
                                  (__m512bh)_mm512_loadu_si512(x[0] + k + 32));
        }
        out[0] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], a1));
        return;
    }
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
        for (int r = 0; r < mm; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], wv, (__m512bh)_mm512_loadu_si512(x[r] + k));
    }
    for (int r = 0; r < mm; r++)
        out[r] = _mm512_reduce_add_ps(acc[r]);
#else
    for (int r = 0; r < mm; r++)
        out[r] = portable_dot(w, 1, a->f32 + rows[r] * a->ld, K);
#endif
}

/* ---- fp32 and bf16 at two or more activation rows: a tile of NT weight rows x up to MT activation rows ----
 * One row of weights against MB rows (above) spends a load of activations on every FMA, and those rows (8 KB
 * each at K = 2048) come from L2: prefill ran at a fifth of the FMA peak. NT x MT accumulators in registers
 * load NT + MT vectors per NT * MT FMAs, and hs_rows_block walks the activation rows outer and a work item's
 * weight rows inner, so an item's weights stay in L2 while each block of activations is read once. */
#define NT 4
#define MT 6

#if defined(HAVE_AVX512)
INLINE void f32_tile(const float *w, int64_t K, const float *const *x, int mm, float out[NT][MT]) {
    __m512 acc[NT][MT];
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < mm; r++)
            acc[i][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 wv[NT];
        for (int i = 0; i < NT; i++)
            wv[i] = _mm512_loadu_ps(w + i * K + k);
        for (int r = 0; r < mm; r++) {
            __m512 xv = _mm512_loadu_ps(x[r] + k);
            for (int i = 0; i < NT; i++)
                acc[i][r] = _mm512_fmadd_ps(wv[i], xv, acc[i][r]);
        }
    }
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < mm; r++)
            out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}
#endif

#if defined(__AVX512BF16__)
INLINE void bf16_tile(const uint16_t *w, int64_t K, const uint16_t *const *x, int mm, float out[NT][MT]) {
    __m512 acc[NT][MT];
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < mm; r++)
            acc[i][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv[NT];
        for (int i = 0; i < NT; i++)
            wv[i] = (__m512bh)_mm512_loadu_si512(w + i * K + k);
        for (int r = 0; r < mm; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x[r] + k);
            for (int i = 0; i < NT; i++)
                acc[i][r] = _mm512_dpbf16_ps(acc[i][r], wv[i], xv);
        }
    }
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < mm; r++)
            out[i][r] = _mm512_reduce_add_ps(acc[i][r]);
}
#endif

/* Weight rows [n0, n1) of a float format against M >= 2 activation rows, tiles where the build has them. */
static void float_rows(const hs_matrix *W, const acts *a, const int64_t *rows, int64_t M, int64_t n0, int64_t n1,
                       float *y, int64_t ldy) {
    int64_t K = W->K;
    int bf16 = W->format == BF16;
    float out[NT][MT];
    for (int64_t m = 0; m < M; m += MT) {
        int mm = (int)(M - m < MT ? M - m : MT);
        const float *xf[MT];
        const uint16_t *xh[MT];
        for (int r = 0; r < mm; r++) {
            xf[r] = a->f32 + rows[m + r] * a->ld;
            xh[r] = bf16 ? a->bf16 + rows[m + r] * K : NULL;
        }
        int64_t n = n0;
#if defined(HAVE_AVX512)
        if (!bf16)
            for (; n + NT <= n1; n += NT) {
                const float *w = (const float *)W->w + n * K;
#define F32_TILE(c) f32_tile(w, K, xf, c, out)
                switch (mm) {
                case 1: F32_TILE(1); break;
                case 2: F32_TILE(2); break;
                case 3: F32_TILE(3); break;
                case 4: F32_TILE(4); break;
                case 5: F32_TILE(5); break;
                default: F32_TILE(6); break;
                }
                for (int i = 0; i < NT; i++)
                    for (int r = 0; r < mm; r++)
                        y[(m + r) * ldy + n + i] = out[i][r] + (W->bias ? W->bias[n + i] : 0.0f);
            }
#endif
#if defined(__AVX512BF16__)
        if (bf16)
            for (; n + NT <= n1; n += NT) {
                const uint16_t *w = (const uint16_t *)W->w + n * K;
#define BF16_TILE(c) bf16_tile(w, K, xh, c, out)
                switch (mm) {
                case 1: BF16_TILE(1); break;
                case 2: BF16_TILE(2); break;
                case 3: BF16_TILE(3); break;
                case 4: BF16_TILE(4); break;
                case 5: BF16_TILE(5); break;
                default: BF16_TILE(6); break;
                }
                for (int i = 0; i < NT; i++)
                    for (int r = 0; r < mm; r++)
                        y[(m + r) * ldy + n + i] = out[i][r] + (W->bias ? W->bias[n + i] : 0.0f);
            }
#endif
        for (; n < n1; n++) { /* rows past the last whole tile, and builds without the tiles */
            float one[MB];
            float add = W->bias ? W->bias[n] : 0.0f;
            if (bf16)
                bf16_block((const uint16_t *)W->w + n * K, a, rows + m, mm, K, one);
            else
                f32_block((const float *)W->w + n * K, a, rows + m, mm, K, one);
            for (int r = 0; r < mm; r++)
                y[(m + r) * ldy + n] = one[r] + add;
        }
    }
}

/* ---- int8 and int4: tiles of TILE weight rows, TILE lanes of one vector each (layouts: formats.py) ----
 * int8 tile: [K/4][TILE][4] bytes (w + 128); int4 tile: [K/8][TILE][4] bytes, byte (i, t) holding row i's
 * inputs t (low nibble) and 4 + t (high) of each 8; its (scale, zero) as bf16 [2][G][TILE]. One vpdpbusd
 * multiplies 4 inputs of TILE rows by the same 4 activations (broadcast), so each group's scales apply to a
 * vector of rows and nothing is summed across lanes. */
#define TILE 16
#define SPLIT_MAX 4 /* activation rows up to which each row's integer dot products run on two chains */

#if defined(HAVE_VNNI512)
INLINE __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

INLINE __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

INLINE void q8_tile(const uint8_t *w, const float *ws, const acts *a, const int64_t *rows, int mm, int64_t K,
                    float *y, int64_t ldy, const float *bias, int valid) {
    int64_t blocks = K / QB;
    __m512 acc[MB];
    const int8_t *x[MB];
    for (int r = 0; r < mm; r++) {
        acc[r] = _mm512_setzero_ps();
        x[r] = a->q + rows[r] * K;
    }
    for (int64_t b = 0; b < blocks; b++) {
        /* Two chains per row while few rows run, so a vpdpbusd's latency never paces the stream; above SPLIT_MAX
         * rows the rows are chains enough and a second set of accumulators would spill. */
        __m512i dot[MB], odd[MB];
        for (int r = 0; r < mm; r++)
            dot[r] = odd[r] = _mm512_setzero_si512();
        for (int64_t k = b * QB; k < (b + 1) * QB; k += 8) {
            __m512i w0 = _mm512_loadu_si512(w + k * TILE), w1 = _mm512_loadu_si512(w + (k + 4) * TILE);
            for (int r = 0; r < mm; r++) {
                dot[r] = _mm512_dpbusd_epi32(dot[r], w0, bcast4(x[r] + k));
                if (mm <= SPLIT_MAX)
                    odd[r] = _mm512_dpbusd_epi32(odd[r], w1, bcast4(x[r] + k + 4));
                else
                    dot[r] = _mm512_dpbusd_epi32(dot[r], w1, bcast4(x[r] + k + 4));
            }
        }
        if (mm <= SPLIT_MAX)
            for (int r = 0; r < mm; r++)
                dot[r] = _mm512_add_epi32(dot[r], odd[r]);
        for (int r = 0; r < mm; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_set1_ps(a->d[rows[r] * blocks + b]), acc[r]);
    }
    __mmask16 keep = (__mmask16)((1u << valid) - 1);
    __m512 scale = _mm512_maskz_loadu_ps(keep, ws), add = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int r = 0; r < mm; r++)
        _mm512_mask_storeu_ps(y + r * ldy, keep,
                              _mm512_fmadd_ps(scale, _mm512_sub_ps(acc[r], _mm512_set1_ps(a->corr[rows[r]])), add));
}

INLINE void q4_tile(const uint8_t *w, const uint16_t *sz, int64_t g, const acts *a, const int64_t *rows, int mm,
                    int64_t K, float *y, int64_t ldy, const float *bias, int valid) {
    int64_t G = K / g;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[MB];
    const int8_t *x[MB];
    for (int r = 0; r < mm; r++) {
        acc[r] = _mm512_setzero_ps();
        x[r] = a->q + rows[r] * K;
    }
    for (int64_t j = 0; j < G; j++) {
        __m512i dot[MB], hid[MB]; /* low and high nibbles on two chains while few rows run (q8_tile) */
        for (int r = 0; r < mm; r++)
            dot[r] = hid[r] = _mm512_setzero_si512();
        for (int64_t k = j * g; k < (j + 1) * g; k += 8) {
            _mm_prefetch((const char *)(w + k / 2 * TILE) + PREFETCH_BYTES, _MM_HINT_T0);
            __m512i p = _mm512_loadu_si512(w + k / 2 * TILE);
            __m512i lo = _mm512_and_si512(p, low), hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
            for (int r = 0; r < mm; r++) {
                dot[r] = _mm512_dpbusd_epi32(dot[r], lo, bcast4(x[r] + k));
                if (mm <= SPLIT_MAX)
                    hid[r] = _mm512_dpbusd_epi32(hid[r], hi, bcast4(x[r] + k + 4));
                else
                    dot[r] = _mm512_dpbusd_epi32(dot[r], hi, bcast4(x[r] + k + 4));
            }
        }
        if (mm <= SPLIT_MAX)
            for (int r = 0; r < mm; r++)
                dot[r] = _mm512_add_epi32(dot[r], hid[r]);
        __m512 scale = bf16x16(sz + j * TILE), zero = bf16x16(sz + (G + j) * TILE);
        __m512 zero8 = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero); /* the offset's and the zero's share */
        for (int r = 0; r < mm; r++) {
            int64_t at = rows[r] * G + j;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(scale, _mm512_set1_ps(a->d[at])), acc[r]);
            acc[r] = _mm512_fmadd_ps(zero8, _mm512_set1_ps(a->dsum[at]), acc[r]);
        }
    }
    __mmask16 keep = (__mmask16)((1u << valid) - 1);
    __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int r = 0; r < mm; r++)
        _mm512_mask_storeu_ps(y + r * ldy, keep, _mm512_add_ps(acc[r], add));
}
#else
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

INLINE void q4_tile(const uint8_t *w, const uint16_t *sz, int64_t g, const acts *a, const int64_t *rows, int mm,
                    int64_t K, float *y, int64_t ldy, const float *bias, int valid) {
    int64_t G = K / g;
    for (int r = 0; r < mm; r++)
        for (int i = 0; i < valid; i++) {
            const int8_t *x = a->q + rows[r] * K;
            float t = 0.0f;
            for (int64_t j = 0; j < G; j++) {
                int32_t s = 0;
                for (int64_t k = j * g; k < (j + 1) * g; k++) {
                    uint8_t byte = w[(k / 8) * TILE * 4 + i * 4 + k % 4];
                    s += (int32_t)(k % 8 < 4 ? byte & 15 : byte >> 4) * x[k];
                }
                float scale = bf16f(sz[j * TILE + i]), zero = bf16f(sz[(G + j) * TILE + i]);
                int64_t at = rows[r] * G + j;
                t += scale * a->d[at] * (float)s + (zero - 8.0f * scale) * a->dsum[at];
            }
            y[r * ldy + i] = t + (bias ? bias[i] : 0.0f);
        }
}
#endif

INLINE void store(float *y, int64_t ldy, int64_t n, const float *out, int mm, float add) {
    for (int r = 0; r < mm; r++)
        y[r * ldy + n] = out[r] + add;
}

void hs_rows_block(const hs_matrix *W, const acts *a, const int64_t *rows, int64_t M, int64_t n0, int64_t n1,
                   float *y, int64_t ldy) {
    int64_t K = W->K;
    float out[MB];
    int64_t step = W->format == Q8 || W->format == Q4 ? TILE : 1; /* chunks start on a tile (NCHUNK) */
    if ((W->format == F32 || W->format == BF16) && M >= 2) {
        float_rows(W, a, rows, M, n0, n1, y, ldy);
        return;
    }
    for (int64_t n = n0; n < n1; n += step) {
        float bias = W->bias && step == 1 ? W->bias[n] : 0.0f;
        int valid = (int)(W->N - n < TILE ? W->N - n : TILE); /* a last tile's rows past N are padding */
        if (W->format == F32) {
            const float *w = (const float *)W->w + n * K;
#define F32_BODY(mm) (f32_block(w, a, rows + m, mm, K, out), store(y + m * ldy, ldy, n, out, mm, bias))
            ROWS_SWITCH(M, F32_BODY)
        } else if (W->format == BF16) {
            const uint16_t *w = (const uint16_t *)W->w + n * K;
#define BF16_BODY(mm) (bf16_block(w, a, rows + m, mm, K, out), store(y + m * ldy, ldy, n, out, mm, bias))
            ROWS_SWITCH(M, BF16_BODY)
        } else if (W->format == Q8) {
            const uint8_t *w = (const uint8_t *)W->w + n * K;
            const float *ws = (const float *)W->scales + n, *b = W->bias ? W->bias + n : NULL;
#define Q8_BODY(mm) q8_tile(w, ws, a, rows + m, mm, K, y + m * ldy + n, ldy, b, valid)
            ROWS_SWITCH(M, Q8_BODY)
        } else {
            const uint8_t *w = (const uint8_t *)W->w + n * (K / 2);
            const uint16_t *sz = (const uint16_t *)W->scales + n * 2 * (K / W->group);
            const float *b = W->bias ? W->bias + n : NULL;
#define Q4_BODY(mm) q4_tile(w, sz, W->group, a, rows + m, mm, K, y + m * ldy + n, ldy, b, valid)
            ROWS_SWITCH(M, Q4_BODY)
        }
    }
}

/* Which of the loops above this build runs (the engine's start-up log and hintserve doctor say it). */
const char *hs_isa(void) {
    return
#if defined(HAVE_AVX512)
        "avx512"
#else
        "portable C"
#endif
#if defined(HAVE_VNNI512)
        "+vnni"
#endif
#if defined(__AVX512BF16__)
        "+bf16"
#endif
        ;
}
