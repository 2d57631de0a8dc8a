/* The product over weight-only quantized weights (int8 per channel or per 32 as GGUF's Q8_0; Q4_0 / Q4_1),
 * stored in tiles of 16 output rows (native.h).
 *
 * Why tiles: a 16-output tile holds, input by input, the 16 weights that input meets, so one widening load gives
 * two vectors of weights, and one broadcast input value feeds 16 outputs' fused multiply-adds: each output sums
 * its inputs in order, in its own lane, with no horizontal additions. Several input rows share each widened
 * weight vector (up to six), so at 16 rows the product is bound by arithmetic at a rate close to oneDNN's float32
 * GEMM, and at one row (several tiles in flight) by the memory streaming a quarter (int8) or about a seventh
 * (4-bit) of float32's bytes. A per-output int8 scale goes on the output's sum; per-32 scales (Q8_0: q * s;
 * 4-bit: q * d + m) widen each weight in registers once for all the rows. An output's arithmetic does not depend
 * on the other rows of its step, so a request's logits do not depend on its batch.
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
#define INLINE static inline __attribute__((always_inline))

enum { TILE = 16, ROW_BLOCK = 64 };

typedef int32_t v8si __attribute__((vector_size(32)));

/* Eight bytes widened to int32 lanes, written as a vector built from eight loads: GCC turns that into one
 * widening load (vpmovsxbd / vpmovzxbd), where __builtin_convertvector on a byte vector became one scalar
 * conversion per element. */
INLINE v8 int8_to_float(const int8_t *p) {
    const v8si i = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
    return __builtin_convertvector(i, v8);
}

/* Eight bfloat16 values widened to float32 (exact: their bits are a float32's top half). */
INLINE v8 bf16_to_float(const uint16_t *p) {
    const v8si bits = (v8si){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]} << 16;
    v8 f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE v8si bytes(const uint8_t *p) { return (v8si){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]}; }

INLINE v8 to_float(v8si i) { return __builtin_convertvector(i, v8); }

INLINE v8 load(const float *p) { return *(const v8u *)p; }

/* A tile's 16 results of row r into y (the last tile of a matrix whose rows are not a multiple of 16: only the
 * outputs it has). */
INLINE void store16(float *y, int o, int out, v8 lo, v8 hi) {
    if (o + TILE <= out) {
        *(v8u *)(y + o) += lo;
        *(v8u *)(y + o + 8) += hi;
        return;
    }
    float lanes[TILE];
    memcpy(lanes, &lo, sizeof(v8));
    memcpy(lanes + 8, &hi, sizeof(v8));
    for (int j = 0; o + j < out; j++) y[o + j] += lanes[j];
}

/* The kinds with one scale per output (int8 as quantized at load) or none (bfloat16): R rows x T tiles starting at
 * tile t0. KIND is a constant at every call, so each kind compiles to its own loop. */
INLINE void tiles_per_output(const int KIND, const int R, const int T, const float *x, int in, const QWeight *w,
                             int t0, float *y, int out) {
    v8 acc[6][4][2] = {{{{0}}}};
    for (int i = 0; i < in; i++) {
        v8 wv[4][2];
        for (int t = 0; t < T; t++) {
            const int64_t at = ((int64_t)(t0 + t) * in + i) * TILE;
            if (KIND == Q_BF16) {
                wv[t][0] = bf16_to_float((const uint16_t *)w->q + at);
                wv[t][1] = bf16_to_float((const uint16_t *)w->q + at + 8);
            } else {
                wv[t][0] = int8_to_float((const int8_t *)w->q + at);
                wv[t][1] = int8_to_float((const int8_t *)w->q + at + 8);
            }
        }
        for (int r = 0; r < R; r++) {
            const float xv = x[(int64_t)r * in + i];
            for (int t = 0; t < T; t++) {
                acc[r][t][0] += wv[t][0] * xv;
                acc[r][t][1] += wv[t][1] * xv;
            }
        }
    }
    for (int t = 0; t < T; t++) {
        const float *s = KIND == Q_BF16 ? NULL : w->scale + (int64_t)(t0 + t) * TILE;
        for (int r = 0; r < R; r++) {
            if (KIND == Q_BF16)
                store16(y + (int64_t)r * out, (t0 + t) * TILE, out, acc[r][t][0], acc[r][t][1]);
            else
                store16(y + (int64_t)r * out, (t0 + t) * TILE, out, acc[r][t][0] * load(s), acc[r][t][1] * load(s + 8));
        }
    }
}

/* The kinds with a scale per block of inputs: int8 per `group` (GGUF's Q8_0: 32), each weight widened as q * s; and
 * 4-bit per 32, widened as q * d + m. Each weight is widened and scaled in registers once, shared by the rows, then
 * multiplied. R rows x T tiles starting at tile t0; KIND a constant at every call. */
INLINE void tiles_grouped(const int KIND, const int R, const int T, const float *x, int in, const QWeight *w,
                          int t0, float *y, int out) {
    v8 acc[4][2][2] = {{{{0}}}};
    const int group = KIND == Q_INT4 ? 32 : w->group, groups = in / group;
    for (int g = 0; g < groups; g++) {
        v8 d[2][2], m[2][2] = {{{0}}};  /* m: the 4-bit kind only */
        for (int t = 0; t < T; t++) {
            const int64_t at = ((int64_t)(t0 + t) * groups + g) * TILE;
            d[t][0] = load(w->scale + at);
            d[t][1] = load(w->scale + at + 8);
            if (KIND == Q_INT4) {
                m[t][0] = load(w->min + at);
                m[t][1] = load(w->min + at + 8);
            }
        }
        for (int i = g * group; i < (g + 1) * group; i++) {
            v8 wv[2][2];
            for (int t = 0; t < T; t++) {
                const int64_t at = (int64_t)(t0 + t) * in + i;
                if (KIND == Q_INT4) {
                    /* byte j: output j in the low nibble, output j + 8 in the high one */
                    const v8si v = bytes((const uint8_t *)w->q + at * (TILE / 2));
                    wv[t][0] = to_float(v & 15) * d[t][0] + m[t][0];
                    wv[t][1] = to_float(v >> 4) * d[t][1] + m[t][1];
                } else {
                    const int8_t *p = (const int8_t *)w->q + at * TILE;
                    wv[t][0] = int8_to_float(p) * d[t][0];
                    wv[t][1] = int8_to_float(p + 8) * d[t][1];
                }
            }
            for (int r = 0; r < R; r++) {
                const float xv = x[(int64_t)r * in + i];
                for (int t = 0; t < T; t++) {
                    acc[r][t][0] += wv[t][0] * xv;
                    acc[r][t][1] += wv[t][1] * xv;
                }
            }
        }
    }
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++) store16(y + (int64_t)r * out, (t0 + t) * TILE, out, acc[r][t][0], acc[r][t][1]);
}

/* `rows` input rows of tile t through KERNEL, up to six (or four) at a time: each R a constant of its own call. */
#define SIX_AT_A_TIME(KERNEL, KIND, rows, x, in, w, t, y, out)         \
    for (int r = 0; r < (rows);) {                                     \
        const int R = (rows) - r >= 6 ? 6 : (rows) - r;                \
        const float *xr = (x) + (int64_t)r * (in);                     \
        float *yr = (y) + (int64_t)r * (out);                          \
        switch (R) {                                                   \
            case 6: KERNEL(KIND, 6, 1, xr, in, w, t, yr, out); break;  \
            case 5: KERNEL(KIND, 5, 1, xr, in, w, t, yr, out); break;  \
            case 4: KERNEL(KIND, 4, 1, xr, in, w, t, yr, out); break;  \
            case 3: KERNEL(KIND, 3, 1, xr, in, w, t, yr, out); break;  \
            case 2: KERNEL(KIND, 2, 1, xr, in, w, t, yr, out); break;  \
            default: KERNEL(KIND, 1, 1, xr, in, w, t, yr, out); break; \
        }                                                              \
        r += R;                                                        \
    }
#define FOUR_AT_A_TIME(KERNEL, KIND, rows, x, in, w, t, y, out)        \
    for (int r = 0; r < (rows);) {                                     \
        const int R = (rows) - r >= 4 ? 4 : (rows) - r;                \
        const float *xr = (x) + (int64_t)r * (in);                     \
        float *yr = (y) + (int64_t)r * (out);                          \
        switch (R) {                                                   \
            case 4: KERNEL(KIND, 4, 1, xr, in, w, t, yr, out); break;  \
            case 3: KERNEL(KIND, 3, 1, xr, in, w, t, yr, out); break;  \
            case 2: KERNEL(KIND, 2, 1, xr, in, w, t, yr, out); break;  \
            default: KERNEL(KIND, 1, 1, xr, in, w, t, yr, out); break; \
        }                                                              \
        r += R;                                                        \
    }

/* Tiles t0 .. t1 - 1 for n rows. One row takes several tiles at once (their chains hide the FMA latency): four
 * where the registers allow, two for the per-32 kinds; more rows take one tile at a time, as many rows as 16
 * registers hold (six for the kinds with one scale per output or none, four for the per-32 kinds). */
QUANT_ISA static void q_tiles(int n, const float *x, int in, const QWeight *w, int t0, int t1, int out, float *y) {
    const int per_output = w->kind == Q_BF16 || (w->kind == Q_INT8 && w->group >= in);
    for (int t = t0; t < t1;) {
        if (per_output) {
            if (n == 1 && t + 4 <= t1) {
                if (w->kind == Q_BF16) tiles_per_output(Q_BF16, 1, 4, x, in, w, t, y, out);
                else tiles_per_output(Q_INT8, 1, 4, x, in, w, t, y, out);
                t += 4;
            } else {
                if (w->kind == Q_BF16) SIX_AT_A_TIME(tiles_per_output, Q_BF16, n, x, in, w, t, y, out)
                else SIX_AT_A_TIME(tiles_per_output, Q_INT8, n, x, in, w, t, y, out)
                t++;
            }
        } else if (n == 1 && t + 2 <= t1) {
            if (w->kind == Q_INT4) tiles_grouped(Q_INT4, 1, 2, x, in, w, t, y, out);
            else tiles_grouped(Q_INT8, 1, 2, x, in, w, t, y, out);
            t += 2;
        } else {
            if (w->kind == Q_INT4) FOUR_AT_A_TIME(tiles_grouped, Q_INT4, n, x, in, w, t, y, out)
            else FOUR_AT_A_TIME(tiles_grouped, Q_INT8, n, x, in, w, t, y, out)
            t++;
        }
    }
}

int q_linear_rows(const Model *m, int n, const float *x, int in, const QWeight *w, const float *bias, int out,
                  float *y) {
    for (int r = 0; r < n; r++) {
        if (bias)
            memcpy(y + (int64_t)r * out, bias, sizeof(float) * out);
        else
            memset(y + (int64_t)r * out, 0, sizeof(float) * out);
    }
    const int tiles = (out + TILE - 1) / TILE;
#pragma omp parallel num_threads(m->threads)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        const int share = (tiles + team - 1) / team, t0 = t * share, t1 = t0 + share < tiles ? t0 + share : tiles;
        /* Rows in blocks that stay in cache while the thread's tiles stream past them: one pass per block. */
        for (int r0 = 0; r0 < n && t0 < t1; r0 += ROW_BLOCK) {
            const int rows = n - r0 < ROW_BLOCK ? n - r0 : ROW_BLOCK;
            q_tiles(rows, x + (int64_t)r0 * in, in, w, t0, t1, out, y + (int64_t)r0 * out);
        }
    }
    return 0;
}
