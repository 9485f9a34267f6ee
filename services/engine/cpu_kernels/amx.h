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
#ifndef AMX_MIN_ROWS_Q4
#define AMX_MIN_ROWS_Q4 10 /* int4 on the tiles from this many rows (amx_q4.c) */
#endif
#endif
