/* One CPU decode step of a Llama-family decoder in float32: every layer in one call.
 *
 * Why native: at one to three rows the linears stream the weights at the machine's read bandwidth through
 * MKL's gemm (the same BLAS call torch's F.linear makes), but the ~40 torch calls per layer around them (norms,
 * RoPE, the K/V store, attention, SiLU-and-mul, residual adds) cost ~10 ms of a ~30 ms step in Python and
 * dispatch. Here they are plain loops between the same BLAS calls. Called through ctypes with the GIL
 * released; the BLAS function comes from the caller (torch's own MKL), so threads and bits match torch's.
 *
 * The elementwise math follows llama.py operation for operation, and this file is built without FMA
 * contraction, so RoPE, residuals and the norm's scaling round as torch does; reductions (the norm's mean,
 * attention's dot products and softmax) sum in another order, which differs from torch within float32 rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);

enum { W_IN_NORM, W_QKV, W_QKV_BIAS, W_O, W_POST_NORM, W_GATE_UP, W_DOWN, W_PER_LAYER };

typedef struct {
    int32_t hidden, heads, kv_heads, head_dim, inter, layers, block_size, table_width;
    int32_t threads; /* the OpenMP team for attention: torch's current width, so the governor's choice holds */
    float eps, scale;
    sgemm_fn gemm;
    const float *const *weights; /* W_PER_LAYER pointers per layer; W_QKV_BIAS may be NULL */
    const float *final_norm;
} Model;

/* y[n][out] = x[n][in] . w[out][in]^T (+ bias), as torch's addmm asks BLAS for it. */
static void linear(const Model *m, int n, const float *x, int in, const float *w, const float *bias, int out,
                   float *y) {
    const float one = 1.0f;
    float beta = 0.0f;
    if (bias) {
        for (int r = 0; r < n; r++) memcpy(y + (int64_t)r * out, bias, sizeof(float) * out);
        beta = 1.0f;
    }
    m->gemm("T", "N", &out, &n, &in, &one, w, &in, x, &in, &beta, y, &out);
}

static void rms_norm(const float *x, const float *w, int d, float eps, float *out) {
    double sum = 0.0;
    for (int i = 0; i < d; i++) sum += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(sum / d) + eps);
    for (int i = 0; i < d; i++) out[i] = w[i] * (x[i] * r);
}

/* Rotate-half RoPE in place on `count` heads of one token. */
static void rope(float *x, int count, int d, const float *cos, const float *sin) {
    const int half = d / 2;
    for (int h = 0; h < count; h++, x += d) {
        for (int i = 0; i < half; i++) {
            const float a = x[i], b = x[i + half];
            x[i] = a * cos[i] + (-b) * sin[i];
            x[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* Hot loops get one clone per instruction set and the loader picks one for this CPU (an ifunc): the library
 * stays portable (no -march=native), so an image can build it once for every x86-64 host. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PER_ISA __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PER_ISA
#endif

/* 16 independent partial sums: the compiler vectorizes this without reassociating anything. */
static inline float dot(const float *a, const float *b, int d) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= d; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (; i < d; i++) s += a[i] * b[i];
    for (int l = 0; l < 16; l++) s += acc[l];
    return s;
}

/* e^x for x <= 0 (softmax weights), within ~2 ulp of expf, in plain float arithmetic so that a loop of it
 * vectorizes: x = n ln2 + r, e^r by Cephes' expf polynomial, 2^n put in the exponent bits. */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f; /* e^-87 ~ 1.6e-38: still a normal float, and no weight that matters */
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (x * 1.44269504088896341f + shifter) - shifter;
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * r) * r + r + 1.0f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* Split-K decoding: the context of one token is cut into chunks of CHUNK positions, each (kv head, chunk) is
 * one work item, and the OpenMP team (torch's, at the width the engine set) shares the items; a kv head's K and
 * V rows are read once for all the query heads of its group. Each item leaves, per query head, its max score,
 * its sum of weights and its weighted sum of V, which merge() combines exactly as one softmax would. */
enum { CHUNK = 128 };

typedef struct {
    const Model *m;
    const float *q, *k_cache, *v_cache;
    const int32_t *table;
    int len, chunks;
    float *partial; /* per item and query head of its group: max, sum, then head_dim floats of output */
} Attention;

PER_ISA static void attend_chunk(const Attention *a, int item) {
    const Model *m = a->m;
    const int d = m->head_dim, group = m->heads / m->kv_heads, kv_dim = m->kv_heads * d, bs = m->block_size;
    const int g = item / a->chunks, first = (item % a->chunks) * CHUNK;
    const int count = a->len - first < CHUNK ? a->len - first : CHUNK;
    float scores[CHUNK];
    for (int h = 0; h < group; h++) {
        const float *qh = a->q + (int64_t)(g * group + h) * d;
        float *part = a->partial + ((int64_t)item * group + h) * (2 + d);
        float mx = -INFINITY;
        for (int j = 0; j < count; j++) {
            const int pos = first + j;
            const int64_t slot = (int64_t)a->table[pos / bs] * bs + pos % bs;
            scores[j] = dot(qh, a->k_cache + slot * kv_dim + (int64_t)g * d, d) * m->scale;
            if (scores[j] > mx) mx = scores[j];
        }
        float sum = 0.0f;
        for (int j = 0; j < count; j++) {
            scores[j] = exp_nonpositive(scores[j] - mx);
            sum += scores[j];
        }
        float *out = part + 2;
        memset(out, 0, sizeof(float) * d);
        for (int j = 0; j < count; j++) {
            const int pos = first + j;
            const int64_t slot = (int64_t)a->table[pos / bs] * bs + pos % bs;
            const float *vh = a->v_cache + slot * kv_dim + (int64_t)g * d, p = scores[j];
            for (int i = 0; i < d; i++) out[i] += p * vh[i];
        }
        part[0] = mx;
        part[1] = sum;
    }
}

static void merge(const Attention *a, float *out) {
    const Model *m = a->m;
    const int d = m->head_dim, group = m->heads / m->kv_heads;
    for (int head = 0; head < m->heads; head++) {
        const int g = head / group, h = head % group;
        const float *first = a->partial + ((int64_t)(g * a->chunks) * group + h) * (2 + d);
        float mx = -INFINITY;
        for (int c = 0; c < a->chunks; c++) {
            const float cm = first[(int64_t)c * group * (2 + d)];
            if (cm > mx) mx = cm;
        }
        float *oh = out + (int64_t)head * d, sum = 0.0f;
        memset(oh, 0, sizeof(float) * d);
        for (int c = 0; c < a->chunks; c++) {
            const float *part = first + (int64_t)c * group * (2 + d);
            const float w = a->chunks == 1 ? 1.0f : expf(part[0] - mx);
            sum += w * part[1];
            for (int i = 0; i < d; i++) oh[i] += w * part[2 + i];
        }
        const float inv = 1.0f / sum;
        for (int i = 0; i < d; i++) oh[i] *= inv;
    }
}

/* One token's attention over its first `len` cached tokens, all heads; out [heads * d]. partial: scratch for
 * kv_heads * ceil(len / CHUNK) * group * (2 + head_dim) floats. */
static void attend(const Model *m, const float *q, const float *k_cache, const float *v_cache,
                   const int32_t *table, int len, float *partial, float *out) {
    if (len <= 0) {
        memset(out, 0, sizeof(float) * m->heads * m->head_dim);
        return;
    }
    const Attention a = {m, q, k_cache, v_cache, table, len, (len + CHUNK - 1) / CHUNK, partial};
    const int items = m->kv_heads * a.chunks;
    /* Short contexts stay on this thread: waking the team costs more than the work. */
#pragma omp parallel for schedule(static) num_threads(m->threads) if (len > 2 * CHUNK)
    for (int item = 0; item < items; item++) attend_chunk(&a, item);
    merge(&a, out);
}

/* x [n][hidden]: the embeddings in, the final-normed hidden states out. cos, sin [n][head_dim]; k_caches,
 * v_caches: each layer's [blocks][block_size][kv_heads][head_dim]; slots [n] (-1: not stored); tables
 * [n][table_width]; lens [n] (context length including this token).
 * Returns 0, or -1 when scratch memory could not be had (x is then unchanged). */
int decode_step(const Model *m, int n, float *x, const float *cos, const float *sin, float *const *k_caches,
                float *const *v_caches, const int64_t *slots, const int32_t *tables, const int32_t *lens) {
    const int hd = m->hidden, d = m->head_dim, q_size = m->heads * d, kv_dim = m->kv_heads * d;
    const int qkv_size = q_size + 2 * kv_dim, inter = m->inter;
    int max_len = 1;
    for (int r = 0; r < n; r++)
        if (lens[r] > max_len) max_len = lens[r];
    const int64_t partial = (int64_t)m->heads * ((max_len + CHUNK - 1) / CHUNK) * (2 + d);
    const int64_t floats = (int64_t)n * (2 * hd + qkv_size + q_size + 3 * inter) + partial;
    float *scratch = malloc(sizeof(float) * floats);
    if (!scratch) return -1;
    float *h = scratch, *qkv = h + (int64_t)n * hd, *att = qkv + (int64_t)n * qkv_size;
    float *gu = att + (int64_t)n * q_size, *act = gu + (int64_t)n * 2 * inter, *y = act + (int64_t)n * inter;
    float *partial_out = y + (int64_t)n * hd;

    for (int l = 0; l < m->layers; l++) {
        const float *const *w = m->weights + (int64_t)l * W_PER_LAYER;
        float *kc = k_caches[l], *vc = v_caches[l];
        for (int r = 0; r < n; r++) rms_norm(x + (int64_t)r * hd, w[W_IN_NORM], hd, m->eps, h + (int64_t)r * hd);
        linear(m, n, h, hd, w[W_QKV], w[W_QKV_BIAS], qkv_size, qkv);
        for (int r = 0; r < n; r++) {
            float *row = qkv + (int64_t)r * qkv_size;
            rope(row, m->heads + m->kv_heads, d, cos + (int64_t)r * d, sin + (int64_t)r * d);
            if (slots[r] >= 0) {
                memcpy(kc + slots[r] * kv_dim, row + q_size, sizeof(float) * kv_dim);
                memcpy(vc + slots[r] * kv_dim, row + q_size + kv_dim, sizeof(float) * kv_dim);
            }
        }
        for (int r = 0; r < n; r++)
            attend(m, qkv + (int64_t)r * qkv_size, kc, vc, tables + (int64_t)r * m->table_width, lens[r], partial_out,
                   att + (int64_t)r * q_size);
        linear(m, n, att, q_size, w[W_O], NULL, hd, y);
        for (int64_t i = 0; i < (int64_t)n * hd; i++) x[i] = x[i] + y[i];
        for (int r = 0; r < n; r++)
            rms_norm(x + (int64_t)r * hd, w[W_POST_NORM], hd, m->eps, h + (int64_t)r * hd);
        linear(m, n, h, hd, w[W_GATE_UP], NULL, 2 * inter, gu);
        for (int r = 0; r < n; r++) {
            const float *g = gu + (int64_t)r * 2 * inter, *u = g + inter;
            float *a = act + (int64_t)r * inter;
            for (int i = 0; i < inter; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        linear(m, n, act, inter, w[W_DOWN], NULL, hd, y);
        for (int64_t i = 0; i < (int64_t)n * hd; i++) x[i] = x[i] + y[i];
    }
    for (int r = 0; r < n; r++) {
        rms_norm(x + (int64_t)r * hd, m->final_norm, hd, m->eps, h + (int64_t)r * hd);
        memcpy(x + (int64_t)r * hd, h + (int64_t)r * hd, sizeof(float) * hd);
    }
    free(scratch);
    return 0;
}
