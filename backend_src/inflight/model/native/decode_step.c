/* The CPU decode step of a Llama-family decoder in float32, natively.
 *
 * Why native: at one to three rows the linears stream the weights at the machine's read bandwidth through
 * MKL's gemm (the same BLAS call torch's F.linear makes), but the ~40 torch calls per layer around them (norms,
 * RoPE, the K/V store, attention, SiLU-and-mul, residual adds) cost ~10 ms of a ~30 ms step in Python and
 * dispatch. decode_step() runs every layer in one call, plain loops between those BLAS calls; the BLAS
 * function comes from the caller (torch's own MKL), so threads and bits match torch's. For more rows, where
 * oneDNN's packed linears beat BLAS and stay in torch, the pieces between them are exported one by one:
 * add_rms_norm_rows(), attention_rows() and silu_mul_rows(). Called through ctypes with the GIL released.
 *
 * The elementwise math follows llama.py operation for operation, and this file is built without FMA
 * contraction, so RoPE, residuals and the norm's scaling round as torch does; reductions (the norm's mean,
 * attention's dot products and softmax) sum in another order, and exp is a polynomial: these differ from
 * torch within float32 rounding.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

static inline float dot(const float *a, const float *b, int d);

/* y[r * out] += wo . x[r] for R rows at once (R a constant once inlined): each 16 weights are loaded once for all
 * R rows, and the 2R accumulator chains are independent, so at two to four rows the product stays bound by the
 * weights' streaming rather than by additions waiting on each other. Per row the sums run in dot()'s order
 * (lane l sums elements l, l + 16, ...; then halving adds; then the tail): a row's result has the same bits
 * whatever else shares the step. */
static inline __attribute__((always_inline)) void rows_dot(const int R, const float *x, int in, const float *wo,
                                                           float *y, int out) {
    v8 lo[4] = {{0}}, hi[4] = {{0}};
    int i = 0;
    for (; i + 16 <= in; i += 16) {
        /* 1 KB ahead: with two to four rows there are more instructions per weight loaded, so the core alone runs
         * less far ahead of its loads (all linears at 2-3 rows 10-15% faster on an EPYC Zen 3; at one row ~3%). */
        __builtin_prefetch(wo + i + 256, 0, 0);
        const v8 wl = *(const v8u *)(wo + i), wh = *(const v8u *)(wo + i + 8);
        for (int r = 0; r < R; r++) {
            lo[r] += wl * *(const v8u *)(x + (int64_t)r * in + i);
            hi[r] += wh * *(const v8u *)(x + (int64_t)r * in + i + 8);
        }
    }
    for (int r = 0; r < R; r++) {
        float lanes[16];
        memcpy(lanes, &lo[r], sizeof(v8));
        memcpy(lanes + 8, &hi[r], sizeof(v8));
        float s = reduce16(lanes);
        for (int j = i; j < in; j++) s += wo[j] * x[(int64_t)r * in + j];
        y[(int64_t)r * out] += s;
    }
}

/* y[n][out] = x[n][in] . w[out][in]^T for a few rows, without BLAS: each thread of the team streams its share of
 * the weight's rows once, for all n inputs, four rows at a time. For CPUs where the BLAS torch links is slow at a
 * few rows (MKL on AMD's: 1.5-2.5x oneDNN's time on this project's EPYCs), this reads the weights at the
 * memory's bandwidth at one row and beats oneDNN's packed kernels up to four (docs/cpu.md). */
PER_ISA static void few_rows_range(int n, const float *x, int in, const float *w, int o0, int o1, int out,
                                   float *y) {
    for (int o = o0; o < o1; o++) {
        const float *wo = w + (int64_t)o * in;
        float *yo = y + o;
        int r = 0;
        for (; r + 4 <= n; r += 4) rows_dot(4, x + (int64_t)r * in, in, wo, yo + (int64_t)r * out, out);
        const float *xr = x + (int64_t)r * in;
        switch (n - r) {
            case 3: rows_dot(3, xr, in, wo, yo + (int64_t)r * out, out); break;
            case 2: rows_dot(2, xr, in, wo, yo + (int64_t)r * out, out); break;
            case 1: rows_dot(1, xr, in, wo, yo + (int64_t)r * out, out); break;
        }
    }
}

static void few_rows_gemm(const Model *m, int n, const float *x, int in, const float *w, int out, float *y) {
#pragma omp parallel num_threads(m->threads)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        const int share = (out + team - 1) / team, o0 = t * share, o1 = o0 + share < out ? o0 + share : out;
        if (o0 < o1) few_rows_range(n, x, in, w, o0, o1, out, y);
    }
}

/* y[n][out] = x[n][in] . w[out][in]^T (+ bias): as torch's addmm asks BLAS for it, or natively without one.
 * Exported for the few-row linears outside the step too (the lm_head). */
void linear_rows(const Model *m, int n, const float *x, int in, const float *w, const float *bias, int out,
                 float *y) {
    const float one = 1.0f;
    float beta = 0.0f;
    if (bias) {
        for (int r = 0; r < n; r++) memcpy(y + (int64_t)r * out, bias, sizeof(float) * out);
        beta = 1.0f;
    } else if (!m->gemm) {
        memset(y, 0, sizeof(float) * n * out);
    }
    if (m->gemm)
        m->gemm("T", "N", &out, &n, &in, &one, w, &in, x, &in, &beta, y, &out);
    else
        few_rows_gemm(m, n, x, in, w, out, y);
}

/* A layer's linear in decode_step(): float weights, or QWeight descriptors where the model is quantized.
 * Returns 0, or -1 when scratch memory could not be had. */
static int layer_linear(const Model *m, int n, const float *x, int in, const float *w, const float *bias, int out,
                        float *y) {
    if (m->quantized) return q_linear_rows(m, n, x, in, (const QWeight *)w, bias, out, y);
    linear_rows(m, n, x, in, w, bias, out, y);
    return 0;
}

static void rms_norm(const float *x, const float *w, int d, float eps, float *out) {
    double sum = 0.0;
    for (int i = 0; i < d; i++) sum += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(sum / d) + eps);
    for (int i = 0; i < d; i++) out[i] = w[i] * (x[i] * r);
}

/* x [n][d] += add (when not NULL: the residual stream takes the last sublayer's output), then out = norm(x). */
void add_rms_norm_rows(int n, float *x, const float *add, const float *w, int d, float eps, float *out) {
    if (add)
        for (int64_t i = 0; i < (int64_t)n * d; i++) x[i] = x[i] + add[i];
    for (int r = 0; r < n; r++) rms_norm(x + (int64_t)r * d, w, d, eps, out + (int64_t)r * d);
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

/* 16 independent partial sums: the compiler vectorizes this without reassociating anything. */
static inline float dot(const float *a, const float *b, int d) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= d; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    float s = reduce16(acc);
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

/* e^x within ~2 ulp of expf, in plain float arithmetic so that a loop of it vectorizes: x = n ln2 + r, e^r by
 * Cephes' expf polynomial, 2^n put in the exponent bits. Clamped to [-87, 88], where 2^n stays a normal float:
 * e^-87 ~ 1.6e-38 is no softmax weight that matters, and SiLU is x / (1 + e^-x) ~ 0 or x there anyway. */
static inline float exp_clamped(float x) {
    if (x < -87.0f) x = -87.0f;
    if (x > 88.0f) x = 88.0f;
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

/* out [n][inter] = silu(gate) * up, from gate_up [n][2 * inter] (gate first, as the fused projection lays it). */
PER_ISA void silu_mul_rows(int n, const float *gate_up, int inter, float *out) {
    for (int r = 0; r < n; r++) {
        const float *g = gate_up + (int64_t)r * 2 * inter, *u = g + inter;
        float *a = out + (int64_t)r * inter;
        for (int i = 0; i < inter; i++) a[i] = g[i] / (1.0f + exp_clamped(-g[i])) * u[i];
    }
}

/* Split-K decoding: each row's context is cut into chunks of CHUNK positions, each (row, kv head, chunk) is one
 * work item, and the OpenMP team (torch's, at the width the engine set) shares the items; a chunk's K and V rows
 * are read from memory once for all the query heads of their group. Each item leaves, per query head, its max
 * score, its sum of weights and its weighted sum of V, which merge_row() combines exactly as one softmax would,
 * in a fixed order: the result does not depend on the team's width. */
enum { CHUNK = 128 };

typedef struct {
    const Model *m;
    const float *qkv; /* [n][q + 2 kv]: q of row r at qkv + r * qkv_size */
    const float *k_cache, *v_cache;
    const int32_t *tables, *lens;
    int n, qkv_size;
    const int64_t *first_item; /* [n + 1]: row r's items are first_item[r] .. first_item[r + 1] - 1 */
    float *partial;            /* per item and query head of its group: max, sum, then head_dim floats of output */
} Attention;

static int chunks_of(int len) { return len <= 0 ? 0 : (len + CHUNK - 1) / CHUNK; }

/* The attention item's arithmetic is contracted (multiply-adds fused): its sums already run in their own order
 * (the module comment), and fused, the dot products cost half the instructions. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

typedef int32_t v8i __attribute__((vector_size(32)));

/* Lane p = the sum of acc[p]'s eight lanes: an 8x8 transpose folded into the additions (three rounds of
 * shuffles and adds), instead of a horizontal reduction per position. */
static inline __attribute__((always_inline)) v8 transposed_sums(const v8 acc[8]) {
    const v8i even = {0, 8, 2, 10, 4, 12, 6, 14}, odd = {1, 9, 3, 11, 5, 13, 7, 15};
    const v8i lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8i lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    v8 pairs[4], quads[2];
    for (int p = 0; p < 4; p++) /* [a01 b01 a23 b23 a45 b45 a67 b67] for a = acc[2p], b = acc[2p + 1] */
        pairs[p] = __builtin_shuffle(acc[2 * p], acc[2 * p + 1], even) +
                   __builtin_shuffle(acc[2 * p], acc[2 * p + 1], odd);
    for (int p = 0; p < 2; p++) /* [a0123 b0123 c0123 d0123 a4567 b4567 c4567 d4567] */
        quads[p] = __builtin_shuffle(pairs[2 * p], pairs[2 * p + 1], lo2) +
                   __builtin_shuffle(pairs[2 * p], pairs[2 * p + 1], hi2);
    return __builtin_shuffle(quads[0], quads[1], lo4) + __builtin_shuffle(quads[0], quads[1], hi4);
}

/* scores[j] = scale * q . k_j for the chunk's `count` positions (K rows at k + offset[j]); d a multiple of 8.
 * Eight positions at a time, each with its own accumulator, summed across lanes together at the end. scores has
 * room for count rounded up to 8. */
static inline __attribute__((always_inline)) void chunk_scores(const float *q, const float *k, const int64_t *offset,
                                                               int count, int d, float scale, float *scores) {
    for (int j0 = 0; j0 < count; j0 += 8) {
        const float *rows[8];
        for (int p = 0; p < 8; p++) rows[p] = k + offset[j0 + p < count ? j0 + p : count - 1];
        v8 acc[8] = {{0}};
        for (int i = 0; i < d; i += 8) {
            const v8 qv = *(const v8u *)(q + i);
            for (int p = 0; p < 8; p++) acc[p] += qv * *(const v8u *)(rows[p] + i);
        }
        const v8 s = transposed_sums(acc) * scale;
        memcpy(scores + j0, &s, sizeof s);
    }
}

/* out[d] = sum over the chunk's positions of p_j v_j (V rows at v + offset[j]); d a multiple of 64: 64 outputs
 * at a time stay in eight registers while the positions stream past. */
static inline __attribute__((always_inline)) void chunk_values(const float *v, const int64_t *offset,
                                                               const float *p, int count, int d, float *out) {
    for (int i0 = 0; i0 < d; i0 += 64) {
        v8 o[8] = {{0}};
        for (int j = 0; j < count; j++) {
            const float *row = v + offset[j] + i0;
            const v8 pj = (v8){0} + p[j];
            for (int c = 0; c < 8; c++) o[c] += pj * *(const v8u *)(row + 8 * c);
        }
        memcpy(out + i0, o, sizeof o);
    }
}

PER_ISA static void attend_item(const Attention *a, int64_t item) {
    const Model *m = a->m;
    const int d = m->head_dim, group = m->heads / m->kv_heads, kv_dim = m->kv_heads * d, bs = m->block_size;
    int r = 0;
    while (item >= a->first_item[r + 1]) r++;
    const int chunks = chunks_of(a->lens[r]);
    const int64_t local = item - a->first_item[r];
    const int g = (int)(local / chunks), first = (int)(local % chunks) * CHUNK;
    const int count = a->lens[r] - first < CHUNK ? a->lens[r] - first : CHUNK;
    const int32_t *table = a->tables + (int64_t)r * m->table_width;
    const float *q = a->qkv + (int64_t)r * a->qkv_size;
    /* Where each position's K and V rows of this kv head are, found once for the whole group (walking the
     * block table: a division per position per head cost more than the dot products). */
    int64_t offset[CHUNK];
    for (int j = 0, block = first / bs, in_block = first % bs; j < count; j++) {
        offset[j] = ((int64_t)table[block] * bs + in_block) * kv_dim + (int64_t)g * d;
        if (++in_block == bs) {
            in_block = 0;
            block++;
        }
    }
    float scores[CHUNK + 8];
    for (int h = 0; h < group; h++) {
        const float *qh = q + (int64_t)(g * group + h) * d;
        float *part = a->partial + (item * group + h) * (2 + d);
        if (d % 8 == 0) {
            chunk_scores(qh, a->k_cache, offset, count, d, m->scale, scores);
        } else {
            for (int j = 0; j < count; j++) scores[j] = dot(qh, a->k_cache + offset[j], d) * m->scale;
        }
        float mx = -INFINITY;
        for (int j = 0; j < count; j++) mx = scores[j] > mx ? scores[j] : mx;
        for (int j = 0; j < count; j++) scores[j] = exp_clamped(scores[j] - mx); /* vectorizes: no sum here */
        float sum = 0.0f;
        for (int j = 0; j < count; j++) sum += scores[j];
        float *out = part + 2;
        if (d % 64 == 0) {
            chunk_values(a->v_cache, offset, scores, count, d, out);
        } else {
            memset(out, 0, sizeof(float) * d);
            for (int j = 0; j < count; j++) {
                const float *vh = a->v_cache + offset[j], p = scores[j];
                for (int i = 0; i < d; i++) out[i] += p * vh[i];
            }
        }
        part[0] = mx;
        part[1] = sum;
    }
}

#pragma GCC pop_options

/* Row r's output [heads * d] from its items' partial results (zeros for a row with no context). */
static void merge_row(const Attention *a, int r, float *out) {
    const Model *m = a->m;
    const int d = m->head_dim, group = m->heads / m->kv_heads, chunks = chunks_of(a->lens[r]);
    for (int head = 0; head < m->heads; head++) {
        float *oh = out + (int64_t)head * d;
        memset(oh, 0, sizeof(float) * d);
        if (!chunks) continue;
        const int g = head / group, h = head % group;
        const float *first = a->partial + ((a->first_item[r] + (int64_t)g * chunks) * group + h) * (2 + d);
        const int64_t stride = (int64_t)group * (2 + d);
        float mx = -INFINITY, sum = 0.0f;
        for (int c = 0; c < chunks; c++)
            if (first[c * stride] > mx) mx = first[c * stride];
        for (int c = 0; c < chunks; c++) {
            const float *part = first + c * stride;
            const float w = chunks == 1 ? 1.0f : expf(part[0] - mx);
            sum += w * part[1];
            for (int i = 0; i < d; i++) oh[i] += w * part[2 + i];
        }
        const float inv = 1.0f / sum;
        for (int i = 0; i < d; i++) oh[i] *= inv;
    }
}

/* One decode token per row: RoPE on q and k in place in qkv [n][q + 2 kv], the row's K and V stored at its slot
 * (-1: not stored), then attention over its first lens[r] cached tokens into out [n][q]. cos, sin [n][head_dim];
 * caches [blocks][block_size][kv_heads][head_dim]; tables [n][table_width].
 * Returns 0, or -1 when scratch memory could not be had (nothing attended). */
int attention_rows(const Model *m, int n, float *qkv, const float *cos, const float *sin, float *k_cache,
                   float *v_cache, const int64_t *slots, const int32_t *tables, const int32_t *lens, float *out) {
    const int d = m->head_dim, q_size = m->heads * d, kv_dim = m->kv_heads * d, qkv_size = q_size + 2 * kv_dim;
    const int group = m->heads / m->kv_heads;
    for (int r = 0; r < n; r++) {
        float *row = qkv + (int64_t)r * qkv_size;
        rope(row, m->heads + m->kv_heads, d, cos + (int64_t)r * d, sin + (int64_t)r * d);
        if (slots[r] >= 0) {
            memcpy(k_cache + slots[r] * kv_dim, row + q_size, sizeof(float) * kv_dim);
            memcpy(v_cache + slots[r] * kv_dim, row + q_size + kv_dim, sizeof(float) * kv_dim);
        }
    }
    int64_t *first_item = malloc(sizeof(int64_t) * (n + 1));
    if (!first_item) return -1;
    first_item[0] = 0;
    int64_t positions = 0;
    for (int r = 0; r < n; r++) {
        first_item[r + 1] = first_item[r] + (int64_t)m->kv_heads * chunks_of(lens[r]);
        positions += lens[r] > 0 ? lens[r] : 0;
    }
    const int64_t items = first_item[n];
    float *partial = malloc(sizeof(float) * (items * group * (2 + d) + 1));
    if (!partial) {
        free(first_item);
        return -1;
    }
    const Attention a = {m, qkv, k_cache, v_cache, tables, lens, n, qkv_size, first_item, partial};
    /* The team shares (row, chunk) pieces, each taking the chunk's items of every kv head in turn: a position's K
     * and V rows for all the heads sit side by side, so one thread reads them while they are near (16 rows at ~300
     * tokens of context: int8 SmolLM2's step 52.5 -> 44.5 ms, AMD EPYC Zen 4). With few pieces (one row) the items
     * are shared one by one, which balances the team better. Each item is computed as alone either way, so the
     * results do not change. A short context on one row stays on this thread: waking the team costs more than
     * the work. */
    const int64_t pieces = items / m->kv_heads;
    const int64_t units = pieces >= 4 * m->threads ? pieces : items;
#pragma omp parallel for schedule(dynamic, 1) num_threads(m->threads) if (positions > 2 * CHUNK)
    for (int64_t unit = 0; unit < units; unit++) {
        if (units == items) {
            attend_item(&a, unit);
            continue;
        }
        int r = 0;
        while (unit >= first_item[r + 1] / m->kv_heads) r++;
        const int64_t chunks = chunks_of(lens[r]), c = unit - first_item[r] / m->kv_heads;
        for (int g = 0; g < m->kv_heads; g++) attend_item(&a, first_item[r] + g * chunks + c);
    }
    for (int r = 0; r < n; r++) merge_row(&a, r, out + (int64_t)r * q_size);
    free(partial);
    free(first_item);
    return 0;
}

/* The whole step: x [n][hidden], the embeddings in, the final-normed hidden states out; k_caches, v_caches:
 * each layer's cache; the rest as attention_rows() takes it.
 * Returns 0, or -1 when scratch memory could not be had. */
int decode_step(const Model *m, int n, float *x, const float *cos, const float *sin, float *const *k_caches,
                float *const *v_caches, const int64_t *slots, const int32_t *tables, const int32_t *lens) {
    const int hd = m->hidden, q_size = m->heads * m->head_dim, kv_dim = m->kv_heads * m->head_dim;
    const int qkv_size = q_size + 2 * kv_dim, inter = m->inter;
    const int64_t floats = (int64_t)n * (2 * hd + qkv_size + q_size + 3 * inter);
    float *scratch = malloc(sizeof(float) * floats);
    if (!scratch) return -1;
    float *h = scratch, *qkv = h + (int64_t)n * hd, *att = qkv + (int64_t)n * qkv_size;
    float *gu = att + (int64_t)n * q_size, *act = gu + (int64_t)n * 2 * inter, *y = act + (int64_t)n * inter;
    int rc = 0;
    for (int l = 0; l < m->layers && rc == 0; l++) {
        const float *const *w = m->weights + (int64_t)l * W_PER_LAYER;
        add_rms_norm_rows(n, x, l ? y : NULL, w[W_IN_NORM], hd, m->eps, h);
        rc = layer_linear(m, n, h, hd, w[W_QKV], w[W_QKV_BIAS], qkv_size, qkv);
        if (rc == 0) rc = attention_rows(m, n, qkv, cos, sin, k_caches[l], v_caches[l], slots, tables, lens, att);
        if (rc == 0) rc = layer_linear(m, n, att, q_size, w[W_O], NULL, hd, y);
        if (rc != 0) break;
        add_rms_norm_rows(n, x, y, w[W_POST_NORM], hd, m->eps, h);
        rc = layer_linear(m, n, h, hd, w[W_GATE_UP], NULL, 2 * inter, gu);
        if (rc != 0) break;
        silu_mul_rows(n, gu, inter, act);
        rc = layer_linear(m, n, act, inter, w[W_DOWN], NULL, hd, y);
    }
    if (rc == 0) {
        add_rms_norm_rows(n, x, y, m->final_norm, hd, m->eps, h);
        memcpy(x, h, sizeof(float) * n * hd);
    }
    free(scratch);
    return rc;
}
