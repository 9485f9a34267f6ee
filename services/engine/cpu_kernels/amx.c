/* bf16 and int8 weights against many activation rows on Intel AMX tiles: prefill chunks and wide batches.
 *
 * Why: at many rows a matmul is bound by arithmetic, not by reading weights, and AVX-512's dot products
 * (rows.c's bf16_tile, q8_tile) do 64 (bf16) or 128 (int8) multiply-adds a cycle where one tile op does 512 or
 * 1024 (Sapphire Rapids and later Xeons; torch's oneDNN uses them for its own bf16 matmuls).
 *
 * bf16 (TDPBF16PS): each tile product multiplies 16 weight rows x 32 inputs (tile A, read in place from W [N, K]
 * at its row stride) by 32 inputs x 16 activation rows (tile B: the activations packed once per call by
 * hs_amx_pack, pairs of bf16 inputs side by side for 16 rows), into 16 x 16 fp32 sums (tile C = y^T), so the
 * weights need no second layout. Sums: bf16 products accumulated in fp32, as vdpbf16ps does, but in the tile
 * unit's order (and with its denormals flushed), so a row's result differs from the vector loops' in its last
 * bits.
 *
 * int8 (TDPBSUD): Q8's tiles of 16 weight rows ([K/4][16][4] bytes, w + 128) are tile B as they lie; tile A is
 * 16 activation rows' int8 values (packed per call, rows gathered); each tile product is one activation block's
 * exact int32 sums, scaled in fp32 as the vector loop scales them, so the results are its bits.
 *
 * HINTSERVE_AMX=0 in the environment turns this path off. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hs.h"

#include "amx.h"

#if defined(HAVE_AMX)
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#endif

#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 5 /* below: rows.c's vector loops, as fast here (4 rows: 335 us a 1536 x 2048 matrix either way) */
#endif
#ifndef AMX_MIN_ROWS_Q8
#define AMX_MIN_ROWS_Q8 10 /* int8's vector loops are faster per row: 8 rows 194 us against the tiles' 230 */
#endif
#ifndef AMX_MIN_ROWS_Q4
#define AMX_MIN_ROWS_Q4 10 /* int4 (amx_q4.c), as int8 */
#endif
#define AMX_MB 3 /* activation row blocks of 16 per pass over a weight tile: 1 A + 3 B + 3 C of the 8 tiles */

#if defined(HAVE_AMX)
/* Linux hands out the tile registers' state only on request, once per process; a guest whose hypervisor hides
 * it refuses, and the vector loops run. */
static int amx_granted(void) {
    static _Atomic int state = -1;
    int s = atomic_load(&state);
    if (s < 0) {
        const char *env = getenv("HINTSERVE_AMX");
        s = !(env && strcmp(env, "0") == 0) && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        atomic_store(&state, s);
    }
    return s;
}
#endif

/* The rows from which `format` runs on AMX tiles here, 0: never (the start-up line and hintserve doctor say it). */
int hs_amx_rows(int64_t format) {
#if defined(HAVE_AMX)
    if (!amx_granted())
        return 0;
    return format == BF16 ? AMX_MIN_ROWS : format == Q8 ? AMX_MIN_ROWS_Q8 : format == Q4 ? AMX_MIN_ROWS_Q4 : 0;
#else
    (void)format;
    return 0;
#endif
}

int hs_amx_wanted(const hs_matrix *W, int64_t M) {
    int least = hs_amx_rows(W->format);
    return least && M >= least && W->K % 64 == 0 && (W->format != Q4 || (W->group % 64 == 0 && W->group <= AMX_Q4_MAX_GROUP));
}

/* Bytes of one packed activation row of width K: bf16 pairs, or Q8's and Q4's int8 values. */
int64_t hs_amx_row_bytes(int64_t format, int64_t K) { return format == Q8 || format == Q4 ? K : 2 * K; }

/* Bytes hs_amx_pack writes for M rows of width K: whole blocks of 16 rows. */
int64_t hs_amx_packed_bytes(int64_t format, int64_t M, int64_t K) {
    return (M + 15) / 16 * 16 * hs_amx_row_bytes(format, K);
}

/* Block b of the activation rows rows[m] (m < M) into dst, zeros past M. bf16: a->f32's rows rounded (as
 * hs_acts_fill rounds them) as the block's [K / 2][16] pairs, so the B tiles of every 32 inputs follow on. Q8
 * and Q4: the rows' int8 values (a->q, filled) as [16][K], tile A's rows at a stride of K. */
void hs_amx_pack_block(const acts *a, const int64_t *rows, int64_t M, int64_t b, void *dst) {
    if (a->format == Q8 || a->format == Q4) {
        int8_t *out = (int8_t *)dst + b * 16 * a->K;
        for (int64_t r = 0; r < 16; r++) {
            int64_t m = b * 16 + r;
            if (m < M)
                memcpy(out + r * a->K, a->q + rows[m] * a->K, a->K);
            else
                memset(out + r * a->K, 0, a->K);
        }
        return;
    }
    int64_t pairs = a->K / 2;
    uint32_t *out = (uint32_t *)dst + b * pairs * 16;
    for (int64_t r = 0; r < 16; r++) {
        int64_t m = b * 16 + r;
        if (m >= M) {
            for (int64_t p = 0; p < pairs; p++)
                out[p * 16 + r] = 0;
            continue;
        }
        const float *x = a->f32 + rows[m] * a->ld;
        for (int64_t p = 0; p < pairs; p++)
            out[p * 16 + r] = (uint32_t)f32_to_bf16(x[2 * p]) | (uint32_t)f32_to_bf16(x[2 * p + 1]) << 16;
    }
}

typedef struct {
    const acts *a;
    const int64_t *rows;
    int64_t M;
    void *dst;
} pack_job;

static void pack_item(void *ctx, int64_t b) {
    pack_job *j = ctx;
    hs_amx_pack_block(j->a, j->rows, j->M, b, j->dst);
}

/* Packs the activation rows rows[0..M) of `a` into dst (hs_amx_packed_bytes) on the pool. */
void hs_amx_pack(const acts *a, const int64_t *rows, int64_t M, void *dst) {
    pack_job job = {a, rows, M, dst};
    hs_parallel(pack_item, &job, (M + 15) / 16);
}

#if defined(HAVE_AMX)

/* y[m, n] = sums[n][m] (+ bias[n]) for the block's first `mm` rows. */
static void store_sums(const float sums[16][16], int64_t mm, float *y, int64_t ldy, int64_t n0, int64_t nn,
                       const float *bias) {
    for (int64_t r = 0; r < mm; r++)
        for (int64_t i = 0; i < nn; i++)
            y[r * ldy + n0 + i] = sums[i][r] + (bias ? bias[n0 + i] : 0.0f);
}

/* 16 weight rows from w (row stride ldw bytes) against `blocks` (1..AMX_MB, a constant where inlined) packed
 * row blocks from b, over K inputs: tiles 0..2 sum, 3 holds the weights, 4..6 the activations. */
static inline __attribute__((always_inline)) void tile_pass(const char *w, int64_t ldw, const char *b,
                                                            int64_t block_bytes, int64_t K, int blocks) {
    _tile_zero(0);
    if (blocks > 1)
        _tile_zero(1);
    if (blocks > 2)
        _tile_zero(2);
    for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(3, w + k * 2, ldw);
        _tile_loadd(4, b + k * 32, 64);
        _tile_dpbf16ps(0, 3, 4);
        if (blocks > 1) {
            _tile_loadd(5, b + block_bytes + k * 32, 64);
            _tile_dpbf16ps(1, 3, 5);
        }
        if (blocks > 2) {
            _tile_loadd(6, b + 2 * block_bytes + k * 32, 64);
            _tile_dpbf16ps(2, 3, 6);
        }
    }
}
#endif

/* Weight rows [n0, n1) of a bf16 W against the M activation rows packed at `packed` (hs_amx_pack); returns the
 * first weight row it left to the caller (those past the last whole tile of 16). Activation blocks are taken
 * AMX_SUPER at a time, each weight tile of the range against them all, so a 512-row prefill chunk's packed rows
 * (2 MB at K = 2048) are read from L2, not streamed again from L3 for every 16 weight rows (they were: 437
 * GFLOPS at 512 rows against 714 at 128, one Xeon core). */
#define AMX_SUPER 8
int64_t hs_amx_bf16_rows(const hs_matrix *W, const void *packed, int64_t M, int64_t n0, int64_t n1, float *y,
                         int64_t ldy) {
#if defined(HAVE_AMX)
    tile_config cfg = {.palette = 1};
    for (int t = 0; t < 8; t++)
        cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg); /* per call: torch's oneDNN configures the tiles its own way on the same threads */
    int64_t K = W->K, ldw = K * 2, block_bytes = 16 * K * 2, blocks = (M + 15) / 16;
    int64_t n_end = n0 + (n1 - n0) / 16 * 16;
    float sums[AMX_MB][16][16] __attribute__((aligned(64)));
    for (int64_t super = 0; super < blocks; super += AMX_SUPER) {
        int64_t super_end = super + AMX_SUPER < blocks ? super + AMX_SUPER : blocks;
        for (int64_t n = n0; n < n_end; n += 16) {
            const char *w = (const char *)W->w + n * ldw;
            for (int64_t b = super; b < super_end; b += AMX_MB) {
                const char *bp = (const char *)packed + b * block_bytes;
                int in_pass = super_end - b < AMX_MB ? (int)(super_end - b) : AMX_MB;
                /* No software prefetch: neither each row's lines 4-32 steps ahead (into L1) nor the next 16
                 * rows in address order (into L2) moved a Xeon guest's 128 Qwen3 experts at 16-32 rows (7.4-7.8
                 * GB/s on one core, against 9.2 for the one-row vector loop). */
                switch (in_pass) {
                case 1: tile_pass(w, ldw, bp, block_bytes, K, 1); break;
                case 2: tile_pass(w, ldw, bp, block_bytes, K, 2); break;
                default: tile_pass(w, ldw, bp, block_bytes, K, 3); break;
                }
                _tile_stored(0, sums[0], 64);
                if (in_pass > 1)
                    _tile_stored(1, sums[1], 64);
                if (in_pass > 2)
                    _tile_stored(2, sums[2], 64);
                for (int p = 0; p < in_pass; p++) {
                    int64_t m = (b + p) * 16, mm = M - m < 16 ? M - m : 16;
                    store_sums((const float(*)[16])sums[p], mm, y + m * ldy, ldy, n, 16, W->bias);
                }
            }
        }
    }
    _tile_release();
    return n_end;
#else
    (void)W, (void)packed, (void)M, (void)y, (void)ldy, (void)n1;
    return n0;
#endif
}

#if defined(HAVE_AMX)
static inline __attribute__((always_inline)) void scale_block(__m512 acc[16], const int32_t sums[16][16],
                                                              const float *const d[16], int64_t b) {
    for (int r = 0; r < 16; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[r])), _mm512_set1_ps(d[r][b]), acc[r]);
}

/* One int8 weight tile (16 rows, w: its [K / 4][16][4] bytes, tile B as it lies) against one packed block of
 * activation rows (tile A, [16][K]): per block of QB inputs the exact int32 sums of q * (w + 128), then in fp32
 * acc += sums * d, block by block, and y = scale * (acc - corr) + bias: rows.c's q8_tile's operations in its
 * order, so the results are its bits. */
static void q8_block(const uint8_t *w, const float *ws, const float *bias, int valid, const int8_t *xq,
                     const acts *a, const int64_t *rows, int64_t mm, float *y, int64_t ldy) {
    int64_t K = a->K, blocks = K / QB;
    int32_t sums[AMX_SUM_RING][16][16] __attribute__((aligned(64)));
    const float *d[16];
    __m512 acc[16];
    for (int r = 0; r < 16; r++) {
        d[r] = a->d + rows[r < mm ? r : 0] * blocks; /* rows past mm: zeros, summed and dropped */
        acc[r] = _mm512_setzero_ps();
    }
    /* Two sum tiles in turn, so the tile unit multiplies one block while the other's sums are stored; each
     * block's sums are scaled AMX_SUM_LAG blocks after they were stored, once the stores have reached the cache
     * (read back at once, every block waited on its tile store). */
#define Q8_TILE_BLOCK(c, x, wt, blk)                                                                          \
    do {                                                                                                       \
        _tile_zero(c);                                                                                         \
        _tile_loadd(x, xq + (blk) * QB, K);                                                                    \
        _tile_loadd(wt, w + (blk) * QB * TILE, 64);                                                            \
        _tile_dpbsud(c, x, wt);                                                                                \
        _tile_stored(c, sums[(blk) % AMX_SUM_RING], 64);                                                        \
    } while (0)
    for (int64_t b = 0; b < blocks; b++) {
        if (b % 2 == 0) {
            if (AMX_INT_PREFETCH > 0)
                for (int line = 0; line < 2 * QB * TILE; line += 64)
                    _mm_prefetch((const char *)(w + b * QB * TILE) + AMX_INT_PREFETCH + line, AMX_INT_PREFETCH_HINT);
            Q8_TILE_BLOCK(0, 1, 2, b);
        } else {
            Q8_TILE_BLOCK(3, 4, 5, b);
        }
        if (b >= AMX_SUM_LAG)
            scale_block(acc, sums[(b - AMX_SUM_LAG) % AMX_SUM_RING], d, b - AMX_SUM_LAG);
    }
#undef Q8_TILE_BLOCK
    for (int64_t b = blocks > AMX_SUM_LAG ? blocks - AMX_SUM_LAG : 0; b < blocks; b++)
        scale_block(acc, sums[b % AMX_SUM_RING], d, b);
    __mmask16 keep = (__mmask16)((1u << valid) - 1);
    __m512 scale = _mm512_maskz_loadu_ps(keep, ws), add = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int64_t r = 0; r < mm; r++)
        _mm512_mask_storeu_ps(y + r * ldy, keep,
                              _mm512_fmadd_ps(scale, _mm512_sub_ps(acc[r], _mm512_set1_ps(a->corr[rows[r]])), add));
}
#endif

/* Weight rows [n0, n1) (whole tiles but a last one past N) of an int8 W against the M activation rows of `a`
 * (rows[m]), packed at a->amx. */
void hs_amx_q8_rows(const hs_matrix *W, const acts *a, const int64_t *rows, int64_t M, int64_t n0, int64_t n1,
                    float *y, int64_t ldy) {
#if defined(HAVE_AMX)
    amx_configure_int_tiles();
    int64_t K = W->K;
    for (int64_t b = 0; b * 16 < M; b++) {
        const int8_t *xq = (const int8_t *)a->amx + b * 16 * K;
        int64_t mm = M - b * 16 < 16 ? M - b * 16 : 16;
        for (int64_t n = n0; n < n1; n += TILE) {
            int valid = (int)(W->N - n < TILE ? W->N - n : TILE);
            q8_block((const uint8_t *)W->w + n * K, (const float *)W->scales + n, W->bias ? W->bias + n : NULL,
                     valid, xq, a, rows + b * 16, mm, y + b * 16 * ldy + n, ldy);
        }
    }
    _tile_release();
#else
    (void)W, (void)a, (void)rows, (void)M, (void)n0, (void)n1, (void)y, (void)ldy;
#endif
}
