/* The few-row product over weight-only quantized weights (int8 per channel or per 32, GGUF's Q8_0, Q4_0, Q4_1).
 *
 * Why: a decode step at a few rows is bound by how fast the weights stream from memory; int8 weights are a
 * quarter of float32's bytes and 4-bit ones an eighth (plus a scale per 32). Each weight is dequantized in
 * registers (w = q * scale (+ min), float32, rounded as that expression is), then multiplied with up to four
 * input rows exactly as decode_step.c's float product does: the same lanes, the same order of additions. So a
 * row's result is bit for bit the float product's over the dequantized weight, whatever the rows beside it.
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "native.h"

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

/* One 16-input step of R rows: lo/hi accumulate lanes 0-7 and 8-15, as rows_dot() in decode_step.c. */
#define ROWS_STEP(R, wl, wh, x, in, i)                                                   \
    for (int r = 0; r < (R); r++) {                                                      \
        lo[r] += (wl) * *(const v8u *)((x) + (int64_t)r * (in) + (i));                   \
        hi[r] += (wh) * *(const v8u *)((x) + (int64_t)r * (in) + (i) + 8);               \
    }

/* Each row's lanes reduced as the float product reduces them, then its tail inputs added in order. */
#define ROWS_FINISH(R, tail_weight, x, in, i, y, out)                                    \
    for (int r = 0; r < (R); r++) {                                                      \
        float lanes[16];                                                                 \
        memcpy(lanes, &lo[r], sizeof(v8));                                               \
        memcpy(lanes + 8, &hi[r], sizeof(v8));                                           \
        float sum = reduce16(lanes);                                                     \
        for (int j = (i); j < (in); j++) sum += (tail_weight) * (x)[(int64_t)r * (in) + j]; \
        (y)[(int64_t)r * (out)] += sum;                                                  \
    }

/* int8: scale per `group` inputs (group a multiple of 16, or the whole row). */
static inline __attribute__((always_inline)) void rows_dot_q8(const int R, const float *x, int in, const int8_t *q,
                                                              const float *scale, int group, float *y, int out) {
    v8 lo[4] = {{0}}, hi[4] = {{0}};
    int i = 0;
    /* Group by group, so the scale is read once per group (a division per chunk for its index cost more than
     * the chunk's arithmetic); chunks never straddle groups, only the row's tail may be short. */
    for (int g0 = 0, g = 0; g0 < in; g0 += group, g++) {
        const int g1 = g0 + group < in ? g0 + group : in;
        const float s = scale[g];
        for (; i + 16 <= g1; i += 16) {
            __builtin_prefetch(q + i + 1024, 0, 0);
            const v8 wl = int8_to_float(q + i) * s, wh = int8_to_float(q + i + 8) * s;
            ROWS_STEP(R, wl, wh, x, in, i)
        }
    }
    ROWS_FINISH(R, (float)q[j] * scale[j / group], x, in, i, y, out)
}

/* 4-bit, blocks of 32 (in a multiple of 32): w = d q + m, d and m per block. */
static inline __attribute__((always_inline)) void rows_dot_q4(const int R, const float *x, int in, const uint8_t *q,
                                                              const float *d, const float *mn, float *y, int out) {
    v8 lo[4] = {{0}}, hi[4] = {{0}};
    for (int b = 0; b < in / 32; b++) {
        const uint8_t *block = q + (int64_t)b * 16;
        __builtin_prefetch(block + 1024, 0, 0);
        const v8si first = bytes(block), second = bytes(block + 8);
        const float s = d[b], m = mn[b];
        const int i = b * 32;
        /* inputs i .. i + 15: the low nibbles of bytes 0-7, then of bytes 8-15 */
        const v8 w0 = to_float(first & 15) * s + m, w1 = to_float(second & 15) * s + m;
        ROWS_STEP(R, w0, w1, x, in, i)
        /* inputs i + 16 .. i + 31: the high nibbles */
        const v8 w2 = to_float(first >> 4) * s + m, w3 = to_float(second >> 4) * s + m;
        ROWS_STEP(R, w2, w3, x, in, i + 16)
    }
    ROWS_FINISH(R, 0.0f, x, in, in, y, out)
}

PER_ISA static void q_rows_range(int n, const float *x, int in, const QWeight *w, int o0, int o1, int out,
                                 float *y) {
    const int64_t q_row = w->kind == Q_INT4 ? in / 2 : in; /* bytes per output row */
    const int per_row = w->kind == Q_INT4 ? in / 32 : (in + w->group - 1) / w->group; /* scales per row */
    for (int o = o0; o < o1; o++) {
        const float *scale = w->scale + (int64_t)o * per_row;
        float *yo = y + o;
        for (int r = 0; r < n;) {
            const int R = n - r >= 4 ? 4 : n - r;
            const float *xr = x + (int64_t)r * in;
            float *yr = yo + (int64_t)r * out;
            if (w->kind == Q_INT4) {
                const uint8_t *q = (const uint8_t *)w->q + o * q_row;
                const float *mn = w->min + (int64_t)o * per_row;
                switch (R) {
                    case 4: rows_dot_q4(4, xr, in, q, scale, mn, yr, out); break;
                    case 3: rows_dot_q4(3, xr, in, q, scale, mn, yr, out); break;
                    case 2: rows_dot_q4(2, xr, in, q, scale, mn, yr, out); break;
                    default: rows_dot_q4(1, xr, in, q, scale, mn, yr, out); break;
                }
            } else {
                const int8_t *q = (const int8_t *)w->q + o * q_row;
                switch (R) {
                    case 4: rows_dot_q8(4, xr, in, q, scale, w->group, yr, out); break;
                    case 3: rows_dot_q8(3, xr, in, q, scale, w->group, yr, out); break;
                    case 2: rows_dot_q8(2, xr, in, q, scale, w->group, yr, out); break;
                    default: rows_dot_q8(1, xr, in, q, scale, w->group, yr, out); break;
                }
            }
            r += R;
        }
    }
}

/* Rows are taken in blocks of ROW_BLOCK so that a block's inputs stay in cache while the team streams the
 * weights past them (at a prefill's hundreds of rows they would not); each block is one pass over the weights. */
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

/* dst[o - o0][in] = the float32 weights of rows o0 .. o1 - 1, rounded as the product rounds them: for steps of
 * many rows, whose arithmetic oneDNN or BLAS does better on float weights than the product above. */
void q_dequantize_rows(const Model *m, const QWeight *w, int in, int o0, int o1, float *dst) {
    const int64_t q_row = w->kind == Q_INT4 ? in / 2 : in;
    const int per_row = w->kind == Q_INT4 ? in / 32 : (in + w->group - 1) / w->group;
#pragma omp parallel for num_threads(m->threads) schedule(static)
    for (int o = o0; o < o1; o++) {
        const float *scale = w->scale + (int64_t)o * per_row;
        float *out = dst + (int64_t)(o - o0) * in;
        if (w->kind == Q_INT4) {
            const uint8_t *q = (const uint8_t *)w->q + o * q_row;
            const float *mn = w->min + (int64_t)o * per_row;
            for (int b = 0; b < in / 32; b++)
                for (int j = 0; j < 16; j++) {
                    const uint8_t byte = q[b * 16 + j];
                    out[b * 32 + j] = (float)(byte & 15) * scale[b] + mn[b];
                    out[b * 32 + j + 16] = (float)(byte >> 4) * scale[b] + mn[b];
                }
        } else {
            const int8_t *q = (const int8_t *)w->q + o * q_row;
            for (int g0 = 0, g = 0; g0 < in; g0 += w->group, g++) {
                const int g1 = g0 + w->group < in ? g0 + w->group : in;
                for (int i = g0; i < g1; i++) out[i] = (float)q[i] * scale[g];
            }
        }
    }
}
