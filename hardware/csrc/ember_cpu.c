/* Ember's native CPU kernels (AVX2 + FMA + F16C, OpenMP), built and loaded by
 * ember/hardware/cpu_kernels.py, which checks every argument before calling in.
 *
 *   ember_gemv_bf16               small-batch linear over bfloat16 weights
 *   ember_paged_decode_attention  one query token per request over the paged KV cache
 *   ember_greedy                  argmax and its log-probability, per row of logits
 *   ember_rms_norm, ember_rope, ember_silu_mul   fused layer ops
 *   ember_head_rms_norm, ember_gelu_tanh_mul, ember_scale   Gemma's and Qwen3's: per-head
 *                                 norms in place, GeGLU, the embedding's scale
 *   ember_kv_write, ember_embedding              a step's K/V into the paged cache (float32, bf16
 *                                 or float16 there); token rows
 *   ember_lora                    a step's LoRA products, each token under its adapter slot
 *   ember_replay                  runs a CPU graph: recorded calls of these kernels (and of
 *                                 ember_quant.c's), through their X__packed forms
 *
 * Attention and the layer ops come in two instantiations of one body: float32
 * tensors (ember_X) and bfloat16 tensors (ember_X_bf16, the CPU's bf16 path). The
 * bf16 ones compute in float32 and round each result to bf16 where PyTorch's bf16
 * ops round (every op's output), so both match PyTorch's numbers in their dtype.
 *
 * ember_gemv_bf16: y = x @ w.T + b for float32 x (M, K), bfloat16 w (N, K), float32
 * b (N) and y (M, N), M small (decode). A bf16 number is the upper half of a float32: widening it is a 16-bit shift,
 * exact, so this computes the float32 product of the bf16 weights while reading
 * half the bytes. Threads take contiguous ranges of weight rows (sequential
 * reads); each row is read from memory once and reused from L1 for every row of x.
 * Four accumulators over 32 columns per iteration keep the FMA latency hidden:
 * one row at a time ran at 2x the speed of four rows interleaved (8.6 vs 4.8 GB/s
 * on one core of a Zen 3 EPYC).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline __m256 bf16x8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> bfloat16, round to nearest even; NaN stays a (quiet) NaN, as in PyTorch */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 8 floats rounded to bf16, kept as float32 (the low 16 bits cleared) */
static inline __m256 round8_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}

/* Element access for a kernel body written once over float32 (bf16 = 0) and bfloat16
 * (bf16 = 1) tensors; always inlined with a constant flag, so each instantiation
 * carries no branch. Stores round to the tensor's dtype; `rnd` rounds a value as a
 * PyTorch op of that dtype rounds its result. */
#define INLINE static inline __attribute__((always_inline))
INLINE float ld1(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
INLINE void st1(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = float_to_bf16(v);
    else ((float *)p)[i] = v;
}
INLINE float rnd(float v, int bf16) { return bf16 ? bf16_to_float(float_to_bf16(v)) : v; }
INLINE __m256 ld8(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16x8((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}
/* The paged KV cache's element types: the compute dtype's, or a 16-bit cache beside
 * float32 queries (EngineConfig.kv_cache_dtype): widening either is exact */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 };
INLINE __m256 ldkv8(const void *p, int64_t i, int kv) {
    if (kv == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return ld8(p, i, kv == KV_BF16);
}
INLINE __m256 rnd8(__m256 v, int bf16) { return bf16 ? round8_bf16(v) : v; }
INLINE void st8(void *p, int64_t i, __m256 v, int bf16) {
    if (bf16) {
        __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round8_bf16(v)), 16);
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i),
                         _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
    } else {
        _mm256_storeu_ps((float *)p + i, v);
    }
}

static inline float dot(const uint16_t *w, const float *x, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(bf16x8(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(bf16x8(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(bf16x8(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(bf16x8(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8)
        a0 = _mm256_fmadd_ps(bf16x8(w + k), _mm256_loadu_ps(x + k), a0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; ++k)
        s += bf16_to_float(w[k]) * x[k];
    return s;
}

INLINE void gemv(const float *x, const uint16_t *w, const void *b, void *y, int64_t M, int64_t N, int64_t K,
                 int nthreads, int bf16) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; ++n) {
        const uint16_t *row = w + n * K;
        float bias = b ? ld1(b, n, bf16) : 0.0f;
        for (int64_t m = 0; m < M; ++m)
            st1(y, m * N + n, dot(row, x + m * K, K) + bias, bf16);
    }
}

void ember_gemv_bf16(const float *x, const uint16_t *w, const float *b, float *y,
                     int64_t M, int64_t N, int64_t K, int nthreads) {
    gemv(x, w, b, y, M, N, K, nthreads, 0);
}

/* ember_gemv_f32: the same for float32 weights (a float32 model's decode of a small
 * batch): one weight row read from memory once and reused from L1 for every row of x,
 * each output one dot product in a fixed order, so a row's numbers do not depend on the
 * other rows. oneDNN's one-row float32 product read SmolLM2's weights from memory at
 * about 17 GB/s on a 2-core AVX-512 EPYC; its blocking (so its summation order) also
 * follows the number of rows. */
static inline float dot_w32(const float *w, const float *x, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; ++k)
        s += w[k] * x[k];
    return s;
}

void ember_gemv_f32(const float *x, const float *w, const float *b, float *y,
                    int64_t M, int64_t N, int64_t K, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; ++n) {
        const float *row = w + n * K;
        float bias = b ? b[n] : 0.0f;
        for (int64_t m = 0; m < M; ++m)
            y[m * N + n] = dot_w32(row, x + m * K, K) + bias;
    }
}

/* ember_gemv_bf16_bf16: the same for bfloat16 x, b and y (the CPU's bf16 path); x is
 * widened to float32 once, y rounded to bf16 (PyTorch's bf16 linear accumulates in
 * float32 and rounds its output the same way). */
void ember_gemv_bf16_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y,
                          int64_t M, int64_t N, int64_t K, int nthreads) {
    float *xf = (float *)malloc(sizeof(float) * M * K);
    if (!xf) return;
    for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_float(x[i]);
    gemv(xf, w, b, y, M, N, K, nthreads, 1);
    free(xf);
}

/* ember_gemv_bf16_dp: ember_gemv_bf16_bf16 on the CPU's bfloat16 dot-product instruction
 * (AVX512-BF16's vdpbf16ps: 32 bf16 products per 512-bit instruction, added into float32
 * lanes; bf16 products are exact in float32; denormal inputs read as zero, as in
 * oneDNN's bf16 GEMM, which runs on the same instruction). The widening kernel above
 * spends 4 instructions per 8 products, so beyond one row it was compute-bound (6 rows
 * 1.9x oneDNN's packed product); this one reads each weight row once for all rows of x
 * and keeps each output one dot product in a fixed order, so every row's numbers are
 * those it gets alone (a speculative verification reproduces plain decoding). Called
 * only where the CPU has avx512_bf16 (cpu_kernels checks). */
#define BF16_DP_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
BF16_DP_TARGET static inline __m512 dpbf16(__m512 acc, const uint16_t *x, const uint16_t *w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x), (__m512bh)_mm512_loadu_si512(w));
}

BF16_DP_TARGET static float dot_bf16_dp(const uint16_t *w, const uint16_t *x, int64_t K) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {
        a0 = dpbf16(a0, x + k, w + k);
        a1 = dpbf16(a1, x + k + 32, w + k + 32);
        a2 = dpbf16(a2, x + k + 64, w + k + 64);
        a3 = dpbf16(a3, x + k + 96, w + k + 96);
    }
    for (; k + 32 <= K; k += 32)
        a0 = dpbf16(a0, x + k, w + k);
    if (k < K) {
        __mmask32 tail = (__mmask32)((1ull << (K - k)) - 1);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(tail, x + k),
                              (__m512bh)_mm512_maskz_loadu_epi16(tail, w + k));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

BF16_DP_TARGET void ember_gemv_bf16_dp(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y,
                                       int64_t M, int64_t N, int64_t K, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; ++n) {
        const uint16_t *row = w + n * K;
        float bias = b ? bf16_to_float(b[n]) : 0.0f;
        for (int64_t m = 0; m < M; ++m)
            y[m * N + n] = float_to_bf16(dot_bf16_dp(row, x + m * K, K) + bias);
    }
}

/* exp(x) for 8 floats: Cephes' expf polynomial (about 1 ulp); inputs below -88.38
 * (-inf included) give exactly 0, above 88.38 give exp(88.38). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* sum of exp(x[i] - m), i < n; x[i] = exp(x[i] - m) stored back when `store` */
static inline float sum_exp(float *x, int64_t n, float m, int store) {
    __m256 mv = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
        if (store) _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float s = hsum(acc);
    for (; i < n; ++i) {
        float e = expf(x[i] - m);
        if (store) x[i] = e;
        s += e;
    }
    return s;
}

static inline float dot_f32(const float *a, const float *b, int64_t D) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
    return hsum(acc);
}

/* ember_paged_decode_attention: out[b, hq] = softmax(scale * q[b, hq] . K) V over the
 * context_lens[b] cached tokens of request b, read in place from the paged cache
 * (k_cache, v_cache: (num_blocks, block_size, Hkv, D); token t of request b lives at
 * block block_tables[b, t / block_size], offset t % block_size). q, out: (B, Hq, D).
 * D is a multiple of 8 and Hq a multiple of Hkv (GQA: G = Hq / Hkv query heads share
 * a KV head), Hq * D <= 16384. window > 0: only the last `window` tokens (a sliding-window
 * layer; blocks before the window are not read); softcap > 0: each scaled score s becomes
 * softcap tanh(s / softcap) (Gemma 2).
 *
 * One task per request streams its blocks once, in memory order: a block holds
 * block_size whole rows of all KV heads, so K and V come from memory sequentially
 * (reading one head's rows at a time over the whole context, strided, ran at a third
 * of the bandwidth), and every head works on the block while it is in L1.
 * - Scores: per query head, 8 keys at a time, one FMA chain per key over D, reduced
 *   together by a tree of horizontal adds (reducing each score alone cost more than
 *   its dot product).
 * - Values: per query head, 64 dimensions of its output held in registers across the
 *   block's rows, loaded and stored once per block (once per row before).
 * At 128 requests x 180 tokens (SmolLM2's heads, bf16) a layer went from 1.59 to about
 * 1.1 ms with the cache in L3. */
/* prefetch `bytes` from p into L1, a cache line at a time */
static inline void prefetch(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)p + off, _MM_HINT_T0);
}

/* o[0 .. 8n) += sum_j s[j] * V row j (n_t rows of row elements from v), n <= 8 vectors */
INLINE void weigh_values(float *o, const float *s, const void *v_cache, int64_t v, int64_t row, int64_t n_t, int n,
                         int kv) {
    __m256 a[8];
    for (int i = 0; i < n; ++i) a[i] = _mm256_loadu_ps(o + 8 * i);
    for (int64_t j = 0; j < n_t; ++j) {
        const __m256 p = _mm256_set1_ps(s[j]);
        for (int i = 0; i < n; ++i) a[i] = _mm256_fmadd_ps(p, ldkv8(v_cache, v + j * row + 8 * i, kv), a[i]);
    }
    for (int i = 0; i < n; ++i) _mm256_storeu_ps(o + 8 * i, a[i]);
}

/* this thread's score buffer of at least n floats, kept between calls (a malloc and
 * free per call and thread cost more than a short decode's attention) */
static float *attention_scores(int64_t n) {
    static __thread float *scores = NULL;
    static __thread int64_t capacity = 0;
    if (n > capacity) {
        free(scores);
        capacity = n * 2;
        scores = (float *)malloc(sizeof(float) * capacity);
        if (!scores) capacity = 0;
    }
    return scores;
}

static inline __m256 hsum8(const __m256 a[8]) {
    /* [sum a0, sum a1, ..., sum a7] */
    __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    t0 = _mm256_hadd_ps(t0, t1);
    t2 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20), _mm256_permute2f128_ps(t0, t2, 0x31));
}

INLINE void paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                                   const int64_t *block_tables, const int64_t *context_lens, void *out,
                                   int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size,
                                   int64_t max_blocks, float scale, int nthreads, int bf16, int kv,
                                   int64_t window, float softcap) {
    const int64_t G = Hq / Hkv, row = Hkv * D;
    /* fewer requests than threads: one task per (request, KV head), so one decode's
     * heads share the cores; else one task per request, every head on each block */
    const int64_t splits = B < nthreads ? Hkv : 1, heads_per_task = Hkv / splits;
    #pragma omp parallel num_threads(nthreads)
    {
        float acc[16384], qf[16384];
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * splits; ++task) {
            const int64_t b = task / splits, hq0 = task % splits * heads_per_task * G, hq1 = hq0 + heads_per_task * G;
            const int64_t L = context_lens[b];
            /* a sliding window: keys from position t_lo on; blocks from the one holding it */
            const int64_t t_lo = window > 0 && L > window ? L - window : 0, t_first = t_lo / block_size * block_size;
            const int64_t *table = block_tables + b * max_blocks;
            const float *qb;
            if (bf16) {
                for (int64_t i = hq0 * D; i < hq1 * D; i += 8) _mm256_storeu_ps(qf + i, ld8(q, b * q_stride + i, 1));
                qb = qf;
            } else {
                qb = (const float *)q + b * q_stride;
            }
            float *scores = attention_scores(Hq * L);  /* (Hq, L) */
            if (!scores) {  /* out of memory: this task's heads say so */
                for (int64_t i = hq0 * D; i < hq1 * D; ++i) st1(out, b * Hq * D + i, NAN, bf16);
                continue;
            }
            const int64_t esize = kv == KV_F32 ? 4 : 2;
            for (int64_t t0 = t_first; t0 < L; t0 += block_size) {
                const int64_t block = table[t0 / block_size] * block_size * row;
                const int64_t n_t = L - t0 < block_size ? L - t0 : block_size;
                /* the next block's keys, a share per head: blocks lie anywhere in the pool */
                const char *next = t0 + block_size < L
                    ? (const char *)k_cache + table[t0 / block_size + 1] * block_size * row * esize : NULL;
                const int64_t share = (block_size * row * esize / 64 + Hq - 1) / Hq * 64;
                for (int64_t hq = hq0; hq < hq1; ++hq) {
                    if (next && splits == 1) prefetch(next + hq * share, share);
                    const float *qh = qb + hq * D;
                    const int64_t k = block + (hq / G) * D;
                    float *s = scores + hq * L + t0;
                    int64_t j = 0;
                    for (; j + 8 <= n_t; j += 8) {
                        __m256 a[8];
                        for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
                        for (int64_t d = 0; d < D; d += 8) {
                            const __m256 qv = _mm256_loadu_ps(qh + d);
                            for (int i = 0; i < 8; ++i)
                                a[i] = _mm256_fmadd_ps(qv, ldkv8(k_cache, k + (j + i) * row + d, kv), a[i]);
                        }
                        _mm256_storeu_ps(s + j, _mm256_mul_ps(hsum8(a), _mm256_set1_ps(scale)));
                    }
                    for (; j < n_t; ++j) {
                        __m256 a = _mm256_setzero_ps();
                        for (int64_t d = 0; d < D; d += 8)
                            a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), ldkv8(k_cache, k + j * row + d, kv), a);
                        s[j] = hsum(a) * scale;
                    }
                }
            }
            float inv[4096];
            for (int64_t hq = hq0; hq < hq1; ++hq) {
                float *s = scores + hq * L, m = -INFINITY;
                if (softcap > 0)  /* Gemma 2: softcap tanh(s / softcap), s already scaled */
                    for (int64_t t = t_lo; t < L; ++t) s[t] = softcap * tanhf(s[t] / softcap);
                for (int64_t t = t_lo; t < L; ++t) m = s[t] > m ? s[t] : m;
                inv[hq] = 1.0f / sum_exp(s + t_lo, L - t_lo, m, 1);
                for (int64_t t = t_first; t < t_lo; ++t) s[t] = 0.0f;  /* before the window: weight 0 */
            }
            memset(acc + hq0 * D, 0, sizeof(float) * (hq1 - hq0) * D);
            for (int64_t t0 = t_first; t0 < L; t0 += block_size) {
                const int64_t block = table[t0 / block_size] * block_size * row;
                const int64_t n_t = L - t0 < block_size ? L - t0 : block_size;
                const char *next = t0 + block_size < L
                    ? (const char *)v_cache + table[t0 / block_size + 1] * block_size * row * esize : NULL;
                const int64_t share = (block_size * row * esize / 64 + Hq - 1) / Hq * 64;
                for (int64_t hq = hq0; hq < hq1; ++hq) {
                    if (next && splits == 1) prefetch(next + hq * share, share);
                    const float *s = scores + hq * L + t0;
                    const int64_t v = block + (hq / G) * D;
                    int64_t d0 = 0;
                    for (; d0 + 64 <= D; d0 += 64)  /* a constant 8 accumulators: kept in registers */
                        weigh_values(acc + hq * D + d0, s, v_cache, v + d0, row, n_t, 8, kv);
                    if (d0 < D) weigh_values(acc + hq * D + d0, s, v_cache, v + d0, row, n_t, (D - d0) / 8, kv);
                }
            }
            for (int64_t hq = hq0; hq < hq1; ++hq) {
                const __m256 iv = _mm256_set1_ps(inv[hq]);
                for (int64_t d = 0; d < D; d += 8)
                    st8(out, (b * Hq + hq) * D + d, _mm256_mul_ps(_mm256_loadu_ps(acc + hq * D + d), iv), bf16);
            }
        }
    }
}

/* 0 if every request's length lies in [1, max_blocks * block_size] and every block id
 * it reads in [0, num_blocks); else -1 (a length) or -2 (a block id): the kernel reads
 * where the tables point */
static int check_tables(const int64_t *block_tables, const int64_t *context_lens, int64_t B, int64_t block_size,
                        int64_t max_blocks, int64_t num_blocks) {
    for (int64_t b = 0; b < B; ++b) {
        const int64_t L = context_lens[b], *table = block_tables + b * max_blocks;
        if (L < 1 || L > max_blocks * block_size) return -1;
        for (int64_t i = 0; i < (L + block_size - 1) / block_size; ++i)
            if (table[i] < 0 || table[i] >= num_blocks) return -2;
    }
    return 0;
}

int ember_paged_decode_attention(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                                 const int64_t *block_tables, const int64_t *context_lens, float *out,
                                 int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size,
                                 int64_t max_blocks, int64_t num_blocks, float scale, int nthreads,
                                 int64_t window, float softcap) {
    const int rc = check_tables(block_tables, context_lens, B, block_size, max_blocks, num_blocks);
    if (rc) return rc;
    paged_decode_attention(q, q_stride, k_cache, v_cache, block_tables, context_lens, out, B, Hq, Hkv, D, block_size,
                           max_blocks, scale, nthreads, 0, KV_F32, window, softcap);
    return 0;
}

int ember_paged_decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                                      const uint16_t *v_cache, const int64_t *block_tables,
                                      const int64_t *context_lens, uint16_t *out, int64_t B, int64_t Hq, int64_t Hkv,
                                      int64_t D, int64_t block_size, int64_t max_blocks, int64_t num_blocks,
                                      float scale, int nthreads, int64_t window, float softcap) {
    const int rc = check_tables(block_tables, context_lens, B, block_size, max_blocks, num_blocks);
    if (rc) return rc;
    paged_decode_attention(q, q_stride, k_cache, v_cache, block_tables, context_lens, out, B, Hq, Hkv, D, block_size,
                           max_blocks, scale, nthreads, 1, KV_BF16, window, softcap);
    return 0;
}

/* float32 q and out over a 16-bit cache: kv 1 (bfloat16) or 2 (float16) */
int ember_paged_decode_attention_kv16(const float *q, int64_t q_stride, const uint16_t *k_cache,
                                      const uint16_t *v_cache, const int64_t *block_tables,
                                      const int64_t *context_lens, float *out, int64_t B, int64_t Hq, int64_t Hkv,
                                      int64_t D, int64_t block_size, int64_t max_blocks, int64_t num_blocks,
                                      float scale, int nthreads, int kv, int64_t window, float softcap) {
    if (kv != KV_BF16 && kv != KV_F16) return -3;
    const int rc = check_tables(block_tables, context_lens, B, block_size, max_blocks, num_blocks);
    if (rc) return rc;
    if (kv == KV_BF16)
        paged_decode_attention(q, q_stride, k_cache, v_cache, block_tables, context_lens, out, B, Hq, Hkv, D,
                               block_size, max_blocks, scale, nthreads, 0, KV_BF16, window, softcap);
    else
        paged_decode_attention(q, q_stride, k_cache, v_cache, block_tables, context_lens, out, B, Hq, Hkv, D,
                               block_size, max_blocks, scale, nthreads, 0, KV_F16, window, softcap);
    return 0;
}

/* ember_greedy: per row of logits (rows, V): ids[r] = the first index of the row's
 * largest value (NaN never wins), logprobs[r] = its log-softmax, -log sum exp(x - max). */
static int64_t argmax_row(const float *x, int64_t V, float *max_out) {
    /* the maximum, 32 lanes at a time: MAXPS returns its second operand when either is
     * NaN, so a NaN in x never replaces the running maximum */
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    int64_t i = 0;
    for (; i + 32 <= V; i += 32) {
        m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
        m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
        m2 = _mm256_max_ps(_mm256_loadu_ps(x + i + 16), m2);
        m3 = _mm256_max_ps(_mm256_loadu_ps(x + i + 24), m3);
    }
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    for (int k = 0; k < 8; ++k)
        if (lanes[k] > m) m = lanes[k];
    for (; i < V; ++i)
        if (x[i] > m) m = x[i];
    *max_out = m;
    if (m == -INFINITY) return 0; /* nothing above -inf (all banned, or NaN) */
    /* its first index */
    const __m256 mv = _mm256_set1_ps(m);
    for (i = 0; i + 8 <= V; i += 8) {
        int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
        if (mask) return i + __builtin_ctz((unsigned)mask);
    }
    for (; i < V; ++i)
        if (x[i] == m) return i;
    return 0;
}

void ember_greedy(const float *logits, int64_t rows, int64_t V, int64_t *ids, float *logprobs, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const float *x = logits + r * V;
        float m;
        ids[r] = argmax_row(x, V, &m);
        logprobs[r] = m == -INFINITY ? NAN : -logf(sum_exp((float *)x, V, m, 0));
    }
}

/* ember_rms_norm: per row of x (rows, H), out = w * (x / sqrt(mean(x^2) + eps)), the
 * mean in float32; with `residual`, x + residual is normalized and also written to
 * sum_out. */
INLINE void rms_norm(const void *x, const void *residual, const void *w, void *out, void *sum_out,
                     int64_t rows, int64_t H, float eps, int nthreads, int bf16) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 4)
    for (int64_t r = 0; r < rows; ++r) {
        const void *xr = x;
        int64_t base = r * H;
        if (residual) {
            for (int64_t i = 0; i < H; ++i) st1(sum_out, base + i, ld1(x, base + i, bf16) + ld1(residual, base + i, bf16), bf16);
            xr = sum_out;
        }
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= H; i += 8) {
            __m256 v = ld8(xr, base + i, bf16);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum(acc);
        for (; i < H; ++i) ss += ld1(xr, base + i, bf16) * ld1(xr, base + i, bf16);
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (i = 0; i < H; ++i) st1(out, base + i, ld1(w, i, bf16) * rnd(ld1(xr, base + i, bf16) * inv, bf16), bf16);
    }
}

void ember_rms_norm(const float *x, const float *residual, const float *w, float *out, float *sum_out,
                    int64_t rows, int64_t H, float eps, int nthreads) {
    rms_norm(x, residual, w, out, sum_out, rows, H, eps, nthreads, 0);
}

void ember_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *w, uint16_t *out,
                         uint16_t *sum_out, int64_t rows, int64_t H, float eps, int nthreads) {
    rms_norm(x, residual, w, out, sum_out, rows, H, eps, nthreads, 1);
}

/* ember_rope: rotate-half rotary embedding in place on x (rows, heads, D), rows
 * row_stride elements apart, heads D apart: x = x * cos + rotate_half(x) * sin with
 * float32 cos/sin rows of the caches (max_position, D) at positions[r] (rounded to
 * bf16 first for bf16 x, as PyTorch's path casts them). Compiled without FMA
 * contraction, this gives PyTorch's numbers exactly. */
INLINE void rope(void *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t D, const int64_t *positions,
                 const float *cos_cache, const float *sin_cache, int nthreads, int bf16) {
    const int64_t half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 4)
    for (int64_t r = 0; r < rows; ++r) {
        const float *c = cos_cache + positions[r] * D, *s = sin_cache + positions[r] * D;
        for (int64_t h = 0; h < heads; ++h) {
            const int64_t v = r * row_stride + h * D;
            for (int64_t i = 0; i < half; ++i) {
                const float a = ld1(x, v + i, bf16), b = ld1(x, v + i + half, bf16);
                st1(x, v + i, rnd(a * rnd(c[i], bf16), bf16) + rnd((-b) * rnd(s[i], bf16), bf16), bf16);
                st1(x, v + i + half,
                    rnd(b * rnd(c[i + half], bf16), bf16) + rnd(a * rnd(s[i + half], bf16), bf16), bf16);
            }
        }
    }
}

void ember_rope(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t D, const int64_t *positions,
                const float *cos_cache, const float *sin_cache, int nthreads) {
    rope(x, rows, row_stride, heads, D, positions, cos_cache, sin_cache, nthreads, 0);
}

void ember_rope_bf16(uint16_t *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t D,
                     const int64_t *positions, const float *cos_cache, const float *sin_cache, int nthreads) {
    rope(x, rows, row_stride, heads, D, positions, cos_cache, sin_cache, nthreads, 1);
}

/* ember_silu_mul: out[r, i] = silu(gu[r, i]) * gu[r, I + i] for gu (rows, 2 I). */
INLINE void silu_mul(const void *gu, void *out, int64_t rows, int64_t I, int nthreads, int bf16) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 4)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t g = r * 2 * I, u = g + I, o = r * I;
        int64_t i = 0;
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            __m256 gv = ld8(gu, g + i, bf16);
            __m256 sg = rnd8(_mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv)))), bf16);
            st8(out, o + i, _mm256_mul_ps(sg, ld8(gu, u + i, bf16)), bf16);
        }
        for (; i < I; ++i) {
            const float gi = ld1(gu, g + i, bf16);
            st1(out, o + i, rnd(gi / (1.0f + expf(-gi)), bf16) * ld1(gu, u + i, bf16), bf16);
        }
    }
}

void ember_silu_mul(const float *gu, float *out, int64_t rows, int64_t I, int nthreads) {
    silu_mul(gu, out, rows, I, nthreads, 0);
}

void ember_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t I, int nthreads) {
    silu_mul(gu, out, rows, I, nthreads, 1);
}

/* ember_head_rms_norm: RMSNorm in place on each head of x (rows, heads, D), rows
 * row_stride elements apart, heads D apart (the q or k part of a fused qkv), with one
 * weight w (D) for every head: Qwen3's and Gemma 3's q/k norms, as rms_norm computes. */
INLINE void head_rms_norm(void *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t D, const void *w,
                          float eps, int nthreads, int bf16) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * heads > 16)
    for (int64_t t = 0; t < rows * heads; ++t) {
        const int64_t base = t / heads * row_stride + t % heads * D;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= D; i += 8) {
            __m256 v = ld8(x, base + i, bf16);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum(acc);
        for (; i < D; ++i) ss += ld1(x, base + i, bf16) * ld1(x, base + i, bf16);
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (i = 0; i < D; ++i) st1(x, base + i, ld1(w, i, bf16) * rnd(ld1(x, base + i, bf16) * inv, bf16), bf16);
    }
}

void ember_head_rms_norm(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t D, const float *w,
                         float eps, int nthreads) {
    head_rms_norm(x, rows, row_stride, heads, D, w, eps, nthreads, 0);
}

void ember_head_rms_norm_bf16(uint16_t *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t D,
                              const uint16_t *w, float eps, int nthreads) {
    head_rms_norm(x, rows, row_stride, heads, D, w, eps, nthreads, 1);
}

/* ember_gelu_tanh_mul: out[r, i] = gelu_tanh(gu[r, i]) * gu[r, I + i] for gu (rows, 2 I):
 * GeGLU (Gemma), gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) in
 * PyTorch's order of operations, rounded to the dtype before the product as PyTorch's
 * gelu rounds its output. */
INLINE void gelu_tanh_mul(const void *gu, void *out, int64_t rows, int64_t I, int nthreads, int bf16) {
    const float beta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 4)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t g = r * 2 * I, u = g + I, o = r * I;
        for (int64_t i = 0; i < I; ++i) {
            const float x = ld1(gu, g + i, bf16), cube = x * x * x, inner = beta * (x + kappa * cube);
            st1(out, o + i, rnd(0.5f * x * (1.0f + tanhf(inner)), bf16) * ld1(gu, u + i, bf16), bf16);
        }
    }
}

void ember_gelu_tanh_mul(const float *gu, float *out, int64_t rows, int64_t I, int nthreads) {
    gelu_tanh_mul(gu, out, rows, I, nthreads, 0);
}

void ember_gelu_tanh_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t I, int nthreads) {
    gelu_tanh_mul(gu, out, rows, I, nthreads, 1);
}

/* ember_scale: x[i] *= s in place for n elements (s already in x's dtype). */
INLINE void scale(void *x, int64_t n, float s, int bf16) {
    for (int64_t i = 0; i < n; ++i) st1(x, i, ld1(x, i, bf16) * s, bf16);
}

void ember_scale(float *x, int64_t n, float s) { scale(x, n, s, 0); }

void ember_scale_bf16(uint16_t *x, int64_t n, float s) { scale(x, n, s, 1); }

/* ember_kv_write: this step's K and V rows into the paged cache. Token t (row_elems
 * values, src_stride elements apart in k and v: views of a fused qkv) goes to cache slot
 * slots[t] of k_cache / v_cache (num_slots rows); a negative slot (a padding row of a
 * CPU graph) writes nothing. src and dst are KV_* types: the same (copied), or float32
 * rows into a bfloat16 or float16 cache (rounded to nearest even). -1, and nothing
 * written, if a slot is num_slots or more; -2 for another pair of types. */
static inline void kv_row(const void *src, int64_t i, void *dst, int64_t j, int64_t n, int src_type, int dst_type) {
    const int64_t size = dst_type == KV_F32 ? 4 : 2;
    if (src_type == dst_type) {
        memcpy((char *)dst + j * size, (const char *)src + i * (src_type == KV_F32 ? 4 : 2), n * size);
        return;
    }
    const float *x = (const float *)src + i;
    uint16_t *y = (uint16_t *)dst + j;
    int64_t e = 0;
    for (; dst_type == KV_F16 && e + 8 <= n; e += 8)
        _mm_storeu_si128((__m128i *)(y + e), _mm256_cvtps_ph(_mm256_loadu_ps(x + e), _MM_FROUND_TO_NEAREST_INT));
    for (; e < n; ++e)
        y[e] = dst_type == KV_BF16 ? float_to_bf16(x[e])
                                   : (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(x[e]), _MM_FROUND_TO_NEAREST_INT), 0);
}

int ember_kv_write(const void *k, const void *v, int64_t src_stride, const int64_t *slots, int64_t T,
                   void *k_cache, void *v_cache, int64_t num_slots, int64_t row_elems, int src_type, int dst_type,
                   int nthreads) {
    if (src_type != dst_type && !(src_type == KV_F32 && (dst_type == KV_BF16 || dst_type == KV_F16))) return -2;
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= num_slots) return -1;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (T > 256)
    for (int64_t t = 0; t < T; ++t) {
        if (slots[t] < 0) continue;
        kv_row(k, t * src_stride, k_cache, slots[t] * row_elems, row_elems, src_type, dst_type);
        kv_row(v, t * src_stride, v_cache, slots[t] * row_elems, row_elems, src_type, dst_type);
    }
    return 0;
}

/* ember_embedding: out[t] = table[ids[t]], rows of row_bytes of a (V, row) table. -1,
 * and nothing written, if an id lies outside [0, V). */
int ember_embedding(const char *table, int64_t V, int64_t row_bytes, const int64_t *ids, int64_t T, char *out) {
    for (int64_t t = 0; t < T; ++t)
        if (ids[t] < 0 || ids[t] >= V) return -1;
    for (int64_t t = 0; t < T; ++t) memcpy(out + t * row_bytes, table + ids[t] * row_bytes, row_bytes);
    return 0;
}

/* ember_lora: the LoRA products of one step (BaseBackend.lora_op): for every token t of
 * x (T, K) whose slot s = slots[t] is not negative,
 *     y[t] += (x[t] @ a[s R : s R + used[s]].T) @ bt[s R : s R + used[s]]
 * with a (S R, K) and bt (S R, N) (a slot's rows past used[s] are zero and skipped), x and
 * y rows x_stride / y_stride elements apart (views of a fused projection), float32 or
 * bf16 (every tensor, or bf16 a and bt beside float32 x and y: _w16; products in float32,
 * y rounded once). Two passes: each token's
 * used[s] dot products over K into a float buffer, then its y row in blocks of 64
 * columns, 8 accumulators over the ranks (bt read a row at a time). The step's tokens
 * come grouped by adapter, so a slot's A and B stay in the cache across its tokens.
 * Returns 1 (nothing written) for a slot outside 0..S-1 or a used count above R. */
INLINE int lora(const void *x, int64_t x_stride, void *y, int64_t y_stride, const void *a, const void *bt,
                const int64_t *slots, const int64_t *used, int64_t T, int64_t K, int64_t N, int64_t R, int64_t S,
                int nthreads, int bf16, int wbf16) {
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] >= S || (slots[t] >= 0 && (used[slots[t]] < 0 || used[slots[t]] > R))) return 1;
    float *tmp = attention_scores(T * R + 1);
    if (!tmp) return 2;
    const int64_t blocks = (N + 63) / 64;
    /* one parallel region (its start costs microseconds, 240 times a step): the ranks,
     * a barrier, then the output blocks */
    #pragma omp parallel num_threads(nthreads) if (T * blocks > 4)
    {
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < T * R; ++i) {
        const int64_t t = i / R, r = i % R, s = slots[t];
        if (s < 0 || r >= used[s]) continue;
        const int64_t row = (s * R + r) * K, xo = t * x_stride;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= K; k += 16) {
            acc0 = _mm256_fmadd_ps(ld8(a, row + k, wbf16), ld8(x, xo + k, bf16), acc0);
            acc1 = _mm256_fmadd_ps(ld8(a, row + k + 8, wbf16), ld8(x, xo + k + 8, bf16), acc1);
        }
        for (; k + 8 <= K; k += 8) acc0 = _mm256_fmadd_ps(ld8(a, row + k, wbf16), ld8(x, xo + k, bf16), acc0);
        float d = hsum(_mm256_add_ps(acc0, acc1));
        for (; k < K; ++k) d += ld1(a, row + k, wbf16) * ld1(x, xo + k, bf16);
        tmp[t * R + r] = d;
    }
    #pragma omp for schedule(static)
    for (int64_t i = 0; i < T * blocks; ++i) {
        const int64_t t = i / blocks, n0 = (i % blocks) * 64, s = slots[t];
        if (s < 0) continue;
        const int64_t yo = t * y_stride + n0, n1 = n0 + 64 <= N ? n0 + 64 : N;
        const float *u = tmp + t * R;
        if (n1 - n0 == 64) {
            __m256 acc[8];
            for (int j = 0; j < 8; ++j) acc[j] = ld8(y, yo + 8 * j, bf16);
            for (int64_t r = 0; r < used[s]; ++r) {
                const __m256 ur = _mm256_set1_ps(u[r]);
                const int64_t row = (s * R + r) * N + n0;
                for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(ur, ld8(bt, row + 8 * j, wbf16), acc[j]);
            }
            for (int j = 0; j < 8; ++j) st8(y, yo + 8 * j, acc[j], bf16);
        } else {
            for (int64_t n = n0; n < n1; ++n) {
                float v = ld1(y, t * y_stride + n, bf16);
                for (int64_t r = 0; r < used[s]; ++r) v += u[r] * ld1(bt, (s * R + r) * N + n, wbf16);
                st1(y, t * y_stride + n, v, bf16);
            }
        }
    }
    }
    return 0;
}

int ember_lora(const float *x, int64_t x_stride, float *y, int64_t y_stride, const float *a, const float *bt,
               const int64_t *slots, const int64_t *used, int64_t T, int64_t K, int64_t N, int64_t R, int64_t S,
               int nthreads) {
    return lora(x, x_stride, y, y_stride, a, bt, slots, used, T, K, N, R, S, nthreads, 0, 0);
}

/* float32 activations, bf16 adapter weights (beside a quantized base: half the bytes a decode streams) */
int ember_lora_w16(const float *x, int64_t x_stride, float *y, int64_t y_stride, const uint16_t *a,
                   const uint16_t *bt, const int64_t *slots, const int64_t *used, int64_t T, int64_t K, int64_t N,
                   int64_t R, int64_t S, int nthreads) {
    return lora(x, x_stride, y, y_stride, a, bt, slots, used, T, K, N, R, S, nthreads, 0, 1);
}

int ember_lora_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, const uint16_t *a,
                    const uint16_t *bt, const int64_t *slots, const int64_t *used, int64_t T, int64_t K, int64_t N,
                    int64_t R, int64_t S, int nthreads) {
    return lora(x, x_stride, y, y_stride, a, bt, slots, used, T, K, N, R, S, nthreads, 1, 1);
}

/* ---- CPU graphs (ember.hardware.cpu_graphs) ----------------------------------------
 * Every kernel a graph can record has a twin X__packed(const int64_t *a) taking its
 * arguments as one array (pointers as addresses, ints as values, a float as its
 * float32 bits in the low half), returning the kernel's code (0 for a void kernel).
 * ember_replay runs a recorded forward: one call per record, in order. */
typedef int (*packed_fn)(const int64_t *);
#define PTR(i) ((void *)(intptr_t)a[i])
static inline float packed_float(int64_t v) {
    uint32_t u = (uint32_t)v;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

int ember_gemv_bf16__packed(const int64_t *a) {
    ember_gemv_bf16(PTR(0), PTR(1), PTR(2), PTR(3), a[4], a[5], a[6], (int)a[7]);
    return 0;
}
int ember_gemv_f32__packed(const int64_t *a) {
    ember_gemv_f32(PTR(0), PTR(1), PTR(2), PTR(3), a[4], a[5], a[6], (int)a[7]);
    return 0;
}
int ember_gemv_bf16_dp__packed(const int64_t *a) {
    ember_gemv_bf16_dp(PTR(0), PTR(1), PTR(2), PTR(3), a[4], a[5], a[6], (int)a[7]);
    return 0;
}
int ember_gemv_bf16_bf16__packed(const int64_t *a) {
    ember_gemv_bf16_bf16(PTR(0), PTR(1), PTR(2), PTR(3), a[4], a[5], a[6], (int)a[7]);
    return 0;
}
int ember_paged_decode_attention__packed(const int64_t *a) {
    return ember_paged_decode_attention(PTR(0), a[1], PTR(2), PTR(3), PTR(4), PTR(5), PTR(6), a[7], a[8], a[9],
                                        a[10], a[11], a[12], a[13], packed_float(a[14]), (int)a[15], a[16],
                                        packed_float(a[17]));
}
int ember_paged_decode_attention_bf16__packed(const int64_t *a) {
    return ember_paged_decode_attention_bf16(PTR(0), a[1], PTR(2), PTR(3), PTR(4), PTR(5), PTR(6), a[7], a[8],
                                             a[9], a[10], a[11], a[12], a[13], packed_float(a[14]), (int)a[15],
                                             a[16], packed_float(a[17]));
}
int ember_rms_norm__packed(const int64_t *a) {
    ember_rms_norm(PTR(0), PTR(1), PTR(2), PTR(3), PTR(4), a[5], a[6], packed_float(a[7]), (int)a[8]);
    return 0;
}
int ember_rms_norm_bf16__packed(const int64_t *a) {
    ember_rms_norm_bf16(PTR(0), PTR(1), PTR(2), PTR(3), PTR(4), a[5], a[6], packed_float(a[7]), (int)a[8]);
    return 0;
}
int ember_rope__packed(const int64_t *a) {
    ember_rope(PTR(0), a[1], a[2], a[3], a[4], PTR(5), PTR(6), PTR(7), (int)a[8]);
    return 0;
}
int ember_rope_bf16__packed(const int64_t *a) {
    ember_rope_bf16(PTR(0), a[1], a[2], a[3], a[4], PTR(5), PTR(6), PTR(7), (int)a[8]);
    return 0;
}
int ember_silu_mul__packed(const int64_t *a) {
    ember_silu_mul(PTR(0), PTR(1), a[2], a[3], (int)a[4]);
    return 0;
}
int ember_silu_mul_bf16__packed(const int64_t *a) {
    ember_silu_mul_bf16(PTR(0), PTR(1), a[2], a[3], (int)a[4]);
    return 0;
}
int ember_head_rms_norm__packed(const int64_t *a) {
    ember_head_rms_norm(PTR(0), a[1], a[2], a[3], a[4], PTR(5), packed_float(a[6]), (int)a[7]);
    return 0;
}
int ember_head_rms_norm_bf16__packed(const int64_t *a) {
    ember_head_rms_norm_bf16(PTR(0), a[1], a[2], a[3], a[4], PTR(5), packed_float(a[6]), (int)a[7]);
    return 0;
}
int ember_gelu_tanh_mul__packed(const int64_t *a) {
    ember_gelu_tanh_mul(PTR(0), PTR(1), a[2], a[3], (int)a[4]);
    return 0;
}
int ember_gelu_tanh_mul_bf16__packed(const int64_t *a) {
    ember_gelu_tanh_mul_bf16(PTR(0), PTR(1), a[2], a[3], (int)a[4]);
    return 0;
}
int ember_scale__packed(const int64_t *a) {
    ember_scale(PTR(0), a[1], packed_float(a[2]));
    return 0;
}
int ember_scale_bf16__packed(const int64_t *a) {
    ember_scale_bf16(PTR(0), a[1], packed_float(a[2]));
    return 0;
}
int ember_kv_write__packed(const int64_t *a) {
    return ember_kv_write(PTR(0), PTR(1), a[2], PTR(3), a[4], PTR(5), PTR(6), a[7], a[8], (int)a[9], (int)a[10],
                          (int)a[11]);
}
int ember_paged_decode_attention_kv16__packed(const int64_t *a) {
    return ember_paged_decode_attention_kv16(PTR(0), a[1], PTR(2), PTR(3), PTR(4), PTR(5), PTR(6), a[7], a[8], a[9],
                                             a[10], a[11], a[12], a[13], packed_float(a[14]), (int)a[15],
                                             (int)a[16], a[17], packed_float(a[18]));
}
int ember_embedding__packed(const int64_t *a) {
    return ember_embedding(PTR(0), a[1], a[2], PTR(3), a[4], PTR(5));
}

int ember_lora__packed(const int64_t *a) {
    return ember_lora(PTR(0), a[1], PTR(2), a[3], PTR(4), PTR(5), PTR(6), PTR(7), a[8], a[9], a[10], a[11], a[12],
                      (int)a[13]);
}
int ember_lora_w16__packed(const int64_t *a) {
    return ember_lora_w16(PTR(0), a[1], PTR(2), a[3], PTR(4), PTR(5), PTR(6), PTR(7), a[8], a[9], a[10], a[11], a[12],
                          (int)a[13]);
}
int ember_lora_bf16__packed(const int64_t *a) {
    return ember_lora_bf16(PTR(0), a[1], PTR(2), a[3], PTR(4), PTR(5), PTR(6), PTR(7), a[8], a[9], a[10], a[11],
                           a[12], (int)a[13]);
}

/* ember_replay: n records, each [X__packed, number of arguments, arguments...], run in
 * order; 0, or the first failing call's code (its index in *failed, nothing after it run) */
int ember_replay(const int64_t *records, int64_t n, int64_t *failed) {
    for (int64_t i = 0; i < n; ++i) {
        const int rc = ((packed_fn)(intptr_t)records[0])(records + 2);
        if (rc) {
            *failed = i;
            return rc;
        }
        records += 2 + records[1];
    }
    return 0;
}
