/* What decode_step.c and quant_rows.c share: the model description passed from Python (native_decode.py mirrors
 * it with ctypes), quantized weights, and the vector types and per-ISA cloning both use. */
#ifndef INFLIGHT_NATIVE_H
#define INFLIGHT_NATIVE_H

#include <stdint.h>

typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);

enum { W_IN_NORM, W_QKV, W_QKV_BIAS, W_O, W_POST_NORM, W_GATE_UP, W_DOWN, W_PER_LAYER };

typedef struct {
    int32_t hidden, heads, kv_heads, head_dim, inter, layers, block_size, table_width;
    int32_t threads; /* the OpenMP team for attention: torch's current width, so the governor's choice holds */
    float eps, scale;
    sgemm_fn gemm;                /* decode_step() only; NULL: the native few-row product */
    const float *const *weights; /* decode_step() only: W_PER_LAYER pointers per layer; W_QKV_BIAS may be NULL */
    const float *final_norm;     /* decode_step() only */
    int32_t quantized;           /* decode_step() only: the linears' pointers in weights are QWeight* */
} Model;

/* A weight-only quantized [out][in] matrix in tiles of 16 output rows, four tiles to a group of 64 (the last group
 * padded), input-major inside a group: for each input, the group's four tiles side by side. One widening load
 * gives the 16 weights one input meets in a tile, and one row's product reads a group as one sequential stream
 * (quant_rows.c):
 * Q_INT8: q int8 [groups][in][4][16]; scale [groups * 64] (group = in: one per output, as quantized at load) or
 *   [groups][in / group][4][16] (group 32: GGUF's Q8_0).
 * Q_INT4: q [groups][in][4][8] bytes, byte j of a tile holding its output j in the low nibble and output j + 8 in
 *   the high one; scale (d) and min (m) [groups][in / 32][4][16]: w = d q + m per block of 32 inputs (Q4_0's
 *   w = d (q - 8) has m = -8 d).
 * Q_BF16: q bfloat16 bits [groups][in][4][16], no scale: CPU `dtype: bfloat16` weights, widened exactly. */
enum { Q_INT8 = 1, Q_INT4 = 2, Q_BF16 = 3 };

typedef struct {
    int32_t kind, group;
    const void *q;
    const float *scale;
    const float *min; /* Q_INT4 only */
} QWeight;

/* y[n][out] = x[n][in] . w^T (+ bias). Returns 0, or -1 when scratch memory could not be had. */
int q_linear_rows(const Model *m, int n, const float *x, int in, const QWeight *w, const float *bias, int out,
                  float *y);

/* Hot loops get one clone per instruction set and the loader picks one for this CPU (an ifunc): the library
 * stays portable (no -march=native), so an image can build it once for every x86-64 host. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PER_ISA __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PER_ISA
#endif

/* 8 floats: one ymm register in the avx2 and avx512f clones, two xmm in the default one. v8u may sit anywhere.
 * (Wider generic vectors than the target has are split by the compiler, badly: a 16-float type ran 3x slower.) */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

/* Halving adds rather than 16 in a row: each step is one vector add. */
static inline float reduce16(float *acc) {
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

#endif
