/* The older fp32 expert kernels (see cpu_kernels/__init__.py): x @ w for a few rows with w row-major
 * (linear_rows_f32), a few tokens' routed experts stacked [E, H, 2I] (moe_swiglu_f32), one expert in torch's
 * layout on the rows routed to it (expert_rows_f32), and every SwiGLU of the kernels (hs_swiglu).
 * Single-threaded; built at first use with -O3 -march=native. Every width these loops vectorise over is a
 * multiple of 16, as the callers guarantee. */
#include <stdint.h>
#include <string.h>

#include "hs.h"
#include "vec.h"

/* y[M, N] = x[M, K] @ w[K, N] for a few rows (M <= ROWS), K and N multiples of 16, w row-major.
 * The weight is streamed once, DEPTH rows at a time, each run sequential and prefetched PREFETCH rows ahead
 * (the hardware prefetchers alone left a core at ~11 GB/s); y's rows take DEPTH updates per load and store. */
#define ROWS 8
#define COLS 4096
#define DEPTH 8
#define PREFETCH 16
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
