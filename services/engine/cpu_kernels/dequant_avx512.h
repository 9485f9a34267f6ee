/* bf16 widening and int4 groups' dequantization at 512 bits, shared by rows.c's loops (rows_float.h,
 * rows_int_avx512.h) and amx.c's int4 tiles, so that both give the same bits. Needs AVX-512F and hs.h. */
#ifndef HS_DEQUANT_AVX512_H
#define HS_DEQUANT_AVX512_H
#include <immintrin.h>
#include <stdint.h>

/* 16 bf16 widened to fp32 (exact: a bf16 is an fp32's high half). */
static inline __attribute__((always_inline)) __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* int4's 512-bit loops run where the build has AVX-512 VNNI (rows.c's HAVE_VNNI512, and every AMX build);
 * without it an AVX-512 build's int4 runs rows_int_avx2.h's 256-bit loops, which scale their own way. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* A group's scales, and its zeros less 8 scales (the offset's and the zero's share), from after its nibbles. */
static inline __attribute__((always_inline)) void q4_scales(const uint8_t *block, int64_t g, __m512 *scale,
                                                            __m512 *zero8) {
    const uint16_t *sz = (const uint16_t *)(block + g / 2 * TILE);
    *scale = bf16x16(sz);
    *zero8 = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), *scale, bf16x16(sz + TILE));
}

/* acc plus one activation row's integer sums over a group, dequantized (the row's block scale d and its scaled
 * sum dsum): every int4 loop the same way, so their sums are each other's bit for bit. */
static inline __attribute__((always_inline)) __m512 q4_add_group(__m512 acc, __m512i dot, __m512 scale,
                                                                 __m512 zero8, float d, float dsum) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(d)), acc);
    return _mm512_fmadd_ps(zero8, _mm512_set1_ps(dsum), acc);
}
#endif
#endif
