/* Part of rows.c (after rows_tuning.h): fp32 and bf16 weight rows against one to MB activation rows; one row
 * also against two weight rows at once (the pairs, hs_rows_item). The tiles for two rows and more:
 * rows_float_tiles.h. */

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

#if defined(__aarch64__) && defined(__ARM_NEON)
#include "rows_neon.h"
#endif

#if defined(HAVE_AVX2)
INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 8 bf16 widened to fp32: a bf16 is an fp32's high half, so a shift is exact. */
INLINE __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

INLINE __m256 load8(const void *w, int is_bf16, int64_t k) {
    return is_bf16 ? bf16x8((const uint16_t *)w + k) : _mm256_loadu_ps((const float *)w + k);
}

/* The float formats at 256 bits: fp32 activations against fp32 weights or bf16 ones widened (no bf16 dot
 * product here, so the activations are not rounded; as the portable loop). */
INLINE void avx2_dots(const void *w, int is_bf16, const acts *a, const int64_t *rows, int mm, int64_t K,
                      float *out) {
    __m256 acc[MB];
    const float *x[MB];
    for (int r = 0; r < mm; r++) {
        acc[r] = _mm256_setzero_ps();
        x[r] = a->f32 + rows[r] * a->ld;
    }
    if (mm == 1) { /* one row: four chains, so the FMA latency never paces the stream (K is a multiple of 64) */
        __m256 a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
#if PREFETCH_BYTES_AVX2_FLOAT > 0
            if (is_bf16)
                _mm_prefetch((const char *)((const uint16_t *)w + k) + PREFETCH_BYTES_AVX2_FLOAT, PREFETCH_HINT);
            else /* fp32: this step's two lines (as the AVX-512 loop's four) */
                for (int line = 0; line < 128; line += 64)
                    _mm_prefetch((const char *)((const float *)w + k) + PREFETCH_BYTES_AVX2_FLOAT + line, PREFETCH_HINT);
#endif
            acc[0] = _mm256_fmadd_ps(load8(w, is_bf16, k), _mm256_loadu_ps(x[0] + k), acc[0]);
            a1 = _mm256_fmadd_ps(load8(w, is_bf16, k + 8), _mm256_loadu_ps(x[0] + k + 8), a1);
            a2 = _mm256_fmadd_ps(load8(w, is_bf16, k + 16), _mm256_loadu_ps(x[0] + k + 16), a2);
            a3 = _mm256_fmadd_ps(load8(w, is_bf16, k + 24), _mm256_loadu_ps(x[0] + k + 24), a3);
        }
        out[0] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], a1), _mm256_add_ps(a2, a3)));
        return;
    }
    for (int64_t k = 0; k < K; k += 8) {
        __m256 wv = load8(w, is_bf16, k);
        for (int r = 0; r < mm; r++)
            acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[r] + k), acc[r]);
    }
    for (int r = 0; r < mm; r++)
        out[r] = hsum8(acc[r]);
}
/* One activation row against a work item's float weight rows, FLOAT_STREAMS rows at a time from as many parts
 * of the item (rows i, i + q, i + 2q, ...), so a core reads that many streams at once: on a Zen 2 guest a
 * plain read loop drew 10.4 GB/s from one stream and 18 from four. Two chains a row. */
#define FLOAT_STREAMS 4
INLINE void avx2_rows_streams(const void *w, int is_bf16, const float *x, int64_t K, int64_t n_rows, float *out) {
    int64_t q = n_rows / FLOAT_STREAMS;
    for (int64_t i = 0; i < q; i++) {
        const void *ws[FLOAT_STREAMS];
        __m256 acc[2 * FLOAT_STREAMS];
        for (int s = 0; s < FLOAT_STREAMS; s++) {
            int64_t offset = (s * q + i) * K;
            ws[s] = is_bf16 ? (const void *)((const uint16_t *)w + offset) : (const void *)((const float *)w + offset);
            acc[2 * s] = acc[2 * s + 1] = _mm256_setzero_ps();
        }
        for (int64_t k = 0; k < K; k += 16) {
            __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
#pragma GCC unroll 4
            for (int s = 0; s < FLOAT_STREAMS; s++) {
                acc[2 * s] = _mm256_fmadd_ps(load8(ws[s], is_bf16, k), x0, acc[2 * s]);
                acc[2 * s + 1] = _mm256_fmadd_ps(load8(ws[s], is_bf16, k + 8), x1, acc[2 * s + 1]);
            }
        }
        for (int s = 0; s < FLOAT_STREAMS; s++)
            out[s * q + i] = hsum8(_mm256_add_ps(acc[2 * s], acc[2 * s + 1]));
    }
}
#endif

#if defined(HAVE_AVX512)
#include "dequant_avx512.h" /* bf16x16, and int4's group scaling */

/* 16 fp32 weights, or 16 bf16 ones widened (is_bf16 a constant where it is inlined). */
INLINE __m512 load16(const char *w, int is_bf16, int64_t k) {
    return is_bf16 ? bf16x16((const uint16_t *)w + k) : _mm512_loadu_ps((const float *)w + k);
}
#endif

/* ---- fp32 ---- */
#if defined(HAVE_AVX512)
/* fp32 weights, or bf16 ones widened where the CPU has no bf16 dot product (is_bf16 a constant where it is
 * inlined), against fp32 activations. One row: four chains, so the FMA latency never paces the stream, and
 * every line of the stream prefetched: on an Intel Xeon guest the hardware prefetchers alone left whole-model
 * fp32 decode at 10-13.5 GB/s, 14.4-14.8 with this (one thread; 21.0-21.4 against 22.2-24.2 GB/s on two). The
 * widened bf16 loop replaced the 256-bit one there, which read 8.4 GB/s on one thread. */
INLINE void avx512_float_dots(const char *w, int is_bf16, const acts *a, const int64_t *rows, int mm, int64_t K,
                              float *out) {
    __m512 acc[MB];
    const float *x[MB];
    for (int r = 0; r < mm; r++) {
        acc[r] = _mm512_setzero_ps();
        x[r] = a->f32 + rows[r] * a->ld;
    }
    if (mm == 1) {
        int64_t step_bytes = is_bf16 ? 128 : 256; /* the lines of one step of 64 weights */
        __m512 a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 64) {
            const char *at = w + k * (is_bf16 ? 2 : 4);
            for (int64_t line = 0; line < step_bytes; line += 64) {
                if (!is_bf16) {
                    if (PREFETCH_BYTES_F32 > 0)
                        _mm_prefetch(at + PREFETCH_BYTES_F32 + line, PREFETCH_HINT_F32);
                } else if (SW_PREFETCH)
                    _mm_prefetch(at + 2 * PREFETCH_BYTES + line, PREFETCH_HINT_BF16W);
            }
            acc[0] = _mm512_fmadd_ps(load16(w, is_bf16, k), _mm512_loadu_ps(x[0] + k), acc[0]);
            a1 = _mm512_fmadd_ps(load16(w, is_bf16, k + 16), _mm512_loadu_ps(x[0] + k + 16), a1);
            a2 = _mm512_fmadd_ps(load16(w, is_bf16, k + 32), _mm512_loadu_ps(x[0] + k + 32), a2);
            a3 = _mm512_fmadd_ps(load16(w, is_bf16, k + 48), _mm512_loadu_ps(x[0] + k + 48), a3);
        }
        out[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], a1), _mm512_add_ps(a2, a3)));
        return;
    }
    for (int64_t k = 0; k < K; k += 16) {
        __m512 wv = load16(w, is_bf16, k);
        for (int r = 0; r < mm; r++)
            acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x[r] + k), acc[r]);
    }
    for (int r = 0; r < mm; r++)
        out[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

#if defined(HAVE_AVX512)
/* One activation row against fp32 weight rows n and m at once: avx512_float_dots' one-row sums for each, bit for
 * bit (the same four chains), from two streams (hs_rows_item). */
#define HAVE_F32_PAIR 1
/* Each stream's prefetches run ahead by the same time as the one-stream loop's at half its distance in bytes
 * (two streams take turns). A Zen 4 guest (one process alternating builds, 1.1 GB of Qwen3-shape experts, one
 * thread): pairs at 4 KB 7-10% slower than one stream, at 2 KB 8-10% faster, at 8 KB 13% slower. Untimed
 * halved on Intel's cores, whose pairs gained at the one-stream distance. */
#if AMD_AVX512
#define PREFETCH_F32_PAIR_DEFAULT (PREFETCH_BYTES_F32 / 2)
#else
#define PREFETCH_F32_PAIR_DEFAULT PREFETCH_BYTES_F32
#endif
#ifndef PREFETCH_BYTES_F32_PAIR
#define PREFETCH_BYTES_F32_PAIR PREFETCH_F32_PAIR_DEFAULT
#endif
INLINE void f32_row_pair(const float *wa, const float *wb, const float *x, int64_t K, float *out_a, float *out_b) {
    __m512 a[4], b[4];
    for (int c = 0; c < 4; c++)
        a[c] = b[c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 64) {
        for (int64_t line = 0; line < 256; line += 64)
            if (PREFETCH_BYTES_F32_PAIR > 0) {
                _mm_prefetch((const char *)(wa + k) + PREFETCH_BYTES_F32_PAIR + line, PREFETCH_HINT_F32);
                _mm_prefetch((const char *)(wb + k) + PREFETCH_BYTES_F32_PAIR + line, PREFETCH_HINT_F32);
            }
        for (int c = 0; c < 4; c++) {
            __m512 xv = _mm512_loadu_ps(x + k + 16 * c);
            a[c] = _mm512_fmadd_ps(_mm512_loadu_ps(wa + k + 16 * c), xv, a[c]);
            b[c] = _mm512_fmadd_ps(_mm512_loadu_ps(wb + k + 16 * c), xv, b[c]);
        }
    }
    *out_a = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
    *out_b = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(b[0], b[1]), _mm512_add_ps(b[2], b[3])));
}
#endif

INLINE void f32_block(const float *w, const acts *a, const int64_t *rows, int mm, int64_t K, float *out) {
#if defined(HAVE_AVX512)
    avx512_float_dots((const char *)w, 0, a, rows, mm, K, out);
#elif defined(HAVE_AVX2)
    avx2_dots(w, 0, a, rows, mm, K, out);
#elif defined(HAVE_NEON)
    neon_dots(w, 0, a, rows, mm, K, out);
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
            for (int line = 0; line < 128; line += 64) /* both lines of this step (one left bf16 at 10.5 GB/s) */
                if (SW_PREFETCH)
                    _mm_prefetch((const char *)(w + k) + 2 * PREFETCH_BYTES + line, PREFETCH_HINT);
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
#elif defined(HAVE_AVX512) /* without its bf16 dot product (Skylake-SP to Ice Lake, guests that hide it) */
    avx512_float_dots((const char *)w, 1, a, rows, mm, K, out);
#elif defined(HAVE_AVX2)
    avx2_dots(w, 1, a, rows, mm, K, out);
#elif defined(HAVE_NEON)
    neon_dots(w, 1, a, rows, mm, K, out);
#else
    for (int r = 0; r < mm; r++)
        out[r] = portable_dot(w, 1, a->f32 + rows[r] * a->ld, K);
#endif
}

#if defined(__AVX512BF16__)
/* One activation row against weight rows n and m at once: bf16_block's one-row sums for each, bit for bit (the
 * same two chains), from two streams (hs_rows_item). */
#define HAVE_BF16_PAIR 1
INLINE void bf16_row_pair(const uint16_t *wa, const uint16_t *wb, const uint16_t *x, int64_t K, float *out_a,
                          float *out_b) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    for (int64_t k = 0; k < K; k += 64) {
        for (int line = 0; line < 128; line += 64)
            if (SW_PREFETCH) {
                _mm_prefetch((const char *)(wa + k) + 2 * PREFETCH_BYTES + line, PREFETCH_HINT);
                _mm_prefetch((const char *)(wb + k) + 2 * PREFETCH_BYTES + line, PREFETCH_HINT);
            }
        __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + k), x1 = (__m512bh)_mm512_loadu_si512(x + k + 32);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(wa + k), x0);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(wa + k + 32), x1);
        b0 = _mm512_dpbf16_ps(b0, (__m512bh)_mm512_loadu_si512(wb + k), x0);
        b1 = _mm512_dpbf16_ps(b1, (__m512bh)_mm512_loadu_si512(wb + k + 32), x1);
    }
    *out_a = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    *out_b = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
}
#endif
