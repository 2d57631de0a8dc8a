/* The few-row product over weight-only quantized weights (int8 per channel or per 32 as GGUF's Q8_0; Q4_0 / Q4_1).
 *
 * Why: a decode step at a few rows is bound by how fast the weights stream from memory; int8 weights are a
 * quarter of float32's bytes and 4-bit ones about a seventh. Each 32 weights are widened to float32 in registers
 * (and scaled: q * s, or q * d + m for 4-bit; a per-row int8 scale is applied once to the row's sum instead),
 * then multiplied with up to four input rows by fused multiply-adds in four chains per row. Every row sums in
 * the same chains and order whatever rows share its step, so a request's logits do not depend on its batch.
 *
 * This file alone is compiled with FMA contraction (the pragma below): the decode step's elementwise math
 * (decode_step.c) stays uncontracted, to round as torch does.
 */
#pragma GCC optimize("fp-contract=fast")
#include <omp.h>
#include <string.h>

#include "native.h"

/* x86-64-v4 (AVX-512) and v3 (AVX2 + FMA) clones, and a portable one; the loader picks per CPU. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define QUANT_ISA __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define QUANT_ISA
#endif

typedef int32_t v8si __attribute__((vector_size(32)));

/* Eight bytes widened to int32 lanes, written as a vector built from eight loads: GCC turns that into one
 * widening load (vpmovsxbd / vpmovzxbd), where __builtin_convertvector on a byte vector became one scalar
 * conversion per element. */
static inline v8 int8_to_float(const int8_t *p) {
    const v8si i = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
    return __builtin_convertvector(i, v8);
}

static inline v8si bytes(const uint8_t *p) { return (v8si){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]}; }

static inline v8 to_float(v8si i) { return __builtin_convertvector(i, v8); }

static inline v8 load(const float *p) { return *(const v8u *)p; }

typedef float v4 __attribute__((vector_size(16)));

/* A row's four chains of 8 lanes summed, in registers (the same order for every row). */
static inline float chains_sum(v8 c0, v8 c1, v8 c2, v8 c3) {
    const v8 t = (c0 + c1) + (c2 + c3);
    v4 h = __builtin_shufflevector(t, t, 0, 1, 2, 3) + __builtin_shufflevector(t, t, 4, 5, 6, 7);
    h += __builtin_shufflevector(h, h, 2, 3, 0, 1);
    h += __builtin_shufflevector(h, h, 1, 0, 3, 2);
    return h[0];
}

/* One 32-input step of R rows over four weight vectors (inputs i .. i + 31, 8 each): row r's chain k takes the
 * k-th 8. Four chains per row keep the FMAs' latency hidden at one row; R rows share each weight vector. */
#define FMA_STEP(R, w0, w1, w2, w3, x, in, i)                                 \
    for (int r = 0; r < (R); r++) {                                           \
        const float *xr_ = (x) + (int64_t)r * (in) + (i);                     \
        c0[r] += (w0) * load(xr_);                                            \
        c1[r] += (w1) * load(xr_ + 8);                                        \
        c2[r] += (w2) * load(xr_ + 16);                                       \
        c3[r] += (w3) * load(xr_ + 24);                                       \
    }

/* int8 with one scale per row (group = in): y = scale * sum(q x); inputs past the last 32 added one by one. */
static inline __attribute__((always_inline)) void rows_q8_channel(const int R, const float *x, int in,
                                                                  const int8_t *q, float scale, float *y,
                                                                  int out) {
    v8 c0[4] = {{0}}, c1[4] = {{0}}, c2[4] = {{0}}, c3[4] = {{0}};
    int i = 0;
    for (; i + 32 <= in; i += 32) {
        __builtin_prefetch(q + i + 1024, 0, 0);
        const v8 w0 = int8_to_float(q + i), w1 = int8_to_float(q + i + 8);
        const v8 w2 = int8_to_float(q + i + 16), w3 = int8_to_float(q + i + 24);
        FMA_STEP(R, w0, w1, w2, w3, x, in, i)
    }
    for (int r = 0; r < R; r++) {
        float s = chains_sum(c0[r], c1[r], c2[r], c3[r]);
        for (int j = i; j < in; j++) s += (float)q[j] * x[(int64_t)r * in + j];
        y[(int64_t)r * out] += scale * s;
    }
}

/* int8 with a scale per `group` inputs (a multiple of 32 dividing the row; GGUF's Q8_0: 32): each weight
 * dequantized in registers (q * scale, shared by the R rows), then multiplied. */
static inline __attribute__((always_inline)) void rows_q8_group(const int R, const float *x, int in,
                                                                const int8_t *q, const float *scale, int group,
                                                                float *y, int out) {
    v8 c0[4] = {{0}}, c1[4] = {{0}}, c2[4] = {{0}}, c3[4] = {{0}};
    for (int g0 = 0, g = 0; g0 < in; g0 += group, g++) { /* group by group: no division per step */
        const float s = scale[g];
        for (int i = g0; i < g0 + group; i += 32) {
            __builtin_prefetch(q + i + 1024, 0, 0);
            const v8 w0 = int8_to_float(q + i) * s, w1 = int8_to_float(q + i + 8) * s;
            const v8 w2 = int8_to_float(q + i + 16) * s, w3 = int8_to_float(q + i + 24) * s;
            FMA_STEP(R, w0, w1, w2, w3, x, in, i)
        }
    }
    for (int r = 0; r < R; r++) y[(int64_t)r * out] += chains_sum(c0[r], c1[r], c2[r], c3[r]);
}

/* 4-bit blocks of 32: each weight dequantized in registers (q * d + m, shared by the R rows), then multiplied. */
static inline __attribute__((always_inline)) void rows_q4(const int R, const float *x, int in, const uint8_t *q,
                                                          const float *d, const float *mn, float *y, int out) {
    v8 c0[4] = {{0}}, c1[4] = {{0}}, c2[4] = {{0}}, c3[4] = {{0}};
    for (int b = 0; b < in / 32; b++) {
        const uint8_t *block = q + (int64_t)b * 16;
        __builtin_prefetch(block + 1024, 0, 0);
        const v8si first = bytes(block), second = bytes(block + 8);
        const float s = d[b], m = mn[b];
        /* inputs 0-15 of the block: the low nibbles of bytes 0-7, then of 8-15; inputs 16-31: the high ones */
        const v8 w0 = to_float(first & 15) * s + m, w1 = to_float(second & 15) * s + m;
        const v8 w2 = to_float(first >> 4) * s + m, w3 = to_float(second >> 4) * s + m;
        FMA_STEP(R, w0, w1, w2, w3, x, in, b * 32)
    }
    for (int r = 0; r < R; r++) y[(int64_t)r * out] += chains_sum(c0[r], c1[r], c2[r], c3[r]);
}

/* Output rows o0 .. o1 - 1 for n input rows, four at a time (each weight row read once per four). */
QUANT_ISA static void q_rows_range(int n, const float *x, int in, const QWeight *w, int o0, int o1, int out,
                                   float *y) {
    const int64_t q_row = w->kind == Q_INT4 ? in / 2 : in; /* bytes per output row */
    const int per_row = w->kind == Q_INT4 ? in / 32 : (in + w->group - 1) / w->group; /* scales per row */
    for (int o = o0; o < o1; o++) {
        const float *scale = w->scale + (int64_t)o * per_row;
        for (int r = 0; r < n;) {
            const int R = n - r >= 4 ? 4 : n - r;
            const float *xr = x + (int64_t)r * in;
            float *yr = y + (int64_t)r * out + o;
#define DISPATCH(CALL) \
    switch (R) {       \
        case 4: CALL(4); break; case 3: CALL(3); break; case 2: CALL(2); break; default: CALL(1); break; }
            if (w->kind == Q_INT4) {
                const uint8_t *q = (const uint8_t *)w->q + o * q_row;
                const float *mn = w->min + (int64_t)o * per_row;
#define Q4(K) rows_q4(K, xr, in, q, scale, mn, yr, out)
                DISPATCH(Q4)
            } else if (w->group >= in) {
                const int8_t *q = (const int8_t *)w->q + o * q_row;
#define Q8C(K) rows_q8_channel(K, xr, in, q, scale[0], yr, out)
                DISPATCH(Q8C)
            } else {
                const int8_t *q = (const int8_t *)w->q + o * q_row;
#define Q8G(K) rows_q8_group(K, xr, in, q, scale, w->group, yr, out)
                DISPATCH(Q8G)
            }
            r += R;
        }
    }
}

/* Rows are taken in blocks of ROW_BLOCK so that a block's inputs stay in cache while the team streams the
 * weights past them; each block is one pass over the weights. */
enum { ROW_BLOCK = 32 };

void q_linear_rows(const Model *m, int n, const float *x, int in, const QWeight *w, const float *bias, int out,
                   float *y) {
    for (int r = 0; r < n; r++) {
        if (bias)
            memcpy(y + (int64_t)r * out, bias, sizeof(float) * out);
        else
            memset(y + (int64_t)r * out, 0, sizeof(float) * out);
    }
#pragma omp parallel num_threads(m->threads)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        const int share = (out + team - 1) / team, o0 = t * share, o1 = o0 + share < out ? o0 + share : out;
        for (int r0 = 0; r0 < n && o0 < o1; r0 += ROW_BLOCK) {
            const int rows = n - r0 < ROW_BLOCK ? n - r0 : ROW_BLOCK;
            q_rows_range(rows, x + (int64_t)r0 * in, in, w, o0, o1, out, y + (int64_t)r0 * out);
        }
    }
}

/* dst[o - o0][in] = the float32 weights of rows o0 .. o1 - 1 (q * scale (+ min)): for steps of many rows, whose
 * arithmetic oneDNN or BLAS does better on float weights than the product above. */
void q_dequantize_rows(const Model *m, const QWeight *w, int in, int o0, int o1, float *dst) {
    const int64_t q_row = w->kind == Q_INT4 ? in / 2 : in;
    const int per_row = w->kind == Q_INT4 ? in / 32 : (in + w->group - 1) / w->group;
#pragma omp parallel for num_threads(m->threads) schedule(static)
    for (int o = o0; o < o1; o++) {
        const float *scale = w->scale + (int64_t)o * per_row;
        float *row = dst + (int64_t)(o - o0) * in;
        if (w->kind == Q_INT4) {
            const uint8_t *q = (const uint8_t *)w->q + o * q_row;
            const float *mn = w->min + (int64_t)o * per_row;
            for (int b = 0; b < in / 32; b++)
                for (int j = 0; j < 16; j++) {
                    const uint8_t byte = q[b * 16 + j];
                    row[b * 32 + j] = (float)(byte & 15) * scale[b] + mn[b];
                    row[b * 32 + j + 16] = (float)(byte >> 4) * scale[b] + mn[b];
                }
        } else {
            const int8_t *q = (const int8_t *)w->q + o * q_row;
            for (int g0 = 0, g = 0; g0 < in; g0 += w->group, g++) {
                const int g1 = g0 + w->group < in ? g0 + w->group : in;
                for (int i = g0; i < g1; i++) row[i] = (float)q[i] * scale[g];
            }
        }
    }
}
