/* The vector types and helpers of the fp32 loops (expert_f32.c, attention.c): plain C with GCC/Clang vector
 * extensions, so 16-float vectors compile to one zmm op on AVX-512, two ymm ops on AVX2, four NEON ops on arm64. */
#ifndef HS_VEC_H
#define HS_VEC_H
#include <stdint.h>
#include <string.h>

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

/* Software prefetches go to L2 (prefetcht1): into L1 they queued on its few miss buffers and capped a core
 * at ~16 GB/s; into L2, 24 (1 row a token) to 30% (8 rows) faster per fp32 expert (expert_f32.c). */
#define TO_L2 2
#endif
