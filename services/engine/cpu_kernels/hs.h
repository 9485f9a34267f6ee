/* What matmul.c and moe.c share: the weight formats (see matmul.c), prepared activations, the pool. */
#ifndef HS_H
#define HS_H
#include <stdint.h>
#include <string.h>

typedef void (*hs_task)(void *ctx, int64_t item);
void hs_parallel(hs_task fn, void *ctx, int64_t n_items);
int hs_threads(void);

enum { F32 = 0, BF16 = 1, Q8 = 2, Q4 = 3 };
#define QB 64    /* Q8's activation block */
#define MB 8     /* activation rows per pass over a weight row (rows.c unrolls 1..MB) */
#define NCHUNK 16 /* weight rows per work item */
#define TILE 16   /* int8 and int4: weight rows interleaved per tile (rows.c; formats.py's TILE) */
/* Q4: the bytes of one group of a tile: its nibbles [g/8][TILE][4], then its bf16 scales [TILE] and zeros [TILE],
 * so a tile is one stream (a separate scales stream cost a Zen 4 core a quarter of its one-row rate). */
static inline int64_t q4_group_bytes(int64_t g) { return g / 2 * TILE + 4 * TILE; }

typedef struct {
    int64_t format, group, N, K;
    const void *w;
    const void *scales; /* Q8: float [N]; Q4: none (each group's scales lie in w, after its nibbles) */
    const float *bias;  /* [N] or NULL */
} hs_matrix;

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* Activations as a format reads them: x itself (F32), bf16 rows, or int8 rows with per-block scales. */
typedef struct {
    int64_t M, K;
    const float *f32;
    int64_t ld;        /* f32's row stride */
    uint16_t *bf16;    /* [M, K] */
    int8_t *q;         /* [M, K] */
    float *d;          /* [M, K / block]: each block's scale */
    float *dsum;       /* [M, K / block]: scale * sum of the block's int8 values */
    float *corr;       /* Q8: [M] 128 * sum over blocks of dsum */
    const void *amx;   /* BF16, Q8 on AMX: the call's rows packed as amx.c's tiles read them, or NULL */
    int64_t format, block;
} acts;


int64_t hs_acts_bytes(const hs_matrix *W, int64_t M);
void hs_acts_init(const hs_matrix *W, const float *x, int64_t ldx, int64_t M, char *scratch, acts *a);
void hs_acts_fill(acts *a, int64_t m0, int64_t m1);
void hs_rows_block(const hs_matrix *W, const acts *a, const int64_t *rows, int64_t M, int64_t n0, int64_t n1,
                   float *y, int64_t ldy);
/* A job's work items over W for M activation rows, and item `item` of them (rows.c: chunks of NCHUNK weight rows,
 * or pairs of them where one row reads two streams). */
int64_t hs_items(const hs_matrix *W, int64_t M);
void hs_rows_item(const hs_matrix *W, const acts *a, const int64_t *rows, int64_t M, int64_t item, float *y,
                  int64_t ldy);
char *hs_scratch(int64_t bytes);
const int64_t *hs_identity_rows(int64_t M);
char *align64(char *p);

/* bf16, int8 and int4 on AMX tiles (amx.c, amx_q4.c): whether W at M rows takes them here, the packed
 * activations' bytes and packing, and the products over weight rows [n0, n1) (bf16 returns the first row it
 * left, past the last whole 16; int8 and int4 take every tile). */
int hs_amx_rows(int64_t format);
int hs_amx_wanted(const hs_matrix *W, int64_t M);
int64_t hs_amx_row_bytes(int64_t format, int64_t K);
int64_t hs_amx_packed_bytes(int64_t format, int64_t M, int64_t K);
void hs_amx_pack_block(const acts *a, const int64_t *rows, int64_t M, int64_t b, void *dst);
void hs_amx_pack(const acts *a, const int64_t *rows, int64_t M, void *dst);
int64_t hs_amx_bf16_rows(const hs_matrix *W, const void *packed, int64_t M, int64_t n0, int64_t n1, float *y,
                         int64_t ldy);
void hs_amx_q8_rows(const hs_matrix *W, const acts *a, const int64_t *rows, int64_t M, int64_t n0, int64_t n1,
                    float *y, int64_t ldy);
void hs_amx_q4_rows(const hs_matrix *W, const acts *a, const int64_t *rows, int64_t M, int64_t n0, int64_t n1,
                    float *y, int64_t ldy);

/* The calls a decode layer chains (layer.c): matmul.c's, moe.c's, attention.c's and norm_rope.c's, each documented there. */
int hs_linear(const hs_matrix *W, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t M);
int hs_moe(const hs_matrix *gate_up, const hs_matrix *down, int64_t M, const int64_t *matrix_of, int64_t E,
           const float *x, int64_t ldx, int64_t T, const int64_t *ids, const float *weights, int64_t top_k,
           float *out);
void hs_swiglu(const float *gate, const float *up, float *out, int64_t n);
int hs_route_softmax(const hs_matrix *W, const float *x, int64_t ldx, int64_t T, int64_t top_k, int renorm,
                     float *probs, float *weights, int64_t *ids);
int rope_write_kv_f32(float *qkv, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float *cos_table,
                      const float *sin_table, int64_t max_positions, const int64_t *positions, const int64_t *slots,
                      float *k_cache, float *v_cache, int64_t S, const float *q_norm, const float *k_norm,
                      float eps);
int paged_decode_attention_f32(const float *q, int64_t q_sb, int64_t q_sh, const float *k_cache,
                               const float *v_cache, int64_t S, const int64_t *tables, int64_t max_blocks,
                               const int64_t *lens, int64_t block_size, int64_t B, int64_t Hq, int64_t Hkv,
                               int64_t D, float scale, float *out);
void rms_norm_f32(const float *a, const float *add, const float *w, float eps, float *sum, float *out, int64_t T,
                  int64_t H);

/* One decoder layer's fixed part for hs_decode_layer (layer.c), built once per layer: a softmax-routed MoE
 * layer with standard attention (fused q/k/v projection, head-major KV caches [kv_heads, slots, head_dim]). */
typedef struct {
    const hs_matrix *qkv, *o, *router, *gate_up, *down; /* gate_up, down: [experts] arrays */
    const float *post_attention_norm, *next_norm;       /* [hidden] */
    const float *q_norm, *k_norm;                       /* [head_dim] (Qwen3), or NULL */
    const float *cos, *sin;                             /* [max_positions, head_dim] */
    float *k_cache, *v_cache;
    int64_t experts, hidden, q_heads, kv_heads, head_dim, slots, max_positions, top_k, renormalize;
    float eps, scale;
} hs_layer;
#endif
