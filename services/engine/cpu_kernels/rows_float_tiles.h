/* Part of rows.c (after rows_float.h): fp32 and bf16 at two or more activation rows. */
/* ---- fp32 and bf16 at two or more activation rows: a tile of NT weight rows x up to MT activation rows ----
 * One row of weights against MB rows (rows_float.h) spends a load of activations on every FMA, and those rows (8 KB
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
