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
/* AVX2 with FMA (Haswell on, Zen 1 on: most servers and laptops without AVX-512) has 256-bit loops below; an
 * AVX-512 build without VNNI takes them too for int8 and int4 (one without BF16 widens bf16 at 512 bits).
 * AVX-VNNI (Alder Lake, Zen 5) adds the 256-bit vpdpbusd. */
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#endif
#if defined(HAVE_AVX2) && defined(__AVXVNNI__)
#define HAVE_AVXVNNI 1
#endif

#define INLINE static inline __attribute__((always_inline))
/* How far ahead the lighter streams (int4) prefetch: a DRAM latency's worth of bytes. At 1 KB int4 streamed
 * 55-75% of the read probe on one thread (Zen 5), at 4 KB 83-93%; on an Intel Xeon guest 2 KB was 10% slower
 * and 8 KB no faster. The heavier streams (one-row fp32 and bf16, int8 tiles) prefetch twice as far, every line
 * they read: on a second Xeon guest the one-row bf16 loop, prefetching one of its two lines a step, read
 * 10.5 GB/s on one thread against fp32's 14.5; both lines: 14.5-15.3 (int8 tiles: +4-6%).
 * -DPREFETCH_BYTES=... in HINTSERVE_KERNEL_FLAGS tries another distance. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0
#endif
/* AMD's Zen 3 and later (GCC 12 calls a Zen 4 znver3, with AVX-512 or with it hidden by a hypervisor), and
 * those of them with AVX-512, whose loops the defaults below tune apart. */
#if defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
#define AMD_ZEN3_ON 1
#else
#define AMD_ZEN3_ON 0
#endif
#if defined(__AVX512F__) && AMD_ZEN3_ON
#define AMD_AVX512 1
#else
#define AMD_AVX512 0
#endif
/* Zen 5 apart from Zen 4: GCC 14 names it; GCC 12 calls both znver3, and only Zen 5 has AVX-VNNI. */
#if defined(__znver5__) || (AMD_AVX512 && defined(__AVXVNNI__))
#define AMD_ZEN5_ON 1
#else
#define AMD_ZEN5_ON 0
#endif
/* The 512-bit one-row fp32 loop on AMD's AVX-512 cores: half the distance, into L2. A Zen 4 guest's one-row
 * fp32 expert streamed 48-64% of the read probe on one thread at 8 KB into L1, 49-79% at 4 KB into L2, and
 * 43-72% against 84-96% on two (alternating builds, three rounds; the LM head alike). bf16 was mixed there
 * (its LM head better, its expert worse on two threads): unchanged. */
#if AMD_AVX512
#define PREFETCH_F32_DEFAULT 4096
#define PREFETCH_HINT_F32_DEFAULT _MM_HINT_T1
#else
#define PREFETCH_F32_DEFAULT (2 * PREFETCH_BYTES)
#define PREFETCH_HINT_F32_DEFAULT PREFETCH_HINT
#endif
#ifndef PREFETCH_BYTES_F32
#define PREFETCH_BYTES_F32 PREFETCH_F32_DEFAULT
#endif
#ifndef PREFETCH_HINT_F32
#define PREFETCH_HINT_F32 PREFETCH_HINT_F32_DEFAULT
#endif
/* The integer tiles prefetch into L2 instead, as kernels.c's loops do: into L1 their prefetches queue on its
 * few miss buffers (Xeon guest, one row, huge pages, alternating builds: int4 +5-13%, int8 a few %; the float
 * loops were tuned with T0 and not re-timed). */
#ifndef PREFETCH_HINT_INT
#define PREFETCH_HINT_INT _MM_HINT_T1
#endif
/* The widened bf16 loop of AVX-512 builds without a bf16 dot product prefetches into L2: on an Intel Xeon guest
 * (AVX-512 VNNI, bf16 and AMX hidden; one process alternating builds, three rounds) its one-row matrices read
 * 67-84% of the read probe prefetched into L1 and 76-92% into L2. */
#ifndef PREFETCH_HINT_BF16W
#define PREFETCH_HINT_BF16W _MM_HINT_T1
#endif
/* The 256-bit one-row float loops do not prefetch: on a Zen 3 guest (AVX2 only; one process alternating
 * builds, 256 MB of weights, one thread) fp32 streamed 13.2 GB/s without against 11.3 at 8 KB ahead, bf16
 * 10.6 against 9.5 (at 512 B: 11.1 and 11.3), its hardware prefetchers alone doing better. Untimed on an
 * Intel CPU without AVX-512; -DPREFETCH_BYTES_AVX2_FLOAT=8192 in HINTSERVE_KERNEL_FLAGS tries one there. */
#ifndef PREFETCH_BYTES_AVX2_FLOAT
#define PREFETCH_BYTES_AVX2_FLOAT 0
#endif
/* Whether the one-row bf16, int8 and int4 loops prefetch. A Zen 4 guest's hardware prefetchers alone read
 * one stream at 30 GB/s on one thread, and at 21-24 with a software prefetch 2-8 KB ahead. There (one process
 * alternating builds, three rounds each) bf16 ran 5-25% faster per matrix without it, int8 5-25% faster at
 * one row but 25-50% slower at 16 rows (so its tiles keep it for two rows and more); fp32 10-20% slower
 * (keeps its own, above). int4 came out even on one guest and, on a later one, 5-16% faster without in 8 of
 * 10 matrix x thread cases (four rounds; prefetching 8-64 KB ahead, or a group's lines at once, into L1 or
 * L2, was slower still in a standalone loop). -DSW_PREFETCH=1 there brings them back. A Zen 3 guest (AVX2
 * only) keeps them: without, its one-row int8, int4 and bf16 experts and LM heads ran 0.88-1.07 times as fast
 * (`bench kernel-flags`, six rounds, one and two threads; bench/results/kernel_flags_zen3_sw_prefetch.json). */
#if AMD_AVX512
#define SW_PREFETCH_DEFAULT 0
#else
#define SW_PREFETCH_DEFAULT 1
#endif
#ifndef SW_PREFETCH
#define SW_PREFETCH SW_PREFETCH_DEFAULT
#endif
/* Activation rows from which the int4 tiles prefetch (below SW_PREFETCH's one row). Its tiles are one
 * stream, scales among the nibbles; on a Zen 4 guest two rows ran a third faster without (a tile read once,
 * quickly, is what the hardware prefetchers follow best), three to sixteen 5-40% slower (two rounds). */
#ifndef Q4_PREFETCH_ROWS
#define Q4_PREFETCH_ROWS 3
#endif
/* One activation row over int4 tiles prefetches every line non-temporally on AMD's AVX-512 cores, where the
 * loops otherwise leave the stream to the hardware prefetchers (SW_PREFETCH): a decode step streams tens of MB
 * of experts a layer, which flushed the caches of the Python, torch and small native calls between the
 * matrices. On a Zen 4 guest a small call after a 40 MB plain read loop took 37-40 us, after the same loop
 * prefetching NTA 13-14 (both loops 30-31 GB/s). Whole-model int4 decode there, one process alternating
 * builds, 14 rounds, the same tokens: +1.8% on one thread, +3.5% on two, although a layer's experts alone
 * ran 2-4% slower (1 KB ahead; 2 KB: +2.0% and -4.4%, 4 KB: -12% alone). bf16 (-11%) and int8 (-4%)
 * decoded slower that way and keep their loops. A Zen 5 guest's full-width cores want it further ahead: 4 KB
 * there read 81-98% of the probe per one-row matrix against 75-88% at 1 KB (8 KB: 78-89%, none: 76-100%;
 * three rounds alternating builds), and whole-model int4 decode ran 10% faster on one thread (median of three;
 * two threads even). -DQ4_NTA=0 turns it off, -DQ4_NTA_BYTES= sets the distance. */
#if AMD_AVX512
#define Q4_NTA_DEFAULT 1
#else
#define Q4_NTA_DEFAULT 0
#endif
#ifndef Q4_NTA
#define Q4_NTA Q4_NTA_DEFAULT
#endif
#ifndef Q4_NTA_BYTES
#define Q4_NTA_BYTES (AMD_ZEN5_ON ? 4096 : 1024)
#endif
#define SPLIT_MAX 4 /* activation rows up to which each row's integer dot products run on two chains */


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
/* 16 bf16 widened to fp32 (exact, as bf16x8). */
INLINE __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 fp32 weights, or 16 bf16 ones widened (is_bf16 a constant where it is inlined). */
INLINE __m512 load16(const char *w, int is_bf16, int64_t k) {
    return is_bf16 ? bf16x16((const uint16_t *)w + k) : _mm512_loadu_ps((const float *)w + k);
}
#endif

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

/* ---- fp32 and bf16 at two or more activation rows: a tile of NT weight rows x up to MT activation rows ----
 * One row of weights against MB rows (above) spends a load of activations on every FMA, and those rows (8 KB
 * each at K = 2048) come from L2: prefill ran at a fifth of the FMA peak. NT x MT accumulators in registers
 * load NT + MT vectors per NT * MT FMAs, and hs_rows_block walks the activation rows outer and a work item's
 * weight rows inner, so an item's weights stay in L2 while each block of activations is read once. */
#define NT 4
#define MT 6
/* Bytes ahead (in whole tiles, at least one) a fp32 tile prefetches its weights, 0: off. Without it the tiles
 * streamed a third of the one-row loop's rate from DRAM on a Zen 4 guest (two rows of an 8 MB LM head 846 us
 * against one row's 265): four rows of a tile 1-8 KB apart were more than the hardware prefetchers followed. */
#ifndef FLOAT_TILE_PREFETCH
#define FLOAT_TILE_PREFETCH 12288
#endif

/* The bytes from a tile to the one it prefetches: FLOAT_TILE_PREFETCH rounded up to whole tiles. */
static inline int64_t tile_prefetch_ahead(int64_t tile_bytes) {
    return (FLOAT_TILE_PREFETCH + tile_bytes - 1) / tile_bytes * tile_bytes;
}

/* Calls tile(c) with c the constant equal to mm (1..MT), so the tile's accumulators stay in registers. */
#define TILE_SWITCH(mm, tile)                                                                                    \
    switch (mm) {                                                                                              \
    case 1: tile(1); break;                                                                                    \
    case 2: tile(2); break;                                                                                    \
    case 3: tile(3); break;                                                                                    \
    case 4: tile(4); break;                                                                                    \
    case 5: tile(5); break;                                                                                    \
    default: tile(6); break;                                                                                   \
    }

#if defined(HAVE_AVX512)
/* fp32 weights, or bf16 ones widened where the CPU has no bf16 dot product (is_bf16 a constant). */
INLINE void float_tile(const char *w, int is_bf16, int64_t K, const float *const *x, int mm, float out[NT][MT]) {
    int64_t row_bytes = K * (is_bf16 ? 2 : 4);
    const char *ahead = w + tile_prefetch_ahead(NT * row_bytes);
    __m512 acc[NT][MT];
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < mm; r++)
            acc[i][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 wv[NT];
        if (FLOAT_TILE_PREFETCH && (!is_bf16 || k % 32 == 0)) /* a later tile's same lines (tiles follow on) */
            for (int i = 0; i < NT; i++)
                _mm_prefetch(ahead + i * row_bytes + k * (is_bf16 ? 2 : 4), _MM_HINT_T1);
        for (int i = 0; i < NT; i++)
            wv[i] = load16(w + i * row_bytes, is_bf16, k);
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
    const char *ahead = (const char *)w + tile_prefetch_ahead(NT * K * 2);
    __m512 acc[NT][MT];
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < mm; r++)
            acc[i][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv[NT];
        if (FLOAT_TILE_PREFETCH) /* as float_tile */
            for (int i = 0; i < NT; i++)
                _mm_prefetch(ahead + (i * K + k) * 2, _MM_HINT_T1);
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

/* The float tiles at 256 bits, where the build has no 512-bit tile for the format: 16 vector registers hold NT x 3
 * accumulators, so the tile's activation rows run 3 at a time, the NT weight rows (32 KB at K = 2048 fp32)
 * read again from L1 or L2 for each 3 (AVX2 builds; AVX-512 ones widen bf16 in float_tile). */
#if defined(HAVE_AVX2) && !defined(HAVE_AVX512)
#define AVX2_TILES 1
INLINE void avx2_tile3(const char *w, int is_bf16, int64_t K, const float *const *x, int rr, float out[NT][MT],
                       int prefetch) {
    int64_t row_bytes = K * (is_bf16 ? 2 : 4);
    const char *ahead = w + tile_prefetch_ahead(NT * row_bytes);
    __m256 acc[NT][3];
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < rr; r++)
            acc[i][r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        if (FLOAT_TILE_PREFETCH && prefetch && k % (is_bf16 ? 32 : 16) == 0) /* as float_tile, once a line */
            for (int i = 0; i < NT; i++)
                _mm_prefetch(ahead + i * row_bytes + k * (is_bf16 ? 2 : 4), _MM_HINT_T1);
        /* The 3 activation vectors held and each weight row's loaded in turn: 12 + 3 + 1 registers (holding
         * the 4 weight vectors instead took 17, and an accumulator's store-load chain paced the loop). */
        __m256 xv[3];
        for (int r = 0; r < rr; r++)
            xv[r] = _mm256_loadu_ps(x[r] + k);
        for (int i = 0; i < NT; i++) {
            __m256 wv = load8(w + i * row_bytes, is_bf16, k);
            /* In a register: GCC folded an fp32 row's load into each of its 3 FMAs (12 loads a step, not 4),
             * which on a Zen 3 guest ran the tile 10-13% slower (standalone, tiles in L2 or from memory). */
            __asm__("" : "+x"(wv));
            for (int r = 0; r < rr; r++)
                acc[i][r] = _mm256_fmadd_ps(wv, xv[r], acc[i][r]);
        }
    }
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < rr; r++)
            out[i][r] = hsum8(acc[i][r]);
}

INLINE void avx2_tile(const char *w, int is_bf16, int64_t K, const float *const *x, int mm, float out[NT][MT]) {
    for (int r0 = 0; r0 < mm; r0 += 3) {
        float part[NT][MT];
        int rr = mm - r0 < 3 ? mm - r0 : 3;
        switch (rr) {
        case 1: avx2_tile3(w, is_bf16, K, x + r0, 1, part, r0 == 0); break;
        case 2: avx2_tile3(w, is_bf16, K, x + r0, 2, part, r0 == 0); break;
        default: avx2_tile3(w, is_bf16, K, x + r0, 3, part, r0 == 0); break;
        }
        for (int i = 0; i < NT; i++)
            for (int r = 0; r < rr; r++)
                out[i][r0 + r] = part[i][r];
    }
}
#endif

/* A tile's results to y (rows m.., columns n..). */
INLINE void store_float_tile(float *y, int64_t ldy, int64_t m, int64_t n, int mm, float out[NT][MT],
                             const float *bias) {
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < mm; r++)
            y[(m + r) * ldy + n + i] = out[i][r] + (bias ? bias[n + i] : 0.0f);
}

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
#if defined(__AVX512BF16__)
        if (!bf16) /* bf16 has its vdpbf16ps tile below; without it, bf16 is widened here */
#endif
            for (; n + NT <= n1; n += NT) {
                const char *w = (const char *)W->w + n * K * (bf16 ? 2 : 4);
#define F32_TILE(c) float_tile(w, 0, K, xf, c, out)
#define BF16W_TILE(c) float_tile(w, 1, K, xf, c, out)
                if (bf16) {
                    TILE_SWITCH(mm, BF16W_TILE)
                } else {
                    TILE_SWITCH(mm, F32_TILE)
                }
                store_float_tile(y, ldy, m, n, mm, out, W->bias);
            }
#endif
#if defined(__AVX512BF16__)
        if (bf16)
            for (; n + NT <= n1; n += NT) {
                const uint16_t *w = (const uint16_t *)W->w + n * K;
#define BF16_TILE(c) bf16_tile(w, K, xh, c, out)
                TILE_SWITCH(mm, BF16_TILE)
                store_float_tile(y, ldy, m, n, mm, out, W->bias);
            }
#endif
#if defined(AVX2_TILES)
        for (; n + NT <= n1; n += NT) {
            if (bf16)
                avx2_tile((const char *)W->w + n * K * 2, 1, K, xf, mm, out);
            else
                avx2_tile((const char *)W->w + n * K * 4, 0, K, xf, mm, out);
            store_float_tile(y, ldy, m, n, mm, out, W->bias);
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
 * int8 tile: [K/4][TILE][4] bytes (w + 128); int4 tile: group after group, [g/8][TILE][4] bytes, byte (i, t)
 * holding row i's inputs t (low nibble) and 4 + t (high) of each 8, then the group's (scale, zero) as bf16
 * [2][TILE] (q4_group_bytes). One vpdpbusd
 * multiplies 4 inputs of TILE rows by the same 4 activations (broadcast), so each group's scales apply to a
 * vector of rows and nothing is summed across lanes. */

#if defined(HAVE_VNNI512)
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
            for (int line = 0; line < 128; line += 64) /* this step's two lines, 8 KB on (as one-row fp32) */
                if (SW_PREFETCH || mm > 1)
                    _mm_prefetch((const char *)(w + k * TILE) + 2 * PREFETCH_BYTES + line, PREFETCH_HINT_INT);
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

/* One activation row against two whole int8 tiles at once, block by block: q8_tile's sums for each, bit for
 * bit, from two streams (hs_rows_item). */
#define HAVE_Q8_PAIR 1
INLINE void q8_tile_pair(const uint8_t *wa, const uint8_t *wb, const float *ws_a, const float *ws_b, const acts *a,
                         int64_t row, int64_t K, float *ya, float *yb, const float *bias_a, const float *bias_b) {
    int64_t blocks = K / QB;
    const int8_t *x = a->q + row * K;
    __m512 acc_a = _mm512_setzero_ps(), acc_b = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i dot_a = _mm512_setzero_si512(), odd_a = dot_a, dot_b = dot_a, odd_b = dot_a;
        for (int64_t k = b * QB; k < (b + 1) * QB; k += 8) {
            if (SW_PREFETCH)
                for (int line = 0; line < 128; line += 64) {
                    _mm_prefetch((const char *)(wa + k * TILE) + 2 * PREFETCH_BYTES + line, PREFETCH_HINT_INT);
                    _mm_prefetch((const char *)(wb + k * TILE) + 2 * PREFETCH_BYTES + line, PREFETCH_HINT_INT);
                }
            __m512i xe = bcast4(x + k), xo = bcast4(x + k + 4);
            dot_a = _mm512_dpbusd_epi32(dot_a, _mm512_loadu_si512(wa + k * TILE), xe);
            odd_a = _mm512_dpbusd_epi32(odd_a, _mm512_loadu_si512(wa + (k + 4) * TILE), xo);
            dot_b = _mm512_dpbusd_epi32(dot_b, _mm512_loadu_si512(wb + k * TILE), xe);
            odd_b = _mm512_dpbusd_epi32(odd_b, _mm512_loadu_si512(wb + (k + 4) * TILE), xo);
        }
        __m512 d = _mm512_set1_ps(a->d[row * blocks + b]);
        acc_a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dot_a, odd_a)), d, acc_a);
        acc_b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dot_b, odd_b)), d, acc_b);
    }
    __m512 corr = _mm512_set1_ps(a->corr[row]);
    _mm512_storeu_ps(ya, _mm512_fmadd_ps(_mm512_loadu_ps(ws_a), _mm512_sub_ps(acc_a, corr),
                                         bias_a ? _mm512_loadu_ps(bias_a) : _mm512_setzero_ps()));
    _mm512_storeu_ps(yb, _mm512_fmadd_ps(_mm512_loadu_ps(ws_b), _mm512_sub_ps(acc_b, corr),
                                         bias_b ? _mm512_loadu_ps(bias_b) : _mm512_setzero_ps()));
}

/* A group's scales, and its zeros less 8 scales (the offset's and the zero's share), from after its nibbles. */
INLINE void q4_scales(const uint8_t *block, int64_t g, __m512 *scale, __m512 *zero8) {
    const uint16_t *sz = (const uint16_t *)(block + g / 2 * TILE);
    *scale = bf16x16(sz);
    *zero8 = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), *scale, bf16x16(sz + TILE));
}

/* acc plus one activation row's integer sums over a group, dequantized (the row's block scale d and its scaled
 * sum dsum): q4_tile and q4_tile_pair the same way, so a pair's sums are the single tile's bit for bit. */
INLINE __m512 q4_add_group(__m512 acc, __m512i dot, __m512 scale, __m512 zero8, float d, float dsum) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(d)), acc);
    return _mm512_fmadd_ps(zero8, _mm512_set1_ps(dsum), acc);
}

INLINE void q4_tile(const uint8_t *w, int64_t g, const acts *a, const int64_t *rows, int mm, int64_t K, float *y,
                    int64_t ldy, const float *bias, int valid) {
    int64_t G = K / g, gb = q4_group_bytes(g);
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[MB];
    const int8_t *x[MB];
    for (int r = 0; r < mm; r++) {
        acc[r] = _mm512_setzero_ps();
        x[r] = a->q + rows[r] * K;
    }
    for (int64_t j = 0; j < G; j++) {
        const uint8_t *block = w + j * gb; /* the group's nibbles, then its scales and zeros */
        /* wk + k / 2 * TILE: the nibbles of input k (of the whole row) in this group's block. Indexed by k as
         * x is: with 8 rows a second offset per row ran out of registers (16 rows a fifth slower). */
        const uint8_t *wk = block - j * g / 2 * TILE;
        if (SW_PREFETCH || mm >= Q4_PREFETCH_ROWS) /* every line of the group, its scales' too */
            for (int64_t line = 0; line < gb; line += 64)
                _mm_prefetch((const char *)block + PREFETCH_BYTES + line, PREFETCH_HINT_INT);
        else if (Q4_NTA && mm == 1)
            for (int64_t line = 0; line < gb; line += 64)
                _mm_prefetch((const char *)block + Q4_NTA_BYTES + line, _MM_HINT_NTA);
        __m512i dot[MB], hid[MB]; /* low and high nibbles on two chains while few rows run (q8_tile) */
        for (int r = 0; r < mm; r++)
            dot[r] = hid[r] = _mm512_setzero_si512();
        for (int64_t k = j * g; k < (j + 1) * g; k += 8) {
            __m512i p = _mm512_loadu_si512(wk + k / 2 * TILE);
            /* On two chains the high nibbles stay in place (16 times their value, exact in i32) and one shift a
             * group scales the sum back: a vector op fewer per 64 bytes. */
            __m512i lo = _mm512_and_si512(p, low);
            __m512i hi = mm <= SPLIT_MAX ? _mm512_andnot_si512(low, p) : _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
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
                dot[r] = _mm512_add_epi32(dot[r], _mm512_srai_epi32(hid[r], 4));
        __m512 scale, zero8;
        q4_scales(block, g, &scale, &zero8);
        for (int r = 0; r < mm; r++) {
            int64_t at = rows[r] * G + j;
            acc[r] = q4_add_group(acc[r], dot[r], scale, zero8, a->d[at], a->dsum[at]);
        }
    }
    __mmask16 keep = (__mmask16)((1u << valid) - 1);
    __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int r = 0; r < mm; r++)
        _mm512_mask_storeu_ps(y + r * ldy, keep, _mm512_add_ps(acc[r], add));
}

/* One activation row against two whole int4 tiles at once, group by group: q4_tile's sums for each, bit for
 * bit (the same chains in the same order), from two streams (hs_rows_item says why). */
#define HAVE_Q4_PAIR 1
INLINE void q4_tile_pair(const uint8_t *wa, const uint8_t *wb, int64_t g, const acts *a, int64_t row, int64_t K,
                         float *ya, float *yb, const float *bias_a, const float *bias_b) {
    int64_t G = K / g, gb = q4_group_bytes(g);
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int8_t *x = a->q + row * K;
    __m512 acc_a = _mm512_setzero_ps(), acc_b = _mm512_setzero_ps();
    for (int64_t j = 0; j < G; j++) {
        const uint8_t *block_a = wa + j * gb, *block_b = wb + j * gb;
        if (SW_PREFETCH)
            for (int64_t line = 0; line < gb; line += 64) {
                _mm_prefetch((const char *)block_a + PREFETCH_BYTES + line, PREFETCH_HINT_INT);
                _mm_prefetch((const char *)block_b + PREFETCH_BYTES + line, PREFETCH_HINT_INT);
            }
        else if (Q4_NTA)
            for (int64_t line = 0; line < gb; line += 64) {
                _mm_prefetch((const char *)block_a + Q4_NTA_BYTES + line, _MM_HINT_NTA);
                _mm_prefetch((const char *)block_b + Q4_NTA_BYTES + line, _MM_HINT_NTA);
            }
        __m512i dot_a = _mm512_setzero_si512(), hid_a = dot_a, dot_b = dot_a, hid_b = dot_a;
        for (int64_t k = 0; k < g; k += 8) {
            __m512i pa = _mm512_loadu_si512(block_a + k / 2 * TILE), pb = _mm512_loadu_si512(block_b + k / 2 * TILE);
            __m512i xe = bcast4(x + j * g + k), xo = bcast4(x + j * g + k + 4);
            dot_a = _mm512_dpbusd_epi32(dot_a, _mm512_and_si512(pa, low), xe);
            hid_a = _mm512_dpbusd_epi32(hid_a, _mm512_andnot_si512(low, pa), xo);
            dot_b = _mm512_dpbusd_epi32(dot_b, _mm512_and_si512(pb, low), xe);
            hid_b = _mm512_dpbusd_epi32(hid_b, _mm512_andnot_si512(low, pb), xo);
        }
        dot_a = _mm512_add_epi32(dot_a, _mm512_srai_epi32(hid_a, 4));
        dot_b = _mm512_add_epi32(dot_b, _mm512_srai_epi32(hid_b, 4));
        __m512 scale_a, zero8_a, scale_b, zero8_b;
        q4_scales(block_a, g, &scale_a, &zero8_a);
        q4_scales(block_b, g, &scale_b, &zero8_b);
        float d = a->d[row * G + j], dsum = a->dsum[row * G + j];
        acc_a = q4_add_group(acc_a, dot_a, scale_a, zero8_a, d, dsum);
        acc_b = q4_add_group(acc_b, dot_b, scale_b, zero8_b, d, dsum);
    }
    _mm512_storeu_ps(ya, _mm512_add_ps(acc_a, bias_a ? _mm512_loadu_ps(bias_a) : _mm512_setzero_ps()));
    _mm512_storeu_ps(yb, _mm512_add_ps(acc_b, bias_b ? _mm512_loadu_ps(bias_b) : _mm512_setzero_ps()));
}
#elif defined(HAVE_AVX2)
/* AVX2: a tile's 16 rows are two 256-bit vectors of 8 (rows 0-7, 8-15), 4 bytes a row, each lane's sum one
 * row's. The weights of a block (1 KB int8, half that int4) are read from memory for the first activation row
 * and from L1 for the others: 16 vector registers hold no accumulators for 8 rows x 16 weight rows. */
INLINE __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* One activation row's int8 tile visits its blocks from INT_STREAMS parts of the tile in turn, so a core reads
 * that many streams at once rather than one: on a Zen 2 guest (one process alternating builds, one row) int8
 * streamed 0.57-0.63 of the read probe per expert and 0.60-0.69 per LM head in one stream, 0.70-0.74 and
 * 0.80-0.90 in four (a plain read loop there: 10.4 GB/s in one stream, 18 in four). 16 rows, which read
 * each block from L1 after the first row, ran 5% slower in that order and keep theirs; int4, whose tiles are
 * half as long, gained nothing. The 512-bit loops keep one stream: on a Zen 4 guest (the same A/B, three
 * rounds) four streams made one-row int8 and int4 10-30% slower per expert and fp32 slower too, their
 * software prefetch a fixed distance down one stream being what that core streams best with. AMD's Zen 3 and
 * later keep one stream in these loops too: on a Zen 4 guest whose AVX-512 a hypervisor hides (alternating
 * builds, two rounds, probe 29-32 GB/s on one thread), one-row int8 streamed 18-25 GB/s in one stream against
 * 11-15 in four, 24-34 against 18-25 on two threads; a Zen 3 guest had been even within its noise. */
#ifndef INT_STREAMS
#if AMD_ZEN3_ON
#define INT_STREAMS 1
#else
#define INT_STREAMS 4
#endif
#endif
INLINE int64_t stream_order(int64_t i, int64_t blocks) {
    if (blocks % INT_STREAMS)
        return i;
    return (i % INT_STREAMS) * (blocks / INT_STREAMS) + i / INT_STREAMS;
}

#if defined(HAVE_AVXVNNI)
/* int8: one activation row's integer dot products with a tile's rows over inputs [k0, k1), rows 0-7 in *lo
 * and 8-15 in *hi: the portable loop's integer sums exactly. */
INLINE void q8_dots(const uint8_t *w, const int8_t *x, int64_t k0, int64_t k1, __m256i *lo, __m256i *hi) {
    __m256i l0 = _mm256_setzero_si256(), h0 = l0, l1 = l0, h1 = l0; /* even and odd steps: two chains each */
    for (int64_t k = k0; k < k1; k += 8) {
        __m256i xe = bcast4(x + k), xo = bcast4(x + k + 4);
        l0 = _mm256_dpbusd_avx_epi32(l0, _mm256_loadu_si256((const __m256i *)(w + k * TILE)), xe);
        h0 = _mm256_dpbusd_avx_epi32(h0, _mm256_loadu_si256((const __m256i *)(w + k * TILE + 32)), xe);
        l1 = _mm256_dpbusd_avx_epi32(l1, _mm256_loadu_si256((const __m256i *)(w + (k + 4) * TILE)), xo);
        h1 = _mm256_dpbusd_avx_epi32(h1, _mm256_loadu_si256((const __m256i *)(w + (k + 4) * TILE + 32)), xo);
    }
    *lo = _mm256_add_epi32(l0, l1);
    *hi = _mm256_add_epi32(h0, h1);
}

#define Q8_SIGNED 0 /* dot products of w + 128: the correction applies */
#else
/* Without VNNI the multiply is vpmaddubsw: unsigned bytes times signed ones, pairs added into an i16 (which
 * saturates), then vpmaddwd by ones sums pairs into i32.
 * int8: the weights are w + 128 (up to 255), and 255 * 127 twice overflows an i16. Made signed again (XOR
 * 0x80) the sign moves onto the activations (vpsignb) and |w| <= 127 is the unsigned side: a pair is at most
 * 2 * 127 * 127 = 32258, exact. The dot products are of w itself, so the +128 correction does not apply. */
INLINE __m256i q8_signed(const uint8_t *w, int64_t k, int half) { /* w of rows 0-7 (half 0) or 8-15 */
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + k * TILE + 32 * half)),
                            _mm256_set1_epi8((char)0x80));
}

INLINE void q8_vecs(const uint8_t *w, int64_t k, __m256i *v) { /* |w| and w of rows 0-7, then 8-15 */
    for (int half = 0; half < 2; half++) {
        v[2 * half + 1] = q8_signed(w, k, half);
        v[2 * half] = _mm256_abs_epi8(v[2 * half + 1]);
    }
}

INLINE __m256i q8_pairs(__m256i mag, __m256i sgn, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(x, sgn)), _mm256_set1_epi16(1));
}

/* One activation row's integer dot products with a tile's rows over inputs [k0, k1), rows 0-7 in *lo and
 * 8-15 in *hi (of w, not w + 128). */
INLINE void q8_dots(const uint8_t *w, const int8_t *x, int64_t k0, int64_t k1, __m256i *lo, __m256i *hi) {
    __m256i l0 = _mm256_setzero_si256(), h0 = l0, l1 = l0, h1 = l0; /* even and odd steps: two chains each */
    for (int64_t k = k0; k < k1; k += 8) {
        __m256i e[4], o[4];
        q8_vecs(w, k, e);
        q8_vecs(w, k + 4, o);
        __m256i xe = bcast4(x + k), xo = bcast4(x + k + 4);
        l0 = _mm256_add_epi32(l0, q8_pairs(e[0], e[1], xe));
        h0 = _mm256_add_epi32(h0, q8_pairs(e[2], e[3], xe));
        l1 = _mm256_add_epi32(l1, q8_pairs(o[0], o[1], xo));
        h1 = _mm256_add_epi32(h1, q8_pairs(o[2], o[3], xo));
    }
    *lo = _mm256_add_epi32(l0, l1);
    *hi = _mm256_add_epi32(h0, h1);
}

/* Several activation rows' dot products with one half of a tile (rows 0-7, or 8-15) over the block at k0: each 4
 * inputs' |w| and w are made once and serve up to Q8_ROW_GROUP rows from registers, a row's sums in one register
 * (at 8 rows GCC spilled half the sums to the stack: a store-to-load chain a step). This replaced making a
 * block's |w| and w once into L1 and reading them back for each row, which was bound by those loads and the
 * vector ops per row: on a Zen 3 guest (AVX2 only) a standalone loop over 16 rows did 15 multiply-adds a cycle
 * that way against 20 this way (tiles in cache), 10 against 18 from memory. Per expert (Qwen3 shape, one process
 * alternating builds, best of 6-8 rounds, the same bits): 4 rows 1.24-1.36x as fast on one thread, 16 rows
 * 1.16-1.19x, 64 rows 1.19-1.28x; on two threads 4 rows 1.24x, 16 and 64 rows within the guest's noise
 * (0.93-1.07x). */
#define Q8_ROWS 1
#define Q8_ROW_GROUP 4
INLINE void q8_rows_dots(const uint8_t *w, const int8_t *const *x, int mm, int64_t k0, int half, __m256i *dots) {
    for (int r0 = 0; r0 < mm; r0 += Q8_ROW_GROUP) {
        int rn = mm - r0 < Q8_ROW_GROUP ? mm - r0 : Q8_ROW_GROUP;
        __m256i acc[Q8_ROW_GROUP];
        for (int r = 0; r < rn; r++)
            acc[r] = _mm256_setzero_si256();
        for (int64_t k = k0; k < k0 + QB; k += 4) {
            __m256i s = q8_signed(w, k, half), mag = _mm256_abs_epi8(s);
            for (int r = 0; r < rn; r++)
                acc[r] = _mm256_add_epi32(acc[r], q8_pairs(mag, s, bcast4(x[r0 + r] + k)));
        }
        for (int r = 0; r < rn; r++)
            dots[r0 + r] = acc[r];
    }
}

#define Q8_SIGNED 1
#endif

/* int4: the same over one group; bytes hold inputs t (low nibble) and 4 + t (high) of each 8. Several rows keep
 * cutting the nibbles row by row: cut once and shared by 4-8 rows from registers, as int8's q8_rows_dots, a
 * standalone loop on a Zen 3 guest (16-24 rows, tiles in cache) did 18-22 multiply-adds a cycle against 22-28
 * this way, two broadcasts a row each step costing more than the cuts saved (two rows over both halves, one cut
 * for both: 18-20 against 18-25, within the guest's noise); made once per group into L1, or
 * summed four steps in i16 before each vpmaddwd, it had run 10-20% slower at 16 rows there. */
INLINE void q4_dots(const uint8_t *w, const int8_t *x, int64_t k0, int64_t k1, __m256i *lo, __m256i *hi) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i l = _mm256_setzero_si256(), h = l;
#if defined(HAVE_AVXVNNI)
    __m256i l1 = l, h1 = l; /* low and high nibbles on two chains */
#else
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int64_t k = k0; k < k1; k += 16) { /* groups are multiples of 16 inputs */
#if !defined(HAVE_AVXVNNI)
        __m256i sl = _mm256_setzero_si256(), sh = sl; /* two steps' pairs in i16, then one vpmaddwd */
#endif
        for (int64_t kk = k; kk < k + 16; kk += 8) {
            __m256i p0 = _mm256_loadu_si256((const __m256i *)(w + kk / 2 * TILE));
            __m256i p1 = _mm256_loadu_si256((const __m256i *)(w + kk / 2 * TILE + 32));
            __m256i xa = bcast4(x + kk), xb = bcast4(x + kk + 4);
            __m256i p0l = _mm256_and_si256(p0, low), p0h = _mm256_and_si256(_mm256_srli_epi16(p0, 4), low);
            __m256i p1l = _mm256_and_si256(p1, low), p1h = _mm256_and_si256(_mm256_srli_epi16(p1, 4), low);
#if defined(HAVE_AVXVNNI)
            l = _mm256_dpbusd_avx_epi32(l, p0l, xa);
            l1 = _mm256_dpbusd_avx_epi32(l1, p0h, xb);
            h = _mm256_dpbusd_avx_epi32(h, p1l, xa);
            h1 = _mm256_dpbusd_avx_epi32(h1, p1h, xb);
#else
            /* Nibbles (0..15) times int8: a vpmaddubsw pair is at most 2 * 15 * 127, a step's low and high
             * halves' pairs added 7620 and two steps 15240, exact in i16; vpmaddwd by ones then sums each
             * row's pairs into its i32 lane (on a Zen 2 guest, in cache, a tenth fewer cycles at 16 rows than
             * one vpmaddwd a step, a few % at one row; four steps a vpmaddwd had run slower on a Zen 3). */
            sl = _mm256_add_epi16(sl, _mm256_add_epi16(_mm256_maddubs_epi16(p0l, xa), _mm256_maddubs_epi16(p0h, xb)));
            sh = _mm256_add_epi16(sh, _mm256_add_epi16(_mm256_maddubs_epi16(p1l, xa), _mm256_maddubs_epi16(p1h, xb)));
#endif
        }
#if !defined(HAVE_AVXVNNI)
        l = _mm256_add_epi32(l, _mm256_madd_epi16(sl, ones));
        h = _mm256_add_epi32(h, _mm256_madd_epi16(sh, ones));
#endif
    }
#if defined(HAVE_AVXVNNI)
    l = _mm256_add_epi32(l, l1);
    h = _mm256_add_epi32(h, h1);
#endif
    *lo = l;
    *hi = h;
}

/* The tile's float results, rows 0-7 in lo and 8-15 in hi (those past `valid` padding), to y. */
INLINE void store_tile(float *y, __m256 lo, __m256 hi, const float *mul, float sub, const float *bias, int valid) {
    float res[TILE];
    _mm256_storeu_ps(res, lo);
    _mm256_storeu_ps(res + 8, hi);
    for (int i = 0; i < valid; i++)
        y[i] = (mul ? mul[i] * (res[i] - sub) : res[i]) + (bias ? bias[i] : 0.0f);
}

INLINE void q8_tile(const uint8_t *w, const float *ws, const acts *a, const int64_t *rows, int mm, int64_t K,
                    float *y, int64_t ldy, const float *bias, int valid) {
    int64_t blocks = K / QB;
    __m256 lo[MB], hi[MB];
    const int8_t *x[MB];
    for (int r = 0; r < mm; r++) {
        lo[r] = hi[r] = _mm256_setzero_ps();
        x[r] = a->q + rows[r] * K;
    }
    for (int64_t i = 0; i < blocks; i++) {
        int64_t b = mm == 1 ? stream_order(i, blocks) : i;
        if (SW_PREFETCH || mm > 1)
            for (int64_t line = 0; line < QB * TILE; line += 64) /* the block's 1 KB, 8 KB on */
                _mm_prefetch((const char *)(w + b * QB * TILE) + 2 * PREFETCH_BYTES + line, PREFETCH_HINT_INT);
#if defined(Q8_ROWS)
        if (mm > 1) { /* the same sums and the same float operations as one row at a time, in the same order */
            __m256i dots[MB];
            q8_rows_dots(w, x, mm, b * QB, 0, dots);
            for (int r = 0; r < mm; r++)
                lo[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_set1_ps(a->d[rows[r] * blocks + b]), lo[r]);
            q8_rows_dots(w, x, mm, b * QB, 1, dots);
            for (int r = 0; r < mm; r++)
                hi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_set1_ps(a->d[rows[r] * blocks + b]), hi[r]);
            continue;
        }
#endif
        for (int r = 0; r < mm; r++) {
            __m256i dl, dh;
            q8_dots(w, x[r], b * QB, (b + 1) * QB, &dl, &dh);
            __m256 d = _mm256_set1_ps(a->d[rows[r] * blocks + b]);
            lo[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dl), d, lo[r]);
            hi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dh), d, hi[r]);
        }
    }
    for (int r = 0; r < mm; r++)
        store_tile(y + r * ldy, lo[r], hi[r], ws, Q8_SIGNED ? 0.0f : a->corr[rows[r]], bias, valid);
}

/* A group's scales (rows 0-7, 8-15), then its zeros less 8 scales (the offset's and the zero's share, as the
 * AVX-512 loop), from after its nibbles. */
INLINE void q4_group_scales(const uint8_t *wj, int64_t g, __m256 *sz) {
    const uint16_t *p = (const uint16_t *)(wj + g / 2 * TILE);
    const __m256 eight = _mm256_set1_ps(8.0f);
    sz[0] = bf16x8(p);
    sz[1] = bf16x8(p + 8);
    sz[2] = _mm256_fnmadd_ps(eight, sz[0], bf16x8(p + TILE));
    sz[3] = _mm256_fnmadd_ps(eight, sz[1], bf16x8(p + TILE + 8));
}

/* lo, hi plus one activation row's dot products over a group, dequantized (its block scale d, scaled sum dsum):
 * q4_tile and q4_tile_pair the same way, so a pair's sums are the single tile's bit for bit. */
INLINE void q4_add_group(const __m256 *sz, __m256i dl, __m256i dh, float d, float dsum, __m256 *lo, __m256 *hi) {
    __m256 vd = _mm256_set1_ps(d), vds = _mm256_set1_ps(dsum);
    *lo = _mm256_fmadd_ps(sz[2], vds, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dl), _mm256_mul_ps(sz[0], vd), *lo));
    *hi = _mm256_fmadd_ps(sz[3], vds, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dh), _mm256_mul_ps(sz[1], vd), *hi));
}

INLINE void q4_tile(const uint8_t *w, int64_t g, const acts *a, const int64_t *rows, int mm, int64_t K, float *y,
                    int64_t ldy, const float *bias, int valid) {
    int64_t G = K / g, gb = q4_group_bytes(g);
    __m256 lo[MB], hi[MB];
    for (int r = 0; r < mm; r++)
        lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < G; j++) {
        const uint8_t *wj = w + j * gb; /* the group's nibbles, then its scales and zeros */
        if (SW_PREFETCH || mm > 1)
            for (int64_t line = 0; line < gb; line += 64)
                _mm_prefetch((const char *)wj + PREFETCH_BYTES + line, PREFETCH_HINT_INT);
        __m256 sz[4];
        q4_group_scales(wj, g, sz);
        for (int r = 0; r < mm; r++) {
            int64_t at = rows[r] * G + j;
            __m256i dl, dh;
            q4_dots(wj, a->q + rows[r] * K + j * g, 0, g, &dl, &dh);
            q4_add_group(sz, dl, dh, a->d[at], a->dsum[at], &lo[r], &hi[r]);
        }
    }
    for (int r = 0; r < mm; r++)
        store_tile(y + r * ldy, lo[r], hi[r], NULL, 0.0f, bias, valid);
}

/* One activation row against two whole int4 tiles at once, group by group: q4_tile's operations for each, so
 * its sums bit for bit, from two streams far apart (hs_rows_item). On an AMD EPYC guest (Zen 3, AVX2 only, one
 * process alternating builds, 9-15 rounds over 160 MB of Qwen3-shape matrices) one-row int4 read 11-24% more a
 * second on one thread and 14% more on two, and whole-model int4 decode ran 11% faster (medians of five runs,
 * builds alternating, one thread). int8 tiles in pairs came out even per matrix there (-2% to +20% in three
 * runs) and 5% slower in whole-model decode, so int8 keeps one tile at a time on AVX2. */
#define HAVE_Q4_PAIR 1
INLINE void q4_tile_pair(const uint8_t *wa, const uint8_t *wb, int64_t g, const acts *a, int64_t row, int64_t K,
                         float *ya, float *yb, const float *bias_a, const float *bias_b) {
    int64_t G = K / g, gb = q4_group_bytes(g);
    const int8_t *x = a->q + row * K;
    __m256 lo_a = _mm256_setzero_ps(), hi_a = lo_a, lo_b = lo_a, hi_b = lo_a;
    for (int64_t j = 0; j < G; j++) {
        const uint8_t *ja = wa + j * gb, *jb = wb + j * gb;
        for (int64_t line = 0; SW_PREFETCH && line < gb; line += 64) {
            _mm_prefetch((const char *)ja + PREFETCH_BYTES + line, PREFETCH_HINT_INT);
            _mm_prefetch((const char *)jb + PREFETCH_BYTES + line, PREFETCH_HINT_INT);
        }
        __m256i dl_a, dh_a, dl_b, dh_b;
        q4_dots(ja, x + j * g, 0, g, &dl_a, &dh_a);
        q4_dots(jb, x + j * g, 0, g, &dl_b, &dh_b);
        __m256 sz_a[4], sz_b[4];
        q4_group_scales(ja, g, sz_a);
        q4_group_scales(jb, g, sz_b);
        float d = a->d[row * G + j], dsum = a->dsum[row * G + j];
        q4_add_group(sz_a, dl_a, dh_a, d, dsum, &lo_a, &hi_a);
        q4_add_group(sz_b, dl_b, dh_b, d, dsum, &lo_b, &hi_b);
    }
    store_tile(ya, lo_a, hi_a, NULL, 0.0f, bias_a, TILE);
    store_tile(yb, lo_b, hi_b, NULL, 0.0f, bias_b, TILE);
}
#elif defined(HAVE_NEON_DOT)
/* q8_tile and q4_tile: rows_neon.h */
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
#endif

INLINE void store(float *y, int64_t ldy, int64_t n, const float *out, int mm, float add) {
    for (int r = 0; r < mm; r++)
        y[r * ldy + n] = out[r] + add;
}

void hs_rows_block(const hs_matrix *W, const acts *a, const int64_t *rows, int64_t M, int64_t n0, int64_t n1,
                   float *y, int64_t ldy) {
    int64_t K = W->K;
    float out[MB], out_rows[NCHUNK];
    int64_t step = W->format == Q8 || W->format == Q4 ? TILE : 1; /* chunks start on a tile (NCHUNK) */
    if (W->format == Q8 && a->amx) {
        hs_amx_q8_rows(W, a, rows, M, n0, n1, y, ldy);
        return;
    }
    if (W->format == BF16 && a->amx) {
        n0 = hs_amx_bf16_rows(W, a->amx, M, n0, n1, y, ldy);
        if (n0 >= n1)
            return;
    }
    if ((W->format == F32 || W->format == BF16) && M >= 2) {
        float_rows(W, a, rows, M, n0, n1, y, ldy);
        return;
    }
#if defined(HAVE_AVX2) && !defined(HAVE_AVX512)
    if ((W->format == F32 || W->format == BF16) && M == 1 && n1 - n0 <= NCHUNK && (n1 - n0) % FLOAT_STREAMS == 0) {
        const void *w = W->format == F32 ? (const void *)((const float *)W->w + n0 * K)
                                         : (const void *)((const uint16_t *)W->w + n0 * K);
        avx2_rows_streams(w, W->format == BF16, a->f32 + rows[0] * a->ld, K, n1 - n0, out_rows);
        for (int64_t n = n0; n < n1; n++)
            y[n] = out_rows[n - n0] + (W->bias ? W->bias[n] : 0.0f);
        return;
    }
#endif
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
            const uint8_t *w = (const uint8_t *)W->w + n / TILE * (K / W->group) * q4_group_bytes(W->group);
            const float *b = W->bias ? W->bias + n : NULL;
#define Q4_BODY(mm) q4_tile(w, W->group, a, rows + m, mm, K, y + m * ldy + n, ldy, b, valid)
            ROWS_SWITCH(M, Q4_BODY)
        }
    }
}

/* One activation row runs its weight chunks in pairs, chunk t beside chunk t + half (int8 and int4: tiles; fp32
 * and bf16: rows of the two chunks in turn), so a core reads two streams far apart instead of one. On an Intel
 * Xeon guest (AVX-512 with VNNI and BF16) one core's 1 GB read loop, prefetching 4 KB ahead, read 14.8 GB/s
 * from one stream, 16.0 from two and 16.1 from four; two streams a few KB apart (the halves of a tile) no
 * more than one. There, one process alternating builds (12 passes over 1.1 GB of Qwen3-shape experts, medians;
 * outputs bit-identical), pairs against one stream, one thread / two: fp32 +6.5% / +6.1% per expert, bf16
 * +7.7% / +8.5%, int8 +9.1% / +4.3%, int4 +5.5% / +6.5%; a layer's 8 experts in one call alike (+4-8%).
 * On a Zen 4 guest (AVX-512 with VNNI and BF16; the same A/B, 8-12 passes), per expert, one thread / two:
 * fp32 +8-13% / +0-5% (its pair prefetching half as far, above), bf16 +19-20% / +5-6%, int8 +5-9% / +15-17%,
 * int4 +6-7% / even; a layer's 8 experts in one call +6-14% on one thread, -1% to +6% on two.
 * -DQ4_PAIRS=, -DQ8_PAIRS=, -DBF16_PAIRS=, -DF32_PAIRS= (0 or 1) in HINTSERVE_KERNEL_FLAGS choose. */
#define PAIRS_DEFAULT 1
#ifndef Q4_PAIRS
#define Q4_PAIRS PAIRS_DEFAULT
#endif
#ifndef Q8_PAIRS
#define Q8_PAIRS PAIRS_DEFAULT
#endif
#ifndef BF16_PAIRS
#define BF16_PAIRS PAIRS_DEFAULT
#endif
#ifndef F32_PAIRS
#define F32_PAIRS PAIRS_DEFAULT
#endif

static int64_t chunks_of(const hs_matrix *W) { return (W->N + NCHUNK - 1) / NCHUNK; }

static int paired(const hs_matrix *W, int64_t M) {
    if (M != 1 || W->N % NCHUNK || chunks_of(W) < 2)
        return 0;
#if defined(HAVE_Q4_PAIR)
    if (W->format == Q4)
        return Q4_PAIRS;
#endif
#if defined(HAVE_Q8_PAIR)
    if (W->format == Q8)
        return Q8_PAIRS;
#endif
#if defined(HAVE_BF16_PAIR)
    if (W->format == BF16)
        return BF16_PAIRS;
#endif
#if defined(HAVE_F32_PAIR)
    if (W->format == F32)
        return F32_PAIRS;
#endif
    return 0;
}

int64_t hs_items(const hs_matrix *W, int64_t M) {
    return paired(W, M) ? (chunks_of(W) + 1) / 2 : chunks_of(W);
}

void hs_rows_item(const hs_matrix *W, const acts *a, const int64_t *rows, int64_t M, int64_t item, float *y,
                  int64_t ldy) {
    int64_t chunks = chunks_of(W);
    if (!paired(W, M)) {
        int64_t n0 = item * NCHUNK, n1 = n0 + NCHUNK < W->N ? n0 + NCHUNK : W->N;
        hs_rows_block(W, a, rows, M, n0, n1, y, ldy);
        return;
    }
    int64_t second = item + (chunks + 1) / 2, n0 = item * NCHUNK, n1 = second * NCHUNK, K = W->K;
    if (second >= chunks) { /* an odd count's middle chunk, alone */
        hs_rows_block(W, a, rows, 1, n0, n0 + NCHUNK, y, ldy);
        return;
    }
    const float *bias = W->bias;
#if defined(HAVE_Q4_PAIR)
    if (W->format == Q4) { /* NCHUNK is TILE: a chunk is a tile */
        int64_t tile_bytes = K / W->group * q4_group_bytes(W->group);
        const uint8_t *w = (const uint8_t *)W->w;
        q4_tile_pair(w + item * tile_bytes, w + second * tile_bytes, W->group, a, rows[0], K, y + n0, y + n1,
                     bias ? bias + n0 : NULL, bias ? bias + n1 : NULL);
        return;
    }
#endif
#if defined(HAVE_Q8_PAIR)
    if (W->format == Q8) {
        const uint8_t *w = (const uint8_t *)W->w;
        const float *ws = (const float *)W->scales;
        q8_tile_pair(w + n0 * K, w + n1 * K, ws + n0, ws + n1, a, rows[0], K, y + n0, y + n1,
                     bias ? bias + n0 : NULL, bias ? bias + n1 : NULL);
        return;
    }
#endif
    for (int64_t i = 0; i < NCHUNK; i++) { /* the float formats, row by row */
        float out_a = 0.0f, out_b = 0.0f;
#if defined(HAVE_BF16_PAIR)
        if (W->format == BF16)
            bf16_row_pair((const uint16_t *)W->w + (n0 + i) * K, (const uint16_t *)W->w + (n1 + i) * K,
                          a->bf16 + rows[0] * K, K, &out_a, &out_b);
#endif
#if defined(HAVE_F32_PAIR)
        if (W->format == F32)
            f32_row_pair((const float *)W->w + (n0 + i) * K, (const float *)W->w + (n1 + i) * K,
                         a->f32 + rows[0] * a->ld, K, &out_a, &out_b);
#endif
        y[n0 + i] = out_a + (bias ? bias[n0 + i] : 0.0f);
        y[n1 + i] = out_b + (bias ? bias[n1 + i] : 0.0f);
    }
}

/* Which of the loops above this build runs (the engine's start-up log and hintserve doctor say it). */
const char *hs_isa(void) {
    return
#if defined(HAVE_AVX512)
        "avx512"
#elif defined(HAVE_AVX2)
        "avx2+fma"
#elif defined(HAVE_NEON)
        "neon"
#else
        "portable C"
#endif
#if defined(HAVE_VNNI512)
        "+vnni"
#elif defined(HAVE_AVXVNNI)
        "+avxvnni"
#elif defined(HAVE_NEON_DOT)
        "+dotprod"
#endif
#if defined(__AVX512BF16__)
        "+bf16"
#endif
        ;
}
