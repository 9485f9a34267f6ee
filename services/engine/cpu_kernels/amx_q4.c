/* int4 weights against many activation rows on Intel AMX tiles (amx.c says why tiles; rows_int_avx512.h's
 * q4_tile is the vector loop this matches).
 *
 * A Q4 tile's group of inputs is [g/8][TILE][4] bytes, byte (i, t) of step s holding row i's inputs 8s + t
 * (low nibble) and 8s + 4 + t (high): the low nibbles of step s are the tile-B row of inputs 8s..8s+3 of all
 * 16 weight rows, the high ones that of 8s+4..8s+7. So each 64 inputs of a group unpack into one 16 x 64 tile
 * B of nibble values (1 KB) with two vector ops a step, and TDPBSUD multiplies it by the activations' int8
 * values (tile A, packed as for int8) into the exact integer sums of each activation row and weight row; a
 * group's sums, dequantized by q4_add_group as the vector loop's are, make the results its bits. */
#include <stdint.h>

#include "hs.h"
#include "amx.h"

#if defined(HAVE_AMX)
#include "dequant_avx512.h"

#define Q4_UNPACK_LEAD 2    /* groups unpacked ahead of their tile product: a tile load waits on recent stores */
#define Q4_UNPACK_RING 4    /* unpacked groups' buffers: more than Q4_UNPACK_LEAD */

/* A group's nibbles (from `block`, g inputs) as tile B rows of nibble values: [g / 4][64] bytes. */
static inline __attribute__((always_inline)) void unpack_group(const uint8_t *block, int64_t g, uint8_t *out) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t s = 0; s < g / 8; s++) {
        __m512i p = _mm512_loadu_si512(block + s * 64);
        _mm512_store_si512(out + 2 * s * 64, _mm512_and_si512(p, low));
        _mm512_store_si512(out + (2 * s + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(p, 4), low));
    }
}

/* acc[r] plus group j's sums of activation row r, dequantized with the group's scales and zeros (after its
 * nibbles in `block`) as q4_tile does. */
static inline __attribute__((always_inline)) void scale_group(__m512 acc[16], const int32_t sums[16][16],
                                                              const uint8_t *block, int64_t g,
                                                              const float *const d[16],
                                                              const float *const dsum[16], int64_t j) {
    __m512 scale, zero8;
    q4_scales(block, g, &scale, &zero8);
    for (int r = 0; r < 16; r++)
        acc[r] = q4_add_group(acc[r], _mm512_load_si512(sums[r]), scale, zero8, d[r][j], dsum[r][j]);
}

/* One int4 weight tile (16 rows; w: its groups, q4_group_bytes(g) each) against one packed block of activation
 * rows (tile A, [16][K]); y = the dequantized sums group by group, plus bias, as q4_tile computes them. */
static void q4_block(const uint8_t *w, int64_t g, const float *bias, int valid, const int8_t *xq, const acts *a,
                     const int64_t *rows, int64_t mm, float *y, int64_t ldy) {
    int64_t K = a->K, G = K / g, gb = q4_group_bytes(g), parts = g / 64;
    uint8_t unpacked[Q4_UNPACK_RING][AMX_Q4_MAX_GROUP / 64][16][64] __attribute__((aligned(64)));
    int32_t sums[AMX_SUM_RING][16][16] __attribute__((aligned(64)));
    const float *d[16], *dsum[16];
    __m512 acc[16];
    for (int r = 0; r < 16; r++) {
        int64_t row = rows[r < mm ? r : 0]; /* rows past mm: zeros, summed and dropped */
        d[r] = a->d + row * G;
        dsum[r] = a->dsum + row * G;
        acc[r] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < Q4_UNPACK_LEAD && j < G; j++)
        unpack_group(w + j * gb, g, &unpacked[j % Q4_UNPACK_RING][0][0][0]);
    /* Two sum tiles in turn (0, then 3), as amx.c's int8 blocks; a group's sums scaled AMX_SUM_LAG groups after
     * their store, its lines prefetched AMX_INT_PREFETCH ahead of the group being unpacked (amx.h). */
#define Q4_TILE_GROUP(c, x, wt, grp)                                                                          \
    do {                                                                                                       \
        _tile_zero(c);                                                                                         \
        for (int64_t part = 0; part < parts; part++) {                                                         \
            _tile_loadd(x, xq + (grp) * g + part * 64, K);                                                     \
            _tile_loadd(wt, &unpacked[(grp) % Q4_UNPACK_RING][part][0][0], 64);                                \
            _tile_dpbsud(c, x, wt);                                                                            \
        }                                                                                                      \
        _tile_stored(c, sums[(grp) % AMX_SUM_RING], 64);                                                        \
    } while (0)
    for (int64_t j = 0; j < G; j++) {
        int64_t next = j + Q4_UNPACK_LEAD;
        if (next < G) {
            const uint8_t *block = w + next * gb;
            if (AMX_INT_PREFETCH > 0)
                for (int64_t line = 0; line < gb; line += 64)
                    _mm_prefetch((const char *)block + AMX_INT_PREFETCH + line, AMX_INT_PREFETCH_HINT);
            unpack_group(block, g, &unpacked[next % Q4_UNPACK_RING][0][0][0]);
        }
        if (j % 2 == 0)
            Q4_TILE_GROUP(0, 1, 2, j);
        else
            Q4_TILE_GROUP(3, 4, 5, j);
        if (j >= AMX_SUM_LAG)
            scale_group(acc, sums[(j - AMX_SUM_LAG) % AMX_SUM_RING], w + (j - AMX_SUM_LAG) * gb, g, d, dsum, j - AMX_SUM_LAG);
    }
#undef Q4_TILE_GROUP
    for (int64_t j = G > AMX_SUM_LAG ? G - AMX_SUM_LAG : 0; j < G; j++)
        scale_group(acc, sums[j % AMX_SUM_RING], w + j * gb, g, d, dsum, j);
    __mmask16 keep = (__mmask16)((1u << valid) - 1);
    __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int64_t r = 0; r < mm; r++)
        _mm512_mask_storeu_ps(y + r * ldy, keep, _mm512_add_ps(acc[r], add));
}
#endif

/* Weight rows [n0, n1) (whole tiles but a last one past N) of an int4 W against the M activation rows of `a`
 * (rows[m]), packed at a->amx. */
void hs_amx_q4_rows(const hs_matrix *W, const acts *a, const int64_t *rows, int64_t M, int64_t n0, int64_t n1,
                    float *y, int64_t ldy) {
#if defined(HAVE_AMX)
    amx_configure_int_tiles();
    int64_t K = W->K, tile_bytes = K / W->group * q4_group_bytes(W->group);
    for (int64_t b = 0; b * 16 < M; b++) {
        const int8_t *xq = (const int8_t *)a->amx + b * 16 * K;
        int64_t mm = M - b * 16 < 16 ? M - b * 16 : 16;
        for (int64_t n = n0; n < n1; n += TILE) {
            int valid = (int)(W->N - n < TILE ? W->N - n : TILE);
            q4_block((const uint8_t *)W->w + n / TILE * tile_bytes, W->group, W->bias ? W->bias + n : NULL, valid,
                     xq, a, rows + b * 16, mm, y + b * 16 * ldy + n, ldy);
        }
    }
    _tile_release();
#else
    (void)W, (void)a, (void)rows, (void)M, (void)n0, (void)n1, (void)y, (void)ldy;
#endif
}
