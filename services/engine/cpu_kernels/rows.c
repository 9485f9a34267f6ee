/* The inner loops: weight rows [n0, n1) of one matrix against prepared activation rows (formats: matmul.c).
 *
 * Each weight row is read once from memory and serves every activation row, MB at a time from registers; MB is
 * a compile-time constant in each loop (`ROWS_SWITCH`), so the accumulators live in registers (with the count
 * known only at run time they went through the stack, a store-load chain per step: 29 cycles per 64 int8
 * weights). int8 and int4 run a tile of TILE rows at a time (below).
 *
 * The loops live in the headers below, one concern each, and are included into this one translation unit so
 * that they inline here: rows_tuning.h (instruction sets, prefetch distances), rows_float.h (fp32 and bf16,
 * one row and pairs), rows_float_tiles.h (fp32 and bf16 at two rows and more), rows_int_avx512.h,
 * rows_int_avx2.h, rows_neon.h and rows_int_portable.h (int8 and int4 tiles per instruction set). This file
 * picks among them per matrix and work item. */
#include <stdint.h>
#include <string.h>

#include "hs.h"
#include "rows_tuning.h"
#include "rows_float.h"
#include "rows_float_tiles.h"

/* ---- int8 and int4: tiles of TILE weight rows, TILE lanes of one vector each (layouts: formats.py) ----
 * int8 tile: [K/4][TILE][4] bytes (w + 128); int4 tile: group after group, [g/8][TILE][4] bytes, byte (i, t)
 * holding row i's inputs t (low nibble) and 4 + t (high) of each 8, then the group's (scale, zero) as bf16
 * [2][TILE] (q4_group_bytes). One vpdpbusd multiplies 4 inputs of TILE rows by the same 4 activations
 * (broadcast), so each group's scales apply to a vector of rows and nothing is summed across lanes. */

#if defined(HAVE_VNNI512)
#include "rows_int_avx512.h"
#elif defined(HAVE_AVX2)
#include "rows_int_avx2.h"
#elif !defined(HAVE_NEON_DOT) /* with it, q8_tile and q4_tile are rows_neon.h's */
#include "rows_int_portable.h"
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
    if (W->format == Q4 && a->amx) {
        hs_amx_q4_rows(W, a, rows, M, n0, n1, y, ldy);
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
 * fp32 +8-13% / +0-5% (its pair prefetching half as far: rows_float.h), bf16 +19-20% / +5-6%, int8 +5-9% / +15-17%,
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

/* Which of the loops this build runs (the engine's start-up log and hintserve doctor say it). */
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
