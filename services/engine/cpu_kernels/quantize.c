/* Round-to-nearest int8 and int4 quantization from fp32 or bf16 rows, a tile of 16 rows a work item on the
 * pool: into matmul.c's packed layouts (hs_quantize, the CPU engine's load), or into plain codes, scales and
 * zeros (hs_quantize_grid: quant/groupwise.py's quantize_int4 and quantize_int8, whose codes the CUDA kernels'
 * layouts are packed from).
 *
 * Why: quantizing with torch ops made a dozen temporaries per block of rows (a float copy, the groups less
 * their minimum, the rounded codes, their int32 and uint8 forms, the nibble pairs, a permuted copy, the scales
 * stacked and permuted), each page-faulted in and out again: a 30B-parameter bf16 checkpoint's int4 load spent
 * 336 s, two thirds of it in the kernel. Here each row's values are read once and the results written once.
 *
 * The arithmetic is groupwise.py's torch ops, op for op, each rounded as torch rounds it (one fp32 operation
 * at a time, round half to even, bf16 scales rounded to nearest even), so the bits are the same
 * (test_cpu_formats and test_quant check it). No fused multiply-add can change them: the one product,
 * 8 * scale, is exact. */
#include <math.h>

#include "hs.h"

enum { SRC_F32 = 0, SRC_BF16 = 1 };

typedef struct {
    const char *src;
    int64_t src_type, ld; /* ld: the source's row stride, in elements */
    int64_t N, K, group;
    uint8_t *w;       /* hs_quantize: the packed weight */
    float *scales;    /* hs_quantize, int8: [tiles * TILE]; hs_quantize_grid: int8 [N], int4 [N, K / group] */
    void *codes;      /* hs_quantize_grid: int8 int8_t [N, K], int4 uint8_t [N, K] */
    float *zeros;     /* hs_quantize_grid, int4: [N, K / group] */
} quant_job;

/* Row n's values k0..k0+n_k as fp32 (bf16 widens exactly). */
static void read_row(const quant_job *j, int64_t n, int64_t k0, int64_t n_k, float *out) {
    if (j->src_type == SRC_F32) {
        memcpy(out, (const float *)j->src + n * j->ld + k0, n_k * sizeof *out);
        return;
    }
    const uint16_t *row = (const uint16_t *)j->src + n * j->ld + k0;
    for (int64_t k = 0; k < n_k; k++) {
        uint32_t u = (uint32_t)row[k] << 16;
        memcpy(out + k, &u, 4);
    }
}

/* torch's clamp_min(x, 1e-10): a NaN stays NaN. */
static float at_least_tiny(float x) { return x < 1e-10f ? 1e-10f : x; }

/* Row n's int4 group gi: its codes q[0..g) in 0..15, *scale and *zero (w ~= (q - 8) * scale + zero). */
static void q4_group(const quant_job *j, int64_t n, int64_t gi, uint8_t *q, float *scale, float *zero) {
    int64_t g = j->group;
    float x[128];
    read_row(j, n, gi * g, g, x);
    /* Eight running minima and maxima, then theirs: an elementwise select vectorises where a reduction through
     * one does not (min and max are exact in any order). */
    float lo8[8], hi8[8];
    for (int64_t l = 0; l < 8; l++)
        lo8[l] = hi8[l] = x[l];
    for (int64_t k = 8; k < g; k += 8)
        for (int64_t l = 0; l < 8; l++) {
            lo8[l] = x[k + l] < lo8[l] ? x[k + l] : lo8[l];
            hi8[l] = x[k + l] > hi8[l] ? x[k + l] : hi8[l];
        }
    float lo = lo8[0], hi = hi8[0];
    for (int64_t l = 1; l < 8; l++) {
        lo = lo8[l] < lo ? lo8[l] : lo;
        hi = hi8[l] > hi ? hi8[l] : hi;
    }
    float s = at_least_tiny((hi - lo) / 15.0f);
    for (int64_t k = 0; k < g; k++) {
        float v = rintf((x[k] - lo) / s);
        q[k] = (uint8_t)(v < 0.0f ? 0.0f : v > 15.0f ? 15.0f : v);
    }
    *scale = s;
    *zero = lo + 8.0f * s;
}

/* The largest |value| of row n as torch's amax of abs gives it (a NaN wins): on the bits, with the sign masked,
 * which order like the magnitudes and put NaNs above infinity (an integer max vectorises; a float one does not). */
static float row_abs_max(const quant_job *j, int64_t n) {
    uint32_t top = 0;
    if (j->src_type == SRC_F32) {
        const uint32_t *row = (const uint32_t *)j->src + n * j->ld;
        for (int64_t k = 0; k < j->K; k++) {
            uint32_t u = row[k] & 0x7fffffffu;
            top = u > top ? u : top;
        }
    } else {
        const uint16_t *row = (const uint16_t *)j->src + n * j->ld;
        uint16_t top16 = 0;
        for (int64_t k = 0; k < j->K; k++) {
            uint16_t u = row[k] & 0x7fffu;
            top16 = u > top16 ? u : top16;
        }
        top = (uint32_t)top16 << 16;
    }
    float amax;
    memcpy(&amax, &top, 4);
    return amax;
}

/* Row n's int8 scale (w ~= q * scale). */
static float q8_scale(const quant_job *j, int64_t n) { return at_least_tiny(row_abs_max(j, n) / 127.0f); }

/* Row n's int8 codes k0..k0+n_k (at most 256) into q, in -127..127. */
static void q8_codes(const quant_job *j, int64_t n, int64_t k0, int64_t n_k, float scale, int8_t *q) {
    float x[256];
    read_row(j, n, k0, n_k, x);
    for (int64_t k = 0; k < n_k; k++) {
        float v = rintf(x[k] / scale);
        q[k] = (int8_t)(v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v);
    }
}

/* One tile of int4: per group, its nibbles [g/8][TILE][4] (inputs c*8+i low, c*8+4+i high), then bf16 scales
 * [TILE] and zeros [TILE] (formats.from_int4's layout); rows past N are q = 8, scale and zero 0. */
static void q4_tile_item(void *ctx, int64_t tile) {
    const quant_job *j = ctx;
    int64_t g = j->group, groups = j->K / g, bytes = q4_group_bytes(g);
    uint8_t q[128];
    for (int64_t gi = 0; gi < groups; gi++) {
        uint8_t *dst = j->w + (tile * groups + gi) * bytes;
        uint16_t *scale_out = (uint16_t *)(dst + g / 2 * TILE), *zero_out = scale_out + TILE;
        for (int64_t r = 0; r < TILE; r++) {
            int64_t n = tile * TILE + r;
            float scale = 0.0f, zero = 0.0f;
            if (n < j->N)
                q4_group(j, n, gi, q, &scale, &zero);
            else
                memset(q, 8, g);
            for (int64_t c = 0; c < g / 8; c++)
                for (int64_t i = 0; i < 4; i++)
                    dst[(c * TILE + r) * 4 + i] = (uint8_t)(q[c * 8 + i] | q[c * 8 + 4 + i] << 4);
            scale_out[r] = f32_to_bf16(scale);
            zero_out[r] = f32_to_bf16(zero);
        }
    }
}

/* One tile of int8: codes + 128 as [K/4][TILE][4] (formats.from_int8's layout), one fp32 scale a row; rows past
 * N are 128 with scale 0. */
static void q8_tile_item(void *ctx, int64_t tile) {
    const quant_job *j = ctx;
    int64_t K = j->K;
    uint8_t *dst = j->w + tile * TILE * K;
    int8_t q[256];
    for (int64_t r = 0; r < TILE; r++) {
        int64_t n = tile * TILE + r;
        if (n >= j->N) {
            for (int64_t c = 0; c < K / 4; c++)
                memset(dst + (c * TILE + r) * 4, 128, 4);
            j->scales[n] = 0.0f;
            continue;
        }
        float scale = q8_scale(j, n);
        for (int64_t k0 = 0; k0 < K; k0 += 256) { /* K is a multiple of 64 */
            int64_t n_k = K - k0 < 256 ? K - k0 : 256;
            q8_codes(j, n, k0, n_k, scale, q);
            for (int64_t c = 0; c < n_k / 4; c++)
                for (int64_t i = 0; i < 4; i++)
                    dst[((k0 / 4 + c) * TILE + r) * 4 + i] = (uint8_t)(q[c * 4 + i] + 128);
        }
        j->scales[n] = scale;
    }
}

/* Tile `tile`'s rows into plain codes, scales and zeros (hs_quantize_grid). */
static void grid_item(void *ctx, int64_t tile) {
    const quant_job *j = ctx;
    int64_t end = (tile + 1) * TILE < j->N ? (tile + 1) * TILE : j->N;
    for (int64_t n = tile * TILE; n < end; n++) {
        if (j->group) { /* int4 */
            int64_t groups = j->K / j->group;
            for (int64_t gi = 0; gi < groups; gi++)
                q4_group(j, n, gi, (uint8_t *)j->codes + n * j->K + gi * j->group, j->scales + n * groups + gi,
                         j->zeros + n * groups + gi);
            continue;
        }
        float scale = q8_scale(j, n);
        for (int64_t k0 = 0; k0 < j->K; k0 += 256)
            q8_codes(j, n, k0, j->K - k0 < 256 ? j->K - k0 : 256, scale, (int8_t *)j->codes + n * j->K + k0);
        j->scales[n] = scale;
    }
}

static int source_ok(int64_t src_type, int64_t N, int64_t K) {
    return (src_type == SRC_F32 || src_type == SRC_BF16) && N >= 1 && K >= 1;
}

static int group_ok(int64_t group, int64_t K) { return group >= 8 && group <= 128 && group % 8 == 0 && K % group == 0; }

/* Quantizes src [N, K] (fp32 or bf16, row stride ld elements) into w: format Q4 (group 8..128, a multiple of
 * 8) or Q8 (scales: [N rounded up to TILE]). Returns 0, or -1 for what it does not take. */
int hs_quantize(int64_t format, const void *src, int64_t src_type, int64_t ld, int64_t N, int64_t K, int64_t group,
                void *w, float *scales) {
    if (!source_ok(src_type, N, K) || K % 64 || (format == Q4 ? !group_ok(group, K) : format != Q8 || !scales))
        return -1;
    quant_job job = {src, src_type, ld, N, K, group, w, scales, NULL, NULL};
    hs_parallel(format == Q4 ? q4_tile_item : q8_tile_item, &job, (N + TILE - 1) / TILE);
    return 0;
}

/* Quantizes src [N, K] into plain grids: group > 0: int4 codes uint8 [N, K] in 0..15, scales and zeros fp32
 * [N, K / group]; group 0: int8 codes int8 [N, K], scales fp32 [N] (zeros unused). Returns 0, or -1. */
int hs_quantize_grid(const void *src, int64_t src_type, int64_t ld, int64_t N, int64_t K, int64_t group,
                     void *codes, float *scales, float *zeros) {
    if (!source_ok(src_type, N, K) || (group && (!group_ok(group, K) || !zeros)))
        return -1;
    quant_job job = {src, src_type, ld, N, K, group, NULL, scales, codes, zeros};
    hs_parallel(grid_item, &job, (N + TILE - 1) / TILE);
    return 0;
}
