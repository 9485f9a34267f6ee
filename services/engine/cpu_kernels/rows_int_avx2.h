/* Part of rows.c (after rows_float.h), for AVX2 builds (AVX-512 ones without VNNI too): the int8 and int4
 * tiles (layouts: rows.c, formats.py), with AVX-VNNI's vpdpbusd where the CPU has it. */
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
