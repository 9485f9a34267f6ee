/* y[M, N] = x[M, K] @ W[N, K]^T for weights in four formats, on the thread pool: the dense layers and the
 * experts of a CPU model, and the host's experts in hybrid execution.
 *
 * Decode is bound by reading W, so each format is read once per call, in place, at the width of one cache
 * line per vector: every output row is a dot product over K of one contiguous weight row, and that row serves
 * up to MB activation rows from registers. Formats (the layouts cpu_kernels/formats.py packs):
 *   F32  float [N, K]
 *   BF16 bf16 [N, K]; activations rounded to bf16 (vdpbf16ps where the CPU has it, as llama.cpp's BF16 does)
 *   Q8   uint8 [N, K] holding w + 128, one float scale per row; activations int8 per block of 64
 *   Q4   uint8 tiles of 16 rows, group after group (G = K / group): the group's nibbles (byte (i, t) of each 8
 *        inputs holds row i's input t low, 4 + t high), then its bf16 scale and zero per row
 *        (w = (q - 8) * scale + zero); activations int8 per group.
 * The integer formats multiply unsigned weights by signed int8 activations (vpdpbusd); the weights' offset
 * (128, or 8 with the zero) is folded into one correction per activation row or group, computed once.
 * Widths: K a multiple of 64 (of the group for Q4), any N. */
#include <math.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


#include "hs.h"

/* ---- activation preparation (once per call, O(M K)) ---- */

#if defined(__AVX512F__)
#define QLANES 16
/* One block of quantize_row, 16 lanes at a time: the same operations in the same order (vcvtps2dq rounds to
 * nearest even as lrintf does), so the same bits; the scalar loop took 2 ns an element, 9 us of a K = 4096 call. */
static inline int32_t quantize_block(const float *xb, int64_t block, int8_t *q, float *scale) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < block; i += 16)
        amax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb + i)), amax); /* NaN lanes keep amax, as fmaxf */
    float m = _mm512_reduce_max_ps(amax);
    *scale = m / 127.0f;
    __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
    const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = 0; i < block; i += 16) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), inv));
        v = _mm512_max_epi32(_mm512_min_epi32(v, hi), lo);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(v));
        sum = _mm512_add_epi32(sum, v);
    }
    return _mm512_reduce_add_epi32(sum);
}
#elif defined(__AVX2__)
#define QLANES 8
/* The same at 8 lanes (AVX2 has no vpmovdb: the clamped lanes are packed with saturating packs, exact here). */
static inline int32_t quantize_block(const float *xb, int64_t block, int8_t *q, float *scale) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < block; i += 8) /* NaN lanes keep amax (vmaxps returns its second operand), as fmaxf */
        amax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + i), magnitude), amax);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    *scale = m / 127.0f;
    __m256 inv = _mm256_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = 0; i < block; i += 8) {
        __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), inv));
        v = _mm256_max_epi32(_mm256_min_epi32(v, hi), lo);
        __m128i v16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi16(v16, v16));
        sum = _mm256_add_epi32(sum, v);
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
}
#endif

static void quantize_row(const float *x, int64_t K, int64_t block, int8_t *q, float *d, float *dsum) {
#if defined(QLANES)
    if (block % QLANES == 0) {
        for (int64_t b = 0; b < K / block; b++) {
            float scale;
            int32_t sum = quantize_block(x + b * block, block, q + b * block, &scale);
            d[b] = scale;
            dsum[b] = scale * (float)sum;
        }
        return;
    }
#endif
    for (int64_t b = 0; b < K / block; b++) {
        const float *xb = x + b * block;
        float amax = 0.0f;
        for (int64_t i = 0; i < block; i++)
            amax = fmaxf(amax, fabsf(xb[i]));
        float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int64_t i = 0; i < block; i++) {
            int32_t v = (int32_t)lrintf(xb[i] * inv);
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            q[b * block + i] = (int8_t)v;
            sum += v;
        }
        d[b] = scale;
        dsum[b] = scale * (float)sum;
    }
}

static int64_t act_block(const hs_matrix *W) { return W->format == Q4 ? W->group : QB; }

/* Bytes of scratch hs_acts_init needs for M rows of width K. */
int64_t hs_acts_bytes(const hs_matrix *W, int64_t M) {
    int64_t K = W->K;
    if (W->format == F32)
        return 0;
    if (W->format == BF16)
        return M * K * 2 + 64;
    int64_t blocks = K / act_block(W);
    return M * K + 2 * M * blocks * 4 + M * 4 + 4 * 64;
}

char *align64(char *p) { return (char *)(((uintptr_t)p + 63) & ~(uintptr_t)63); }

void hs_acts_init(const hs_matrix *W, const float *x, int64_t ldx, int64_t M, char *scratch, acts *a) {
    int64_t K = W->K, blocks = K / act_block(W);
    memset(a, 0, sizeof *a);
    a->M = M;
    a->K = K;
    a->f32 = x;
    a->ld = ldx;
    a->format = W->format;
    a->block = act_block(W);
    if (W->format == BF16)
        a->bf16 = (uint16_t *)align64(scratch);
    if (W->format != Q8 && W->format != Q4)
        return;
    a->q = (int8_t *)align64(scratch);
    a->d = (float *)align64((char *)(a->q + M * K));
    a->dsum = (float *)align64((char *)(a->d + M * blocks));
    a->corr = (float *)align64((char *)(a->dsum + M * blocks));
}

/* Converts activation rows [m0, m1) (x's, as hs_acts_init was given) to the form the format reads. */
void hs_acts_fill(acts *a, int64_t m0, int64_t m1) {
    int64_t K = a->K, blocks = a->q ? K / a->block : 0;
    for (int64_t m = m0; m < m1; m++) {
        const float *x = a->f32 + m * a->ld;
        if (a->bf16) {
            for (int64_t k = 0; k < K; k++)
                a->bf16[m * K + k] = f32_to_bf16(x[k]);
        } else if (a->q) {
            quantize_row(x, K, a->block, a->q + m * K, a->d + m * blocks, a->dsum + m * blocks);
            float c = 0.0f;
            for (int64_t b = 0; b < blocks; b++)
                c += a->dsum[m * blocks + b];
            a->corr[m] = 128.0f * c;
        }
    }
}

/* ---- dense: one matrix ---- */

typedef struct {
    const hs_matrix *W;
    const acts *a;
    const int64_t *rows;
    float *y;
    int64_t ldy;
} linear_job;

static void linear_item(void *ctx, int64_t item) {
    linear_job *j = ctx;
    hs_rows_item(j->W, j->a, j->rows, j->a->M, item, j->y, j->ldy);
}

/* On AMX tiles an item is AMX_ITEM weight rows against every activation row: amx.c keeps a block of
 * activations in L2 across the item's weight tiles, so more rows an item read them fewer times. */
#define AMX_ITEM 64
static void amx_linear_item(void *ctx, int64_t item) {
    linear_job *j = ctx;
    int64_t n0 = item * AMX_ITEM, n1 = n0 + AMX_ITEM < j->W->N ? n0 + AMX_ITEM : j->W->N;
    hs_rows_block(j->W, j->a, j->rows, j->a->M, n0, n1, j->y, j->ldy);
}

static __thread char *tls_scratch;
static __thread int64_t tls_scratch_bytes;
static __thread int64_t *tls_rows;
static __thread int64_t tls_rows_len;

char *hs_scratch(int64_t bytes) {
    if (bytes > tls_scratch_bytes) {
        free(tls_scratch);
        tls_scratch = malloc(bytes);
        tls_scratch_bytes = tls_scratch ? bytes : 0;
    }
    return tls_scratch;
}

const int64_t *hs_identity_rows(int64_t M) {
    if (M > tls_rows_len) {
        free(tls_rows);
        tls_rows = malloc(M * sizeof *tls_rows);
        if (!tls_rows) {
            tls_rows_len = 0;
            return NULL;
        }
        for (int64_t i = 0; i < M; i++)
            tls_rows[i] = i;
        tls_rows_len = M;
    }
    return tls_rows;
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T + bias. Returns 0, or -1 when out of memory. */
int hs_linear(const hs_matrix *W, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t M) {
    int amx = hs_amx_wanted(W, M);
    int64_t acts_bytes = (hs_acts_bytes(W, M) + 63) & ~(int64_t)63;
    char *buf = hs_scratch(acts_bytes + (amx ? hs_amx_packed_bytes(W->format, M, W->K) + 64 : 0));
    const int64_t *rows = hs_identity_rows(M);
    if ((W->format != F32 && !buf) || !rows)
        return -1;
    acts a;
    hs_acts_init(W, x, ldx, M, buf, &a);
    /* bf16's tiles take whole blocks of 16 weight rows from the fp32 rows, the vector loops the rest from bf16 ones;
     * int8's tiles read the quantized rows */
    if (!amx || W->format != BF16 || W->N % 16)
        hs_acts_fill(&a, 0, M);
    if (amx) {
        void *packed = align64(buf + acts_bytes);
        hs_amx_pack(&a, rows, M, packed);
        a.amx = packed;
    }
    linear_job job = {W, &a, rows, y, ldy};
    if (amx)
        hs_parallel(amx_linear_item, &job, (W->N + AMX_ITEM - 1) / AMX_ITEM);
    else
        hs_parallel(linear_item, &job, hs_items(W, M));
    return 0;
}
