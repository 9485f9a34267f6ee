/* The native matmul against a scalar reference, in whatever ISA this file is built for (x86 here, aarch64 under
 * qemu: tests/test_native_isa.py). Weights are random bytes in each format's packed layout (matmul.c), so the
 * check needs no packer; activations go through the library's own preparation (hs_acts_fill), and the reference
 * reads the prepared values, so integer formats must agree to float rounding. Then hs_moe, whose assignments
 * take rows by index, against the same library's one-row calls.
 * Prints one line per failing case and "checked N cases, F failed"; exits 1 on any failure. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hs.h"

int hs_linear(const hs_matrix *W, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t M);
int hs_moe(const hs_matrix *gate_up, const hs_matrix *down, int64_t M, const int64_t *matrix_of, int64_t E,
           const float *x, int64_t ldx, int64_t T, const int64_t *ids, const float *weights, int64_t top_k,
           float *out);
int hs_set_threads(int threads);
const char *hs_isa(void);

static uint64_t seed = 88172645463325252ull;
static uint64_t next_u64(void) { /* xorshift64: the same cases on every machine */
    seed ^= seed << 13;
    seed ^= seed >> 7;
    seed ^= seed << 17;
    return seed;
}
static float uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next_u64() >> 40) / (float)(1 << 24); }
static float bf16f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t to_bf16(float f) { /* truncation: any bf16 will do for random weights */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static int64_t padded(int64_t n) { return (n + TILE - 1) / TILE * TILE; }

/* A random matrix of `format` with N rows of K inputs (int4 groups of `group`). */
static hs_matrix make_matrix(int64_t format, int64_t N, int64_t K, int64_t group, int with_bias) {
    hs_matrix W = {format, format == Q4 ? group : 0, N, K, NULL, NULL, NULL};
    int64_t Np = padded(N);
    if (format == F32) {
        float *w = malloc(N * K * sizeof *w);
        for (int64_t i = 0; i < N * K; i++)
            w[i] = uniform(-1.0f, 1.0f);
        W.w = w;
    } else if (format == BF16) {
        uint16_t *w = malloc(N * K * sizeof *w);
        for (int64_t i = 0; i < N * K; i++)
            w[i] = to_bf16(uniform(-1.0f, 1.0f));
        W.w = w;
    } else if (format == Q8) {
        uint8_t *w = malloc(Np * K);
        float *s = malloc(N * sizeof *s);
        for (int64_t i = 0; i < Np * K; i++)
            w[i] = (uint8_t)(1 + next_u64() % 255); /* q + 128, q in -127..127 */
        for (int64_t n = 0; n < N; n++)
            s[n] = uniform(0.001f, 0.01f);
        W.w = w, W.scales = s;
    } else {
        int64_t G = K / group, gb = q4_group_bytes(group);
        uint8_t *w = malloc(Np / TILE * G * gb);
        for (int64_t t = 0; t < Np / TILE; t++)
            for (int64_t j = 0; j < G; j++) {
                uint8_t *wj = w + (t * G + j) * gb;
                uint16_t *sz = (uint16_t *)(wj + group / 2 * TILE);
                for (int64_t i = 0; i < group / 2 * TILE; i++)
                    wj[i] = (uint8_t)next_u64();
                for (int64_t i = 0; i < TILE; i++) {
                    sz[i] = to_bf16(uniform(0.01f, 0.1f));
                    sz[TILE + i] = to_bf16(uniform(-0.05f, 0.05f));
                }
            }
        W.w = w;
    }
    if (with_bias) {
        float *b = malloc(N * sizeof *b);
        for (int64_t n = 0; n < N; n++)
            b[n] = uniform(-1.0f, 1.0f);
        W.bias = b;
    }
    return W;
}

/* Row m, column n of the reference, and the sum of its terms' magnitudes (what the tolerance scales with). */
static double reference(const hs_matrix *W, const acts *a, const float *x, int64_t m, int64_t n, double *scale) {
    int64_t K = W->K;
    double sum = 0.0, mag = 0.0;
    if (W->format == F32 || W->format == BF16) {
        for (int64_t k = 0; k < K; k++) {
            double w = W->format == F32 ? ((const float *)W->w)[n * K + k] : bf16f(((const uint16_t *)W->w)[n * K + k]);
            sum += w * x[m * K + k];
            mag += fabs(w * x[m * K + k]);
        }
    } else if (W->format == Q8) {
        const uint8_t *w = (const uint8_t *)W->w + n / TILE * TILE * K;
        int64_t i = n % TILE, blocks = K / QB;
        for (int64_t b = 0; b < blocks; b++) {
            int64_t s = 0, sa = 0;
            for (int64_t k = b * QB; k < (b + 1) * QB; k++) {
                int64_t q = (int64_t)w[(k / 4) * TILE * 4 + i * 4 + k % 4] - 128, v = q * a->q[m * K + k];
                s += v;
                sa += v < 0 ? -v : v;
            }
            double d = a->d[m * blocks + b] * ((const float *)W->scales)[n];
            sum += d * (double)s;
            mag += fabs(d) * (double)sa;
        }
    } else {
        int64_t g = W->group, G = K / g, i = n % TILE;
        const uint8_t *w = (const uint8_t *)W->w + n / TILE * G * q4_group_bytes(g);
        for (int64_t j = 0; j < G; j++) {
            const uint8_t *wj = w + j * q4_group_bytes(g);
            const uint16_t *sz = (const uint16_t *)(wj + g / 2 * TILE);
            double scale = bf16f(sz[i]), zero = bf16f(sz[TILE + i]), d = a->d[m * G + j];
            for (int64_t k = j * g; k < (j + 1) * g; k++) {
                uint8_t byte = wj[((k - j * g) / 8) * TILE * 4 + i * 4 + k % 4];
                double v = ((k % 8 < 4 ? byte & 15 : byte >> 4) - 8.0) * scale + zero;
                sum += v * d * a->q[m * K + k];
                mag += fabs(v * d * a->q[m * K + k]);
            }
        }
    }
    *scale = mag;
    return sum + (W->bias ? W->bias[n] : 0.0);
}

static int cases, failures;
static void expect_close(const char *what, double got, double want, double magnitude, double tolerance) {
    cases++;
    if (!(fabs(got - want) <= tolerance * (magnitude + 1.0))) {
        if (failures++ < 20)
            printf("FAIL %s: got %.7g, want %.7g\n", what, got, want);
    }
}

static const char *NAMES[] = {"fp32", "bf16", "int8", "int4"};
/* bf16: AVX-512 BF16 rounds the activations to bf16 (2^-8), the other loops keep them in fp32. */
static double tolerance(int64_t format) { return format == BF16 ? 1e-2 : 1e-5; }

static void check_linear(int64_t format, int64_t N, int64_t K, int64_t M, int with_bias) {
    hs_matrix W = make_matrix(format, N, K, 64, with_bias);
    float *x = malloc(M * K * sizeof *x), *y = malloc(M * N * sizeof *y);
    for (int64_t i = 0; i < M * K; i++)
        x[i] = uniform(-2.0f, 2.0f);
    if (hs_linear(&W, x, K, y, N, M) != 0) {
        printf("FAIL %s: hs_linear out of memory\n", NAMES[format]);
        failures++;
        return;
    }
    char *scratch = malloc(hs_acts_bytes(&W, M) + 64);
    acts a;
    hs_acts_init(&W, x, K, M, scratch, &a);
    hs_acts_fill(&a, 0, M);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            char what[96];
            double magnitude, want = reference(&W, &a, x, m, n, &magnitude);
            snprintf(what, sizeof what, "%s N=%lld K=%lld M=%lld bias=%d [%lld, %lld]", NAMES[format],
                     (long long)N, (long long)K, (long long)M, with_bias, (long long)m, (long long)n);
            expect_close(what, y[m * N + n], want, magnitude, tolerance(format));
        }
    free(scratch), free(x), free(y);
    free((void *)W.w), free((void *)W.scales), free((void *)W.bias);
}

/* hs_moe (E experts, each token to top_k of them) against one-row hs_linear calls and a scalar SwiGLU. mapped:
 * the matrices in reverse order through matrix_of, expert 1 left out (-1: its assignments add nothing), as the
 * offload path computes a layer's cached experts from their slots. */
static void check_moe(int64_t format, int64_t H, int64_t I, int64_t E, int64_t T, int64_t top_k, int mapped) {
    hs_matrix gate_up[8], down[8];
    int64_t matrix_of[8];
    for (int64_t e = 0; e < E; e++) {
        gate_up[e] = make_matrix(format, 2 * I, H, 64, 0);
        down[e] = make_matrix(format, H, I, 64, 0);
        matrix_of[e] = e == 1 ? -1 : E - 1 - e;
    }
    float *x = malloc(T * H * sizeof *x), *weights = malloc(T * top_k * sizeof *weights);
    float *out = malloc(T * H * sizeof *out), *h = malloc(2 * I * sizeof *h), *act = malloc(I * sizeof *act);
    float *y = malloc(H * sizeof *y);
    int64_t *ids = malloc(T * top_k * sizeof *ids);
    for (int64_t i = 0; i < T * H; i++)
        x[i] = uniform(-1.0f, 1.0f);
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < top_k; k++) {
            ids[t * top_k + k] = (t + 3 * k) % E; /* distinct per token while top_k <= E / 3 + 1 */
            weights[t * top_k + k] = uniform(0.1f, 1.0f);
        }
    if (hs_moe(gate_up, down, E, mapped ? matrix_of : NULL, E, x, H, T, ids, weights, top_k, out) != 0) {
        printf("FAIL %s: hs_moe failed\n", NAMES[format]);
        failures++;
        return;
    }
    for (int64_t t = 0; t < T; t++) {
        double *want = calloc(H, sizeof *want);
        for (int64_t k = 0; k < top_k; k++) {
            int64_t e = mapped ? matrix_of[ids[t * top_k + k]] : ids[t * top_k + k];
            if (e < 0)
                continue;
            hs_linear(&gate_up[e], x + t * H, H, h, 2 * I, 1);
            for (int64_t i = 0; i < I; i++)
                act[i] = h[i] / (1.0f + expf(-h[i])) * h[I + i];
            hs_linear(&down[e], act, I, y, H, 1);
            for (int64_t i = 0; i < H; i++)
                want[i] += weights[t * top_k + k] * y[i];
        }
        /* bf16 at 5 rows an expert and more runs on AMX tiles where the CPU has them: its sums differ in their
         * last bits, and a SwiGLU value at a rounding midpoint may round to the next bf16 on its way to down (a
         * value of 40 by a step of 0.25 moved outputs by up to a tenth, seen), so its error is held to the
         * token's largest output, not to each one's own */
        double row_max = 0.0;
        for (int64_t i = 0; i < H; i++)
            row_max = fabs(want[i]) > row_max ? fabs(want[i]) : row_max;
        int tiles = format == BF16 && T >= 5;
        for (int64_t i = 0; i < H; i++) {
            char what[64];
            snprintf(what, sizeof what, "moe%s %s T=%lld [%lld, %lld]", mapped ? " mapped" : "", NAMES[format],
                     (long long)T, (long long)t, (long long)i);
            expect_close(what, out[t * H + i], want[i], tiles ? row_max : fabs(want[i]), tiles ? 2e-2 : 1e-4);
        }
        free(want);
    }
    for (int64_t e = 0; e < E; e++) {
        free((void *)gate_up[e].w), free((void *)gate_up[e].scales);
        free((void *)down[e].w), free((void *)down[e].scales);
    }
    free(x), free(weights), free(out), free(h), free(act), free(y), free(ids);
}

int main(void) {
    static const int64_t rows[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, 33, 50}; /* AMX tiles: bf16 from 5, int8 from 10 */
    printf("isa %s\n", hs_isa());
    /* First, while the thread's scratch is still sized by one call (it only grows): experts at about the fewest
     * rows AMX takes, each packed as 16, so a pass's packed rows are over three times its assignments (a
     * sanitized build sees a buffer sized short). */
    check_moe(BF16, 128, 64, 8, 20, 2, 0);
    check_moe(Q8, 128, 64, 8, 40, 2, 0);
    for (int threads = 1; threads <= 2; threads++) {
        hs_set_threads(threads);
        for (int64_t format = F32; format <= Q4; format++)
            for (size_t r = 0; r < sizeof rows / sizeof *rows; r++) {
                check_linear(format, 40, 256, rows[r], (int)(r % 2));
                check_linear(format, 16, 128, rows[r], 0);
                check_linear(format, 80, 192, rows[r], (int)(r % 2)); /* one row: 5 chunks, 2 pairs and 1 alone */
                check_linear(format, 64, 128, rows[r], (int)(r % 2)); /* one row: 4 chunks, 2 pairs */
            }
        for (int64_t format = F32; format <= Q4; format++) {
            for (int mapped = 0; mapped <= 1; mapped++) {
                check_moe(format, 128, 64, 5, 1, 2, mapped);
                check_moe(format, 128, 64, 5, 7, 2, mapped);
                check_moe(format, 128, 64, 5, 45, 2, mapped); /* 18 rows an expert: bf16 on AMX tiles */
            }
        }
    }
    printf("checked %d cases, %d failed\n", cases, failures);
    return failures ? 1 : 0;
}
