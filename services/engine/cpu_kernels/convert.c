/* Rows between fp32 and bf16 (or copied as they are) on the pool: a CUDA engine's host jobs widen a bf16
 * device's rows for the kernels and narrow the results back. torch's own conversions of a prefill's rows ran on
 * torch's intra-op threads (a CUDA engine keeps several), which then spun on the cores the pool's next call
 * needed: a 64-row int4 host job took 2.4 times as long with torch on two threads as on one (Xeon guest). */
#include <stdint.h>
#include <string.h>

#include "hs.h"

#define CONVERT_ITEM 16384 /* elements a work item converts */

enum { AS_IS = 0, WIDEN = 1, NARROW = 2 };

typedef struct {
    const void *src;
    void *dst;
    int64_t n;
    int kind;
} convert_job;

/* torch's rounding (c10::BFloat16): to nearest, ties to even; any NaN to 0x7FC0. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static void convert_item(void *ctx, int64_t item) {
    const convert_job *j = ctx;
    int64_t start = item * CONVERT_ITEM, end = start + CONVERT_ITEM < j->n ? start + CONVERT_ITEM : j->n;
    if (j->kind == WIDEN) {
        const uint16_t *src = (const uint16_t *)j->src;
        uint32_t *dst = (uint32_t *)j->dst;
        for (int64_t i = start; i < end; i++)
            dst[i] = (uint32_t)src[i] << 16;
    } else if (j->kind == NARROW) {
        const float *src = (const float *)j->src;
        uint16_t *dst = (uint16_t *)j->dst;
        for (int64_t i = start; i < end; i++)
            dst[i] = to_bf16(src[i]);
    } else {
        memcpy((char *)j->dst + start * 4, (const char *)j->src + start * 4, (size_t)(end - start) * 4);
    }
}

/* n elements of src into dst: kind 0 fp32 as it is, 1 bf16 to fp32, 2 fp32 to bf16. Returns 0, -1 on a kind
 * out of range. */
int hs_convert(const void *src, void *dst, int64_t n, int kind) {
    if (kind < AS_IS || kind > NARROW)
        return -1;
    convert_job job = {src, dst, n, kind};
    hs_parallel(convert_item, &job, (n + CONVERT_ITEM - 1) / CONVERT_ITEM);
    return 0;
}
