/* Part of rows.c (after rows_float.h), for AVX-512 builds with VNNI: the int8 and int4 tiles (layouts: rows.c,
 * formats.py), one vpdpbusd over 4 inputs of all TILE rows. */
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
