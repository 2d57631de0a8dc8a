/* The product over weight-only quantized weights (int8 per channel or per 32 as GGUF's Q8_0; Q4_0 / Q4_1),
 * stored in tiles of 16 output rows, four tiles to a group (native.h).
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
 * Why groups of four tiles: a few rows' product keeps a group's four tiles in flight (their multiply-add chains
 * hide each other's latency), and with the four side by side input by input it reads one sequential stream (64
 * bytes per input for int8) where four separate tiles made four streams 9 KB apart. All of SmolLM2's linears and
 * its lm_head at one row, two threads, AMD EPYC Zen 4: int8 5.5 -> 3.7 ms, Q8_0 6.9 -> 4.4 ms, 4-bit 5.7 ->
 * 3.8 ms (one thread: 9.7 -> 5.9, 12.5 -> 7.6, 11.0 -> 7.3). The threads split the outputs by whole groups.
 * From four rows up the product is bound by arithmetic, and one tile at a time with up to six rows (fewer widenings
 * per multiply-add) is faster again.
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

enum { TILE = 16, PER_GROUP = 4, ROW_BLOCK = 64, PREFETCH_INPUTS = 8 };

typedef int32_t v8si __attribute__((vector_size(32)));

/* Tile t's first value in a [groups][count][4][16] array (native.h): for the weights count = in, for per-32 scales
 * count = in / 32. Entry i of the tile follows at i * STRIDE. */
INLINE int64_t tile_at(int t, int count) {
    return ((int64_t)(t / PER_GROUP) * count * PER_GROUP + t % PER_GROUP) * TILE;
}

/* From one entry of a tile to the next: over the group's four tiles. */
enum { STRIDE = PER_GROUP * TILE };

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
 * tile t0 (T is 1, or 4 from a group's first tile). KIND is a constant at every call, so each kind compiles to its
 * own loop. */
INLINE void tiles_per_output(const int KIND, const int R, const int T, const float *x, int in, const QWeight *w,
                             int t0, float *y, int out) {
    const int64_t first = tile_at(t0, in);
    v8 acc[6][4][2] = {{{{0}}}};
    for (int i = 0; i < in; i++) {
        v8 wv[4][2];
        /* the stream a few inputs ahead (one row 5-10% faster, AMD EPYC Zen 4) */
        __builtin_prefetch((const char *)w->q + (first + (int64_t)(i + PREFETCH_INPUTS) * STRIDE) *
                                                    (KIND == Q_BF16 ? 2 : 1), 0, 0);
        for (int t = 0; t < T; t++) {
            const int64_t at = first + (int64_t)i * STRIDE + t * TILE; /* t0 + t stays in t0's group */
            if (KIND == Q_BF16) {
                wv[t][0] = bf16_to_float((const uint16_t *)w->q + at);
                wv[t][1] = bf16_to_float((const uint16_t *)w->q + at + 8);
            } else {
                wv[t][0] = int8_to_float((const int8_t *)w->q + at);
                wv[t][1] = int8_to_float((const int8_t *)w->q + at + 8);
            }
            for (int r = 0; r < R; r++) {
                const float xv = x[(int64_t)r * in + i];
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
 * multiplied. R rows x T tiles starting at tile t0 (T is 1, or 4 from a group's first tile); KIND a constant at
 * every call. */
INLINE void tiles_grouped(const int KIND, const int R, const int T, const float *x, int in, const QWeight *w,
                          int t0, float *y, int out) {
    const int group = KIND == Q_INT4 ? 32 : w->group, groups = in / group;
    const int64_t first = tile_at(t0, in), first_scale = tile_at(t0, groups);
    v8 acc[4][4][2] = {{{{0}}}};
    for (int g = 0; g < groups; g++) {
        v8 d[4][2], m[4][2] = {{{0}}};  /* m: the 4-bit kind only */
        for (int t = 0; t < T; t++) {
            const int64_t at = first_scale + (int64_t)g * STRIDE + t * TILE;
            d[t][0] = load(w->scale + at);
            d[t][1] = load(w->scale + at + 8);
            if (KIND == Q_INT4) {
                m[t][0] = load(w->min + at);
                m[t][1] = load(w->min + at + 8);
            }
        }
        for (int i = g * group; i < (g + 1) * group; i++) {
            v8 wv[4][2];
            __builtin_prefetch((const char *)w->q + (first + (int64_t)(i + PREFETCH_INPUTS) * STRIDE) /
                                                        (KIND == Q_INT4 ? 2 : 1), 0, 0);
            for (int t = 0; t < T; t++) {
                const int64_t at = first + (int64_t)i * STRIDE + t * TILE;
                if (KIND == Q_INT4) {
                    /* byte j: output j in the low nibble, output j + 8 in the high one */
                    const v8si v = bytes((const uint8_t *)w->q + at / 2);
                    wv[t][0] = to_float(v & 15) * d[t][0] + m[t][0];
                    wv[t][1] = to_float(v >> 4) * d[t][1] + m[t][1];
                } else {
                    const int8_t *p = (const int8_t *)w->q + at;
                    wv[t][0] = int8_to_float(p) * d[t][0];
                    wv[t][1] = int8_to_float(p + 8) * d[t][1];
                }
                for (int r = 0; r < R; r++) {
                    const float xv = x[(int64_t)r * in + i];
                    acc[r][t][0] += wv[t][0] * xv;
                    acc[r][t][1] += wv[t][1] * xv;
                }
            }
        }
    }
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++) store16(y + (int64_t)r * out, (t0 + t) * TILE, out, acc[r][t][0], acc[r][t][1]);
}

/* `rows` input rows through KERNEL, T tiles from tile t, up to MAX (at most six) rows at a time: each R a constant
 * of its own call. A case above MAX is never taken; it names R = 1 so that no kernel wider than MAX is built. */
#define ROWS_AT_A_TIME(MAX, T, KERNEL, KIND, rows, x, in, w, t, y, out)               \
    for (int r = 0; r < (rows);) {                                                    \
        const int R = (rows) - r >= (MAX) ? (MAX) : (rows) - r;                       \
        const float *xr = (x) + (int64_t)r * (in);                                    \
        float *yr = (y) + (int64_t)r * (out);                                         \
        switch (R) {                                                                  \
            case 6: KERNEL(KIND, (MAX) >= 6 ? 6 : 1, T, xr, in, w, t, yr, out); break; \
            case 5: KERNEL(KIND, (MAX) >= 5 ? 5 : 1, T, xr, in, w, t, yr, out); break; \
            case 4: KERNEL(KIND, (MAX) >= 4 ? 4 : 1, T, xr, in, w, t, yr, out); break; \
            case 3: KERNEL(KIND, (MAX) >= 3 ? 3 : 1, T, xr, in, w, t, yr, out); break; \
            case 2: KERNEL(KIND, 2, T, xr, in, w, t, yr, out); break;                 \
            default: KERNEL(KIND, 1, T, xr, in, w, t, yr, out); break;                \
        }                                                                             \
        r += R;                                                                       \
    }

/* Tiles t0 .. t1 - 1 (whole groups) for n rows. Up to six rows (four for the per-32 kinds): a group's four tiles at
 * once, as many rows at a time as 32 registers hold (three; two for the per-32 kinds, whose scales take registers
 * too). More rows: one tile at a time, six (four) rows at a time, skipping the last group's padding tiles. */
QUANT_ISA static void q_tiles(int n, const float *x, int in, const QWeight *w, int t0, int t1, int out, float *y) {
    const int per_output = w->kind == Q_BF16 || (w->kind == Q_INT8 && w->group >= in);
    const int last = (out + TILE - 1) / TILE;
    for (int t = t0; t < t1; t += PER_GROUP) {
        if (n <= (per_output ? 6 : 4)) {
            if (w->kind == Q_BF16) ROWS_AT_A_TIME(3, PER_GROUP, tiles_per_output, Q_BF16, n, x, in, w, t, y, out)
            else if (per_output) ROWS_AT_A_TIME(3, PER_GROUP, tiles_per_output, Q_INT8, n, x, in, w, t, y, out)
            else if (w->kind == Q_INT4) ROWS_AT_A_TIME(2, PER_GROUP, tiles_grouped, Q_INT4, n, x, in, w, t, y, out)
            else ROWS_AT_A_TIME(2, PER_GROUP, tiles_grouped, Q_INT8, n, x, in, w, t, y, out)
            continue;
        }
        for (int u = t; u < t + PER_GROUP && u < last; u++) {
            if (w->kind == Q_BF16) ROWS_AT_A_TIME(6, 1, tiles_per_output, Q_BF16, n, x, in, w, u, y, out)
            else if (per_output) ROWS_AT_A_TIME(6, 1, tiles_per_output, Q_INT8, n, x, in, w, u, y, out)
            else if (w->kind == Q_INT4) ROWS_AT_A_TIME(4, 1, tiles_grouped, Q_INT4, n, x, in, w, u, y, out)
            else ROWS_AT_A_TIME(4, 1, tiles_grouped, Q_INT8, n, x, in, w, u, y, out)
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
    const int groups = (out + TILE * PER_GROUP - 1) / (TILE * PER_GROUP);
#pragma omp parallel num_threads(m->threads)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        const int share = (groups + team - 1) / team, g0 = t * share, g1 = g0 + share < groups ? g0 + share : groups;
        const int t0 = g0 * PER_GROUP, t1 = g1 * PER_GROUP;
        /* Rows in blocks that stay in cache while the thread's tiles stream past them: one pass per block. */
        for (int r0 = 0; r0 < n && t0 < t1; r0 += ROW_BLOCK) {
            const int rows = n - r0 < ROW_BLOCK ? n - r0 : ROW_BLOCK;
            q_tiles(rows, x + (int64_t)r0 * in, in, w, t0, t1, out, y + (int64_t)r0 * out);
        }
    }
    return 0;
}
