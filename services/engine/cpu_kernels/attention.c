/* Paged decode attention in fp32: each new token against its paged context, read in place, on the kernels'
 * pool (threadpool.c): at one row its reads grow with the context while the matrices' do not. head_dim is a
 * multiple of 16; q comes at its own strides, every other tensor contiguous. */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "hs.h"
#include "vec.h"

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
