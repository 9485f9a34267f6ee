/* What amx.c and amx_q4.c share: whether this build has Intel AMX's tile instructions (HAVE_AMX), and the
 * tile configuration LDTILECFG reads. */
#ifndef HS_AMX_H
#define HS_AMX_H
#include <stdint.h>

#if defined(__x86_64__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && \
    defined(__AVX512F__) && defined(__linux__)
#include <immintrin.h>
#define HAVE_AMX 1

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* The int8 and int4 tiles' configuration: six of 16 rows x 64 bytes (sums 0 and 3, activations 1 and 4,
 * weights 2 and 5), loaded per call since torch's oneDNN configures the tiles its own way on the same threads. */
static inline void amx_configure_int_tiles(void) {
    tile_config cfg = {.palette = 1};
    for (int t = 0; t < 6; t++)
        cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}
#endif

#define AMX_Q4_MAX_GROUP 256 /* int4 groups of a multiple of 64 inputs up to this many run on the tiles */

/* The int8 and int4 tiles (amx.c, amx_q4.c) read their weights 1 KB a block with no compute to hide a miss
 * behind (a block's tile product and scaling took about 70 ns with the weights in L2), so each step prefetches
 * its weights' lines AMX_INT_PREFETCH bytes ahead (the next weight tiles follow on in memory), and each block's
 * sums are read back AMX_SUM_LAG blocks after their tile store. On an Intel Xeon guest (AMX; one process
 * alternating builds, 3-4 rounds, Qwen3-shape int8 matrices from memory) against neither: 16 rows 1.08-1.3x as
 * fast per expert, q_proj and LM head, one and two threads; 64 rows even to 1.09x. The prefetch alone, 2-16 KB
 * ahead or into L2, was within the guest's noise of 4 KB into L1. */
#ifndef AMX_INT_PREFETCH
#define AMX_INT_PREFETCH 4096
#endif
#ifndef AMX_INT_PREFETCH_HINT
#define AMX_INT_PREFETCH_HINT _MM_HINT_T0
#endif
#ifndef AMX_SUM_LAG
#define AMX_SUM_LAG 4
#endif
#define AMX_SUM_RING 8 /* sum buffers: more than AMX_SUM_LAG + 1 */
#endif
