/* A MoE layer's routed experts in one call, for experts in any of matmul.c's formats (each its own gate_up
 * [2I, H] and down [H, I] matrix, torch's Linear layout, as the host store and cache slots keep them).
 *
 * Why one call: per expert from Python, a decode step paid for grouping, gathers, two calls and a scatter per
 * expert and layer, and every call was a pool barrier. Here a pass over the layer's assignments (one, but for
 * long prefill chunks: MOE_PASS_BYTES) is three barriers on the pool whatever the expert count: every active
 * expert's gate/up rows, then each assignment's SwiGLU (and its activations' quantization for down), then
 * every active expert's down rows; the weighted sum per token runs last. Each expert's weights are read from
 * memory once per pass that holds its tokens. */
#include <math.h>
#include <string.h>

#include "hs.h"

typedef struct {
    const hs_matrix *gate_up, *down;
    const int64_t *expert_of; /* [active]: the expert of each active slot */
    const int64_t *start;     /* [active + 1]: its assignments' range (grouped by expert, tokens ascending) */
    const int64_t *token_of;  /* [the pass's assignments] */
    int64_t *items;           /* [active + 1]: work items per phase-1/3 slot, prefix sums */
    const int64_t *identity;  /* 0, 1, ... (down reads the assignments' own rows) */
    int64_t active, I, H;
    acts *in, *mid;
    float *h, *act, *y; /* per assignment of the pass: [2I], [I], [H] */
    int64_t *amx_block; /* [active + 1]: AMX: each slot's first packed block of 16 rows, prefix sums (none: NULL) */
    char *amx_in, *amx_mid; /* the packed blocks of gate/up's and down's inputs */
} moe_job;

/* The last of n slots whose range in `starts` (prefix sums) begins at or before `at`. */
static int64_t slot_at(const int64_t *starts, int64_t n, int64_t at) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (starts[mid] <= at)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

static int64_t slot_of(const moe_job *j, int64_t item) { return slot_at(j->items, j->active, item); }

static int64_t slot_of_block(const moe_job *j, int64_t block) { return slot_at(j->amx_block, j->active, block); }

/* A slot's inputs as its rows read them: on AMX tiles, its own packed blocks. */
static const acts *slot_acts(const moe_job *j, const acts *a, const char *packed, int64_t s, acts *own) {
    if (!j->amx_block || j->amx_block[s + 1] == j->amx_block[s])
        return a;
    *own = *a;
    own->amx = packed + j->amx_block[s] * 16 * hs_amx_row_bytes(a->format, a->K);
    return own;
}

static void pack_in_item(void *ctx, int64_t block) {
    moe_job *j = ctx;
    int64_t s = slot_of_block(j, block), n = j->start[s + 1] - j->start[s];
    hs_amx_pack_block(j->in, j->token_of + j->start[s], n, block - j->amx_block[s],
                      j->amx_in + j->amx_block[s] * 16 * hs_amx_row_bytes(j->in->format, j->H));
}

static void pack_mid_item(void *ctx, int64_t block) {
    moe_job *j = ctx;
    int64_t s = slot_of_block(j, block), n = j->start[s + 1] - j->start[s];
    hs_amx_pack_block(j->mid, j->identity + j->start[s], n, block - j->amx_block[s],
                      j->amx_mid + j->amx_block[s] * 16 * hs_amx_row_bytes(j->mid->format, j->I));
}

static void gate_up_item(void *ctx, int64_t item) {
    moe_job *j = ctx;
    int64_t s = slot_of(j, item);
    acts own;
    hs_rows_item(&j->gate_up[j->expert_of[s]], slot_acts(j, j->in, j->amx_in, s, &own),
                 j->token_of + j->start[s], j->start[s + 1] - j->start[s], item - j->items[s],
                 j->h + j->start[s] * 2 * j->I, 2 * j->I);
}

static void swiglu_item(void *ctx, int64_t a) {
    moe_job *j = ctx;
    const float *gate = j->h + a * 2 * j->I;
    hs_swiglu(gate, gate + j->I, j->act + a * j->I, j->I);
    hs_acts_fill(j->mid, a, a + 1);
}

static void down_item(void *ctx, int64_t item) {
    moe_job *j = ctx;
    int64_t s = slot_of(j, item);
    acts own;
    hs_rows_item(&j->down[j->expert_of[s]], slot_acts(j, j->mid, j->amx_mid, s, &own),
                 j->identity + j->start[s], j->start[s + 1] - j->start[s], item - j->items[s],
                 j->y + j->start[s] * j->H, j->H);
}

static int64_t up64(int64_t bytes) { return (bytes + 127) & ~(int64_t)63; }

/* Bytes of intermediates (gate/up outputs, SwiGLU activations and their prepared form, down outputs) one pass
 * holds: a 512-token prefill chunk of Qwen3-30B-A3B (4096 assignments) held 72 MB at once, per calling thread,
 * kept for the process's life. The assignments are sorted by expert, so a pass is a run of whole experts and
 * each expert's weights are still read once; only an expert with more tokens than a pass holds is split. */
#ifndef MOE_PASS_BYTES
#define MOE_PASS_BYTES (16 << 20)
#endif

/* One pass: every slot's gate/up rows, the SwiGLUs, every slot's down rows. */
static void run_pass(moe_job *job) {
    int64_t n = job->active;
    if (job->amx_block) { /* which slots have rows enough for the tiles, and their blocks' places */
        for (int64_t s = 0; s < n; s++) {
            int64_t rows = job->start[s + 1] - job->start[s];
            job->amx_block[s + 1] = job->amx_block[s] +
                                    (hs_amx_wanted(&job->gate_up[job->expert_of[s]], rows) ? (rows + 15) / 16 : 0);
        }
        hs_parallel(pack_in_item, job, job->amx_block[n]);
    }
    hs_parallel(gate_up_item, job, job->items[n]);
    hs_parallel(swiglu_item, job, job->start[n]);
    if (!job->down)
        return;
    if (job->amx_block)
        hs_parallel(pack_mid_item, job, job->amx_block[n]);
    for (int64_t s = 0; s < n; s++) /* down has H rows, not 2I */
        job->items[s + 1] = job->items[s] + hs_items(&job->down[job->expert_of[s]], job->start[s + 1] - job->start[s]);
    hs_parallel(down_item, job, job->items[n]);
}

/* out[T, H] = sum over each token's top_k experts (ids, weights [T, top_k]) of weight * SwiGLU expert(x).
 * gate_up, down: [M] matrices, one format and shape for all. matrix_of: [E], the matrix of each expert id, or -1
 * for an expert this call leaves out (its assignments add nothing: the offload path computes a layer's cached
 * experts in one call, from their slots, and adds the others after); NULL: expert e is matrix e (E == M).
 * down NULL (a split expert's host half, top_k 1): out[T, I] = the SwiGLU activation, unweighted (zero rows for
 * an expert left out). Returns 0, -1 on an expert id or matrix index out of range, -2 when out of memory. */
int hs_moe(const hs_matrix *gate_up, const hs_matrix *down, int64_t M, const int64_t *matrix_of, int64_t E,
           const float *x, int64_t ldx, int64_t T, const int64_t *ids, const float *weights, int64_t top_k,
           float *out) {
    int64_t A = T * top_k, H = gate_up[0].K, I = gate_up[0].N / 2;
    if (!matrix_of && E != M)
        return -1;
    for (int64_t i = 0; i < A; i++)
        if (ids[i] < 0 || ids[i] >= E)
            return -1;
    for (int64_t e = 0; matrix_of && e < E; e++)
        if (matrix_of[e] < -1 || matrix_of[e] >= M)
            return -1;
    /* AMX: each slot's rows packed in whole blocks of 16, a slot with fewer rows than the tiles take
     * (`least`) not at all, so a pass's packed rows are at most its assignments plus 15 for each slot with
     * `least` rows or more: 16 / least times its assignments, or 15 more a matrix. */
    int amx = hs_amx_wanted(&gate_up[0], A);
    int64_t least = amx ? hs_amx_rows(gate_up[0].format) : 1;
    int64_t per = 4 * (3 * I + H) + (down ? hs_acts_bytes(&down[0], 1) : 0) + (amx ? 4 * (H + I) : 0);
    int64_t cap = MOE_PASS_BYTES / per < A ? MOE_PASS_BYTES / per : A; /* assignments a pass holds */
    cap = cap < 1 ? 1 : cap;
    int64_t amx_slots = cap / least < M ? cap / least : M, packed_rows = cap + 15 * amx_slots;
    const int64_t *identity = hs_identity_rows(cap);
    if (!identity)
        return -2;
    int64_t in_bytes = up64(hs_acts_bytes(&gate_up[0], T)), mid_bytes = down ? up64(hs_acts_bytes(&down[0], cap)) : 0;
    int64_t ints = 7 * M + 4 + 2 * A;
    int64_t amx_bytes = amx ? up64((M + 1) * 8) + up64(packed_rows * H * 2) + up64(packed_rows * I * 2) : 0;
    int64_t bytes = in_bytes + mid_bytes + up64(ints * 8) + up64(cap * 2 * I * 4) + up64(cap * I * 4) +
                    up64(cap * H * 4) + amx_bytes;
    char *base = hs_scratch(bytes);
    if (!base)
        return -2;
    char *p = align64(base);
    acts in, mid;
    hs_acts_init(&gate_up[0], x, ldx, T, p, &in);
    p += in_bytes;
    char *mid_scratch = p;
    p += mid_bytes;
    int64_t *counts = (int64_t *)p, *expert_of = counts + M, *start = expert_of + M, *token_of = start + M + 1;
    int64_t *pos = token_of + A, *pass_expert = pos + A, *pass_start = pass_expert + M, *pass_items = pass_start + M + 1;
    p += up64(ints * 8);
    float *h = (float *)p, *act = (float *)(p + up64(cap * 2 * I * 4));
    float *y = (float *)((char *)act + up64(cap * I * 4));
    int64_t *amx_block = NULL;
    char *amx_in = NULL, *amx_mid = NULL;
    if (amx) {
        amx_block = (int64_t *)((char *)y + up64(cap * H * 4));
        amx_block[0] = 0;
        amx_in = (char *)amx_block + up64((M + 1) * 8);
        amx_mid = amx_in + up64(packed_rows * H * 2);
    }
    hs_acts_init(down ? &down[0] : &gate_up[0], act, I, cap, mid_scratch, &mid);
    if (!down) /* no down projection to prepare activations for: the SwiGLU phase only writes act */
        mid.bf16 = NULL, mid.q = NULL;
    hs_acts_fill(&in, 0, T);

    /* Counting sort of the assignments by matrix, tokens ascending within each; pos -1: left out. */
#define MATRIX(i) (matrix_of ? matrix_of[ids[i]] : ids[i])
    memset(counts, 0, M * sizeof *counts);
    for (int64_t i = 0; i < A; i++)
        if (MATRIX(i) >= 0)
            counts[MATRIX(i)]++;
    int64_t active = 0;
    start[0] = 0;
    for (int64_t e = 0; e < M; e++) {
        if (!counts[e])
            continue;
        expert_of[active] = e;
        start[active + 1] = start[active] + counts[e];
        counts[e] = start[active]; /* from here: the next free assignment of e */
        active++;
    }
    for (int64_t i = 0; i < A; i++) {
        if (MATRIX(i) < 0) {
            pos[i] = -1;
            continue;
        }
        int64_t a = counts[MATRIX(i)]++;
        token_of[a] = i / top_k;
        pos[i] = a;
    }
#undef MATRIX
    memset(out, 0, (down ? T * H : A * I) * sizeof *out);
    for (int64_t s = 0, a0 = 0; a0 < start[active]; ) {
        int64_t n = 0, a1 = a0; /* this pass: whole slots while they fit, else the part of one that does */
        pass_items[0] = 0;
        while (s < active) {
            int64_t end = start[s + 1];
            if (end - a0 > cap) {
                if (n)
                    break;
                end = a0 + cap; /* an expert with more tokens than a pass holds: the rest in the next */
            }
            pass_expert[n] = expert_of[s];
            pass_start[n] = a1 - a0;
            pass_items[n + 1] = pass_items[n] + hs_items(&gate_up[expert_of[s]], end - a1);
            n++;
            a1 = end;
            if (end < start[s + 1])
                break;
            s++;
        }
        pass_start[n] = a1 - a0;
        moe_job job = {gate_up, down, pass_expert, pass_start, token_of + a0, pass_items, identity, n, I, H,
                       &in, &mid, h, act, y, amx_block, amx_in, amx_mid};
        run_pass(&job);
        /* Each token's experts in the router's order (of those this pass holds): one pass sums bit for bit as the
         * resident layer always has, which the offload path's cached batch relies on. */
        for (int64_t i = 0; i < A; i++) {
            if (pos[i] < a0 || pos[i] >= a1)
                continue;
            if (!down) {
                memcpy(out + i * I, act + (pos[i] - a0) * I, I * sizeof *out);
                continue;
            }
            float *o = out + i / top_k * H, w = weights[i];
            const float *src = y + (pos[i] - a0) * H;
            for (int64_t k = 0; k < H; k++)
                o[k] += w * src[k];
        }
        a0 = a1;
    }
    return 0;
}

/* Softmax routing in one call: probs[T, E] = softmax(x @ W^T) (W: the router, any format, E rows), then each
 * row's top_k (largest first, the lower expert on a tie) into ids and weights, renormalised to sum 1 when
 * `renorm`. Why: after a layer's weight stream the five small torch ops this replaces ran cold, a tenth of a
 * millisecond each at Qwen3-30B-A3B's shapes, every layer of every token. Returns 0, -1 when out of memory. */
int hs_route_softmax(const hs_matrix *W, const float *x, int64_t ldx, int64_t T, int64_t top_k, int renorm,
                     float *probs, float *weights, int64_t *ids) {
    int64_t E = W->N;
    if (hs_linear(W, x, ldx, probs, E, T))
        return -1;
    for (int64_t t = 0; t < T; t++) {
        float *p = probs + t * E, top = p[0], sum = 0.0f;
        for (int64_t e = 1; e < E; e++)
            top = p[e] > top ? p[e] : top;
        for (int64_t e = 0; e < E; e++)
            sum += p[e] = expf(p[e] - top);
        for (int64_t e = 0; e < E; e++)
            p[e] /= sum;
        float *w = weights + t * top_k, kept = 0.0f;
        int64_t *id = ids + t * top_k;
        for (int64_t n = 0; n < top_k; n++) /* insertion into the k best so far, which stay sorted */
            w[n] = -1.0f, id[n] = -1;
        for (int64_t e = 0; e < E; e++) {
            if (p[e] <= w[top_k - 1])
                continue;
            int64_t n = top_k - 1;
            for (; n > 0 && p[e] > w[n - 1]; n--)
                w[n] = w[n - 1], id[n] = id[n - 1];
            w[n] = p[e], id[n] = e;
        }
        for (int64_t n = 0; n < top_k; n++)
            kept += w[n];
        for (int64_t n = 0; renorm && n < top_k; n++)
            w[n] /= kept;
    }
    return 0;
}
