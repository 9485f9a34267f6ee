/* Native fp32 CPU kernels for the decode step's two biggest blocks (see cpu_kernels/__init__.py for why).
 *
 * Plain C with GCC/Clang vector extensions: 16-float vectors compile to one zmm op on AVX-512, two ymm ops on
 * AVX2, four NEON ops on arm64. Built at first use with -O3 -march=native. Single-threaded (the serving core runs
 * one torch thread on small boxes; callers take torch's path otherwise), but for decode attention, whose
 * (sequence, KV head) items run on the kernels' pool (threadpool.c): at one row its reads grow with the
 * context while the matrices' do not.
 *
 * Shapes the callers guarantee: every row length these loops vectorise over (the expert GEMMs' N, head_dim)
 * is a multiple of 16; all tensors are contiguous except q, whose strides are passed.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "hs.h"

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
#define VL 16

static inline v16 vload(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 vsplat(float x) { return (v16){0} + x; }
static inline v16 vselect(i16 mask, v16 a, v16 b) { return (v16)((mask & (i16)a) | (~mask & (i16)b)); }
static inline v16 vmin(v16 a, v16 b) { return vselect(a < b, a, b); }
static inline v16 vmax(v16 a, v16 b) { return vselect(a > b, a, b); }

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline float hsum_v8(v8 a) { /* a tree: a sequential sum of lanes is one long dependency chain */
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline float hsum(v16 v) {
    return hsum_v8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

static inline float hmax(v16 v) {
    float m = v[0];
    for (int i = 1; i < VL; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* Loops that keep many accumulators work in the widest vector the core has (vn: VW floats): 16-float vectors
 * held in arrays spill on AVX2, whose 16 ymm registers hold 8 of them, and GCC then moves each spilled half
 * through general registers (decode attention on Zen 2: 5 us per position at Qwen3's 32 q / 4 kv heads). */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vn __attribute__((vector_size(VW * 4)));
static inline vn vnload(const float *p) { vn v; memcpy(&v, p, sizeof v); return v; }
static inline void vnstore(float *p, vn v) { memcpy(p, &v, sizeof v); }

static inline v8 fold8(vn v) { /* a v8 whose lane sum is v's */
#if VW == 16
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    return v;
#endif
}

/* The lane sums of 8 vectors: out[j] = sum of a_j's lanes (pairwise adds, the transpose of a reduction tree). */
static inline v8 hsum8(v8 a0, v8 a1, v8 a2, v8 a3, v8 a4, v8 a5, v8 a6, v8 a7) {
#define HADD(x, y) (__builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + \
                    __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15))
    v8 t0 = HADD(a0, a1), t1 = HADD(a2, a3), t2 = HADD(a4, a5), t3 = HADD(a6, a7);
    v8 u0 = HADD(t0, t1), u1 = HADD(t2, t3); /* [s0 s1 s2 s3 | s0' s1' s2' s3'] in two halves each */
#undef HADD
    return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* exp(x) to about 1 ulp on [-87.3, 88.3] (Cephes' expf polynomial); below that range it returns ~1e-38, not 0. */
static inline v16 vexp(v16 x) {
    x = vmax(vmin(x, vsplat(88.3762626647949f)), vsplat(-87.3365478515625f));
    const v16 magic = vsplat(12582912.0f); /* 1.5 * 2^23: adding it rounds to the nearest integer */
    v16 t = x * 1.44269504088896341f + magic;
    v16 n = t - magic;
    i16 ni = (i16)t - (i16)magic;
    v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = vsplat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    v16 y = p * r * r + r + 1.0f;
    return (v16)((i16)y + (ni << 23));
}

/* y[M, N] = x[M, K] @ w[K, N] for a few rows (M <= ROWS), K and N multiples of 16, w row-major.
 * The weight is streamed once, DEPTH rows at a time, each run sequential and prefetched PREFETCH rows ahead
 * (the hardware prefetchers alone left a core at ~11 GB/s); y's rows take DEPTH updates per load and store. */
#define ROWS 8
#define COLS 4096
#define DEPTH 8
#define PREFETCH 16
/* Software prefetches go to L2 (prefetcht1): into L1 they queued on its few miss buffers and capped a core
 * at ~16 GB/s; into L2, 24 (1 row a token) to 30% (8 rows) faster per expert. */
#define TO_L2 2
static void gemm_rows(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t M, int64_t K,
                      int64_t N) {
    for (int64_t n0 = 0; n0 < N; n0 += COLS) {
        int64_t n1 = n0 + COLS < N ? n0 + COLS : N;
        for (int64_t m = 0; m < M; m++) memset(y + m * ldy + n0, 0, (size_t)(n1 - n0) * sizeof(float));
        for (int64_t k = 0; k < K; k += DEPTH) {
            const float *wk = w + k * N;
            int prefetch = k + PREFETCH + DEPTH <= K;
            for (int64_t n = n0; n < n1; n += VL) {
                v16 a[DEPTH];
#pragma GCC unroll 8
                for (int d = 0; d < DEPTH; d++) a[d] = vload(wk + d * N + n);
                if (prefetch) {
#pragma GCC unroll 8
                    for (int d = 0; d < DEPTH; d++) __builtin_prefetch(wk + (PREFETCH + d) * N + n, 0, TO_L2);
                }
                for (int64_t m = 0; m < M; m++) {
                    const float *xm = x + m * ldx + k;
                    v16 sum = xm[0] * a[0];
#pragma GCC unroll 8
                    for (int d = 1; d < DEPTH; d++) sum += xm[d] * a[d];
                    float *ym = y + m * ldy + n;
                    vstore(ym, vload(ym) + sum);
                }
            }
        }
    }
}

/* y[M, N] = x[M, K] @ w[K, N] (+ bias[N] when given), ROWS rows per pass over w (K and N multiples of 16). */
void linear_rows_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t K, int64_t N) {
    for (int64_t m = 0; m < M; m += ROWS)
        gemm_rows(x + m * K, K, w, y + m * N, N, M - m < ROWS ? M - m : ROWS, K, N);
    if (bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++) y[m * N + n] += bias[n];
}

static inline v16 silu_times(v16 g, v16 u) { return g / (1.0f + vexp(-g)) * u; }

/* out[i] = silu(gate[i]) * up[i]: every SwiGLU of the kernels (moe.c's too), so the fused and the one-call MoE
 * paths agree bit for bit. Vectorised: libm's scalar expf was 3% of an int4 prefill. A tail (a split expert's
 * activation-only half may have any width) goes through the same vector op, padded. */
void hs_swiglu(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + VL <= n; i += VL)
        vstore(out + i, silu_times(vload(gate + i), vload(up + i)));
    if (i < n) {
        float g[VL] = {0}, u[VL] = {0}, h[VL];
        memcpy(g, gate + i, (size_t)(n - i) * sizeof(float));
        memcpy(u, up + i, (size_t)(n - i) * sizeof(float));
        vstore(h, silu_times(vload(g), vload(u)));
        memcpy(out + i, h, (size_t)(n - i) * sizeof(float));
    }
}

/* act[m, I] = silu(gate) * up for m rows of gu [m, 2I] (gate columns, then up). */
static void swiglu_rows(const float *gu, float *act, int64_t m, int64_t I) {
    for (int64_t r = 0; r < m; r++)
        hs_swiglu(gu + r * 2 * I, gu + r * 2 * I + I, act + r * I, I);
}

/* Routed experts for a few tokens: out[T, H] = sum over each token's top_k experts of weight * SwiGLU(x).
 * w13: [E, H, 2I] (gate columns, then up); w2: [E, I, H]. Tokens are grouped per expert here (a scan of
 * ids per expert), each expert's weights read once per ROWS of its tokens.
 * scratch: ROWS * (H + 3I + H) floats; rows: T * top_k int64. Returns 0, or -1 on an expert id out of range. */
int moe_swiglu_f32(const float *x, const int64_t *ids, const float *weights, int64_t T, int64_t top_k,
                   const float *w13, const float *w2, int64_t E, int64_t H, int64_t I, float *out,
                   float *scratch, int64_t *rows) {
    float *xs = scratch, *gu = xs + ROWS * H, *act = gu + ROWS * 2 * I, *ys = act + ROWS * I;
    int64_t assignments = T * top_k;
    for (int64_t a = 0; a < assignments; a++)
        if (ids[a] < 0 || ids[a] >= E) return -1;
    memset(out, 0, (size_t)(T * H) * sizeof(float));
    for (int64_t e = 0; e < E; e++) {
        int64_t count = 0;
        for (int64_t a = 0; a < assignments; a++)
            if (ids[a] == e) rows[count++] = a;
        const float *gate_up = w13 + e * H * 2 * I, *down = w2 + e * I * H;
        for (int64_t c0 = 0; c0 < count; c0 += ROWS) {
            int64_t m_rows = count - c0 < ROWS ? count - c0 : ROWS;
            for (int64_t m = 0; m < m_rows; m++)
                memcpy(xs + m * H, x + (rows[c0 + m] / top_k) * H, (size_t)H * sizeof(float));
            gemm_rows(xs, H, gate_up, gu, 2 * I, m_rows, H, 2 * I);
            swiglu_rows(gu, act, m_rows, I);
            gemm_rows(act, I, down, ys, H, m_rows, I, H);
            for (int64_t m = 0; m < m_rows; m++) {
                int64_t a = rows[c0 + m];
                float wgt = weights[a], *o = out + (a / top_k) * H;
                const float *ym = ys + m * H;
                for (int64_t h = 0; h < H; h += VL) vstore(o + h, vload(o + h) + vload(ym + h) * wgt);
            }
        }
    }
    return 0;
}

#define KEYS 8 /* keys per block of the score loop: 8 accumulators, 8 lane sums from one hsum8 */
#define VCHUNK 8 /* value vectors summed per pass over the scores: 8 accumulators */

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *tables, *lens;
    int64_t q_sb, q_sh, S, max_blocks, block_size, Hq, Hkv, D;
    float scale;
    float *out;
    _Atomic int failed; /* an item found no memory for its scores */
} attention_job;

/* One sequence's query heads of one KV head group: their scores, softmax and weighted values. */
static void attend_item(void *ctx, int64_t item) {
    attention_job *j = ctx;
    int64_t b = item / j->Hkv, h = item % j->Hkv, G = j->Hq / j->Hkv, D = j->D, S = j->S;
    int64_t block_size = j->block_size, L = j->lens[b], q_sh = j->q_sh, Hq = j->Hq;
    float scale = j->scale, *out = j->out;
    float *scores = (float *)hs_scratch(G * L * (int64_t)sizeof(float)); /* this thread's, grown once */
    if (!scores) {
        j->failed = 1;
        return;
    }
    const int64_t *table = j->tables + b * j->max_blocks;
    const float *q = j->q + b * j->q_sb, *k_cache = j->k_cache, *v_cache = j->v_cache;
    const float *keys = k_cache + h * S * D, *values = v_cache + h * S * D;
    const float *qh = q + h * G * q_sh;
    /* Walked a KV block at a time: its rows are contiguous, and no division per position. */
    for (int64_t t0 = 0; t0 < L; t0 += block_size) {
        int64_t n = L - t0 < block_size ? L - t0 : block_size;
        const float *block_keys = keys + table[t0 / block_size] * block_size * D;
        const float *block_values = values + table[t0 / block_size] * block_size * D;
        /* Blocks sit anywhere in the cache, a page or more each: the prefetchers stop at page edges, so
         * the next block's keys and this block's values (read after the softmax) are fetched from here. */
        const float *next_keys = t0 + block_size < L ? keys + table[t0 / block_size + 1] * block_size * D
                                                     : NULL;
        int64_t i = 0;
        for (; i + KEYS <= n; i += KEYS) {
            const float *k = block_keys + i * D;
            for (int64_t d = 0; d < KEYS * D; d += 16) {
                if (next_keys) __builtin_prefetch(next_keys + i * D + d, 0, TO_L2);
                __builtin_prefetch(block_values + i * D + d, 0, TO_L2);
            }
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qh + g * q_sh;
                vn a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
                for (int64_t d = 0; d < D; d += VW) {
                    vn x = vnload(qg + d);
                    a0 += x * vnload(k + d), a1 += x * vnload(k + D + d);
                    a2 += x * vnload(k + 2 * D + d), a3 += x * vnload(k + 3 * D + d);
                    a4 += x * vnload(k + 4 * D + d), a5 += x * vnload(k + 5 * D + d);
                    a6 += x * vnload(k + 6 * D + d), a7 += x * vnload(k + 7 * D + d);
                }
                v8 s = hsum8(fold8(a0), fold8(a1), fold8(a2), fold8(a3), fold8(a4), fold8(a5), fold8(a6),
                             fold8(a7)) * scale;
                memcpy(scores + g * L + t0 + i, &s, sizeof s);
            }
        }
        for (; i < n; i++) {
            const float *k = block_keys + i * D;
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qh + g * q_sh;
                vn dot = {0};
                for (int64_t d = 0; d < D; d += VW) dot += vnload(qg + d) * vnload(k + d);
                scores[g * L + t0 + i] = hsum_v8(fold8(dot)) * scale;
            }
        }
    }
    int64_t t;
    for (int64_t g = 0; g < G; g++) {  /* softmax, in place: max, exp and sum, then 1 / sum at the end */
        float *s = scores + g * L;
        v16 mv = vsplat(s[0]);
        t = 0;
        for (; t + VL <= L; t += VL) mv = vmax(mv, vload(s + t));
        float m = hmax(mv);
        for (; t < L; t++) m = s[t] > m ? s[t] : m;
        v16 sum = vsplat(0.0f);
        for (t = 0; t + VL <= L; t += VL) {
            v16 p = vexp(vload(s + t) - m);
            vstore(s + t, p);
            sum += p;
        }
        float total = hsum(sum);
        if (t < L) {
            v16 tail = vsplat(m);
            for (int64_t i = 0; t + i < L; i++) tail[i] = s[t + i];
            v16 p = vexp(tail - m);
            for (int64_t i = 0; t + i < L; i++) { s[t + i] = p[i]; total += p[i]; }
        }
        float inv = 1.0f / total;
        for (t = 0; t < L; t++) s[t] *= inv;
    }
    float *o = out + (b * Hq + h * G) * D;
    for (int64_t g = 0; g < G; g++) {
        const float *p = scores + g * L;
        for (int64_t c = 0; c < D; c += VCHUNK * VW) { /* o[g] = sum over t of p[t] * value row t */
            vn acc[VCHUNK] = {0};
            int chunk = (int)((D - c) / VW < VCHUNK ? (D - c) / VW : VCHUNK);
            for (int64_t t0 = 0; t0 < L; t0 += block_size) {
                int64_t n = L - t0 < block_size ? L - t0 : block_size;
                const float *v = values + table[t0 / block_size] * block_size * D + c;
                const float *pt = p + t0;
                if (chunk == VCHUNK) {
                    for (int64_t i = 0; i < n; i++, v += D) {
#pragma GCC unroll 8
                        for (int j = 0; j < VCHUNK; j++) acc[j] += pt[i] * vnload(v + j * VW);
                    }
                } else {
                    for (int64_t i = 0; i < n; i++, v += D)
                        for (int j = 0; j < chunk; j++) acc[j] += pt[i] * vnload(v + j * VW);
                }
            }
            for (int j = 0; j < chunk; j++) vnstore(o + g * D + c + j * VW, acc[j]);
        }
    }
}

/* One new token per sequence against its paged context, read in place (no gather).
 * q: [B, Hq, D] at strides (q_sb, q_sh); k_cache, v_cache: [Hkv, S, D]; tables: [B, max_blocks] block ids;
 * lens: [B] context lengths (the new token included); out: [B, Hq, D] contiguous; D a multiple of 16.
 * Each (sequence, KV head) is an item on the kernels' pool (its G = Hq / Hkv query heads share the head's keys
 * and values, their scores in the running thread's scratch), so attention runs on every core, each item
 * computed as one thread did before. Returns 0, -1 on a context length or block outside the cache, -2 when
 * out of memory. */
int paged_decode_attention_f32(const float *q, int64_t q_sb, int64_t q_sh, const float *k_cache,
                               const float *v_cache, int64_t S, const int64_t *tables, int64_t max_blocks,
                               const int64_t *lens, int64_t block_size, int64_t B, int64_t Hq, int64_t Hkv,
                               int64_t D, float scale, float *out) {
    for (int64_t b = 0; b < B; b++) {
        if (lens[b] < 1 || lens[b] > max_blocks * block_size) return -1;
        for (int64_t t = 0; t < lens[b]; t += block_size) {
            int64_t block = tables[b * max_blocks + t / block_size];
            if (block < 0 || (block + 1) * block_size > S) return -1;
        }
    }
    attention_job job = {q, k_cache, v_cache, tables, lens, q_sb, q_sh, S, max_blocks, block_size, Hq, Hkv, D,
                         scale, out, 0};
    hs_parallel(attend_item, &job, B * Hkv);
    return job.failed ? -2 : 0;
}

/* out = x / rms(x) * w per row of H (fp32 throughout, as transformers computes it); with `add`, x = a + add
 * is formed first and written to `sum` (the residual stream), the fused add-and-norm between sublayers. */
void rms_norm_f32(const float *a, const float *add, const float *w, float eps, float *sum, float *out, int64_t T,
                  int64_t H) {
    for (int64_t t = 0; t < T; t++) {
        const float *x = a + t * H;
        if (add) {
            float *s = sum + t * H;
            const float *b = add + t * H;
            for (int64_t h = 0; h < H; h++) s[h] = x[h] + b[h];
            x = s;
        }
        float squares = 0.0f;
        for (int64_t h = 0; h < H; h++) squares += x[h] * x[h];
        float inv = 1.0f / __builtin_sqrtf(squares / (float)H + eps);
        float *o = out + t * H;
        for (int64_t h = 0; h < H; h++) o[h] = x[h] * inv * w[h];
    }
}

/* Rotates the q and k heads of each token's fused projection row in place (rotate-half RoPE; cos and sin
 * tables [max_positions, D]) and writes k and v into the head-major caches [Hkv, S, D] at the token's slot. */
/* q_norm / k_norm (NULL: none): Qwen3's RMSNorm of each head, applied before the rotation. */
int rope_write_kv_f32(float *qkv, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float *cos_table,
                      const float *sin_table, int64_t max_positions, const int64_t *positions, const int64_t *slots,
                      float *k_cache, float *v_cache, int64_t S, const float *q_norm, const float *k_norm,
                      float eps) {
    int64_t half = D / 2, width = (Hq + 2 * Hkv) * D;
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_positions || slots[t] < 0 || slots[t] >= S) return -1;
    for (int64_t t = 0; t < T; t++) {
        float *row = qkv + t * width;
        const float *c = cos_table + positions[t] * D, *s = sin_table + positions[t] * D;
        for (int64_t head = 0; head < Hq + Hkv; head++) {
            float *x = row + head * D;
            const float *norm = head < Hq ? q_norm : k_norm;
            if (norm) rms_norm_f32(x, NULL, norm, eps, NULL, x, 1, D); /* in place: one row of D */
            for (int64_t i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
        for (int64_t h = 0; h < Hkv; h++) {
            memcpy(k_cache + (h * S + slots[t]) * D, row + (Hq + h) * D, (size_t)D * sizeof(float));
            memcpy(v_cache + (h * S + slots[t]) * D, row + (Hq + Hkv + h) * D, (size_t)D * sizeof(float));
        }
    }
    return 0;
}

/* y[M, N] = x[M, K] @ w[N, K]^T for M <= 4: torch's Linear layout, as the offload store keeps experts (each
 * expert a contiguous block its cache slot and the link move whole). Each output is a dot product over K:
 * a block of R weight rows against the M tokens fills R * M = NACC accumulators, as many as the registers
 * hold beside the loads (16 zmm, 8 ymm), whose lane sums come out of hsum8 folds. The block's rows are read
 * once from memory (the next block prefetched into L2). */
#define NACC (VW == 16 ? 16 : 8)
static inline __attribute__((always_inline)) void gemm_nt_block(const float *x, int64_t ldx, const float *w,
                                                                float *y, int64_t ldy, int64_t M, int64_t K,
                                                                int64_t n, const int R) {
    vn acc[NACC];
    for (int j = 0; j < NACC; j++) acc[j] = (vn){0};
    const float *wn = w + n * K;
    for (int64_t k = 0; k < K; k += VW) {
        vn xv[4];
        for (int m = 0; m < NACC / R; m++) xv[m] = vnload(x + (m < M ? m : 0) * ldx + k);
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            vn wv = vnload(wn + r * K + k);
            if (k % 16 == 0) __builtin_prefetch(wn + (R + r) * K + k, 0, TO_L2);
#pragma GCC unroll 4
            for (int m = 0; m < NACC / R; m++) acc[r * (NACC / R) + m] += wv * xv[m];
        }
    }
    for (int j0 = 0; j0 < NACC; j0 += 8) {
        v8 sums = hsum8(fold8(acc[j0]), fold8(acc[j0 + 1]), fold8(acc[j0 + 2]), fold8(acc[j0 + 3]),
                        fold8(acc[j0 + 4]), fold8(acc[j0 + 5]), fold8(acc[j0 + 6]), fold8(acc[j0 + 7]));
        for (int j = 0; j < 8; j++) {
            int r = (j0 + j) / (NACC / R), m = (j0 + j) % (NACC / R);
            if (m < M) y[m * ldy + n + r] = sums[j];
        }
    }
}

static void gemm_nt(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t M, int64_t K,
                    int64_t N) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
        int64_t m = M - m0 < 4 ? M - m0 : 4;
        for (int64_t n = 0; n < N; n += NACC / (m > 2 ? 4 : m)) {
            if (m == 1) gemm_nt_block(x + m0 * ldx, ldx, w, y + m0 * ldy, ldy, 1, K, n, NACC);
            else if (m == 2) gemm_nt_block(x + m0 * ldx, ldx, w, y + m0 * ldy, ldy, 2, K, n, NACC / 2);
            else gemm_nt_block(x + m0 * ldx, ldx, w, y + m0 * ldy, ldy, m, K, n, NACC / 4);
        }
    }
}

/* One expert in torch's layout on the rows routed to it, in passes of up to NT_ROWS tokens:
 *   rows r < n: x_r = x[gather[r]] (gather NULL: x[r]);
 *   gate_up [2I, H] (gate rows, then up): h_r = silu(x_r gate^T) * (x_r up^T) (gate_up NULL: x_r is h_r);
 *   down [H, I]: y_r = h_r down^T (down NULL: y_r is x_r);
 *   scatter NULL: out[r] = y_r; else out[scatter[r]] += route_w[r] * y_r (route_w NULL: weight 1).
 * Widths H and I multiples of 16. scratch: NT_ROWS * (max(H, I) + 3I + H) floats. */
#define NT_ROWS 4
void expert_rows_f32(const float *x, int64_t ldx, const int64_t *gather, int64_t n, const float *gate_up,
                     const float *down, int64_t H, int64_t I, const int64_t *scatter, const float *route_w,
                     float *out, float *scratch) {
    int64_t in_width = gate_up ? H : I, out_width = down ? H : I;
    float *xs = scratch, *gu = xs + NT_ROWS * (H > I ? H : I), *act = gu + NT_ROWS * 2 * I, *ys = act + NT_ROWS * I;
    for (int64_t r0 = 0; r0 < n; r0 += NT_ROWS) {
        int64_t m = n - r0 < NT_ROWS ? n - r0 : NT_ROWS;
        const float *rows = x + r0 * ldx;
        int64_t ld = ldx;
        if (gather) {
            for (int64_t r = 0; r < m; r++)
                memcpy(xs + r * in_width, x + gather[r0 + r] * ldx, (size_t)in_width * sizeof(float));
            rows = xs, ld = in_width;
        }
        if (gate_up) {
            gemm_nt(rows, ld, gate_up, gu, 2 * I, m, H, 2 * I);
            swiglu_rows(gu, act, m, I);
            rows = act, ld = I;
        }
        if (down) {
            gemm_nt(rows, ld, down, ys, H, m, I, H);
            rows = ys, ld = H;
        }
        for (int64_t r = 0; r < m; r++) {
            const float *yr = rows + r * ld;
            if (!scatter) {
                memcpy(out + (r0 + r) * out_width, yr, (size_t)out_width * sizeof(float));
                continue;
            }
            float wgt = route_w ? route_w[r0 + r] : 1.0f, *o = out + scatter[r0 + r] * out_width;
            for (int64_t h = 0; h < out_width; h += VL) vstore(o + h, vload(o + h) + vload(yr + h) * wgt);
        }
    }
}
