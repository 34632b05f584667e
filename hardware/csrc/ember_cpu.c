/* Ember's native CPU kernels (AVX2 + FMA, OpenMP), built and loaded by
 * ember/hardware/cpu_kernels.py, which checks every argument before calling in.
 *
 *   ember_gemv_bf16               small-batch linear over bfloat16 weights
 *   ember_paged_decode_attention  one query token per request over the paged KV cache
 *   ember_greedy                  argmax and its log-probability, per row of logits
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

void ember_gemv_bf16(const float *x, const uint16_t *w, const float *b, float *y,
                     int64_t M, int64_t N, int64_t K, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; ++n) {
        const uint16_t *row = w + n * K;
        float bias = b ? b[n] : 0.0f;
        for (int64_t m = 0; m < M; ++m)
            y[m * N + n] = dot(row, x + m * K, K) + bias;
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
 * a KV head), Hq * D <= 16384.
 *
 * One task per request streams its blocks once, in memory order: a block holds
 * block_size whole rows of all KV heads, so K and V are read sequentially (reading
 * one head's rows at a time, strided, ran at a third of the bandwidth). Each key
 * row's G dot products run side by side (independent FMA chains); each value row is
 * loaded once and added into the G outputs of its head, which stay in L1. */
#define GROUP_CHUNK 8

void ember_paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                                  const int64_t *block_tables, const int64_t *context_lens, float *out,
                                  int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size,
                                  int64_t max_blocks, float scale, int nthreads) {
    const int64_t G = Hq / Hkv, row = Hkv * D;
    #pragma omp parallel num_threads(nthreads)
    {
        float *scores = NULL;  /* (Hq, L) */
        int64_t capacity = 0;
        float acc[16384];
        #pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; ++b) {
            const int64_t L = context_lens[b];
            const int64_t *table = block_tables + b * max_blocks;
            const float *qb = q + b * Hq * D;
            if (Hq * L > capacity) {
                free(scores);
                capacity = Hq * L * 2;
                scores = (float *)malloc(sizeof(float) * capacity);
            }
            for (int64_t t0 = 0; t0 < L; t0 += block_size) {
                const float *block = k_cache + table[t0 / block_size] * block_size * row;
                const int64_t n_t = L - t0 < block_size ? L - t0 : block_size;
                for (int64_t j = 0; j < n_t; ++j) {
                    for (int64_t h = 0; h < Hkv; ++h) {
                        const float *k = block + j * row + h * D;
                        for (int64_t g0 = 0; g0 < G; g0 += GROUP_CHUNK) {
                            const int64_t n = G - g0 < GROUP_CHUNK ? G - g0 : GROUP_CHUNK;
                            const float *qh = qb + (h * G + g0) * D;
                            __m256 a[GROUP_CHUNK];
                            for (int64_t g = 0; g < n; ++g) a[g] = _mm256_setzero_ps();
                            for (int64_t d = 0; d < D; d += 8) {
                                __m256 kv = _mm256_loadu_ps(k + d);
                                for (int64_t g = 0; g < n; ++g)
                                    a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + d), kv, a[g]);
                            }
                            for (int64_t g = 0; g < n; ++g) scores[(h * G + g0 + g) * L + t0 + j] = hsum(a[g]) * scale;
                        }
                    }
                }
            }
            float inv[4096];
            for (int64_t hq = 0; hq < Hq; ++hq) {
                float *s = scores + hq * L, m = -INFINITY;
                for (int64_t t = 0; t < L; ++t) m = s[t] > m ? s[t] : m;
                inv[hq] = 1.0f / sum_exp(s, L, m, 1);
            }
            memset(acc, 0, sizeof(float) * Hq * D);
            for (int64_t t0 = 0; t0 < L; t0 += block_size) {
                const float *block = v_cache + table[t0 / block_size] * block_size * row;
                const int64_t n_t = L - t0 < block_size ? L - t0 : block_size;
                for (int64_t j = 0; j < n_t; ++j) {
                    for (int64_t h = 0; h < Hkv; ++h) {
                        const float *v = block + j * row + h * D;
                        for (int64_t d = 0; d < D; d += 8) {
                            __m256 vv = _mm256_loadu_ps(v + d);
                            for (int64_t g = 0; g < G; ++g) {
                                const int64_t hq = h * G + g;
                                float *a = acc + hq * D + d;
                                _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(scores[hq * L + t0 + j]), vv,
                                                                    _mm256_loadu_ps(a)));
                            }
                        }
                    }
                }
            }
            float *o = out + b * Hq * D;
            for (int64_t hq = 0; hq < Hq; ++hq) {
                __m256 iv = _mm256_set1_ps(inv[hq]);
                for (int64_t d = 0; d < D; d += 8)
                    _mm256_storeu_ps(o + hq * D + d, _mm256_mul_ps(_mm256_loadu_ps(acc + hq * D + d), iv));
            }
        }
        free(scores);
    }
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

/* ember_rms_norm: per row of x (rows, H), out = w * (x / sqrt(mean(x^2) + eps)), in
 * float32; with `residual`, x + residual is normalized and also written to sum_out. */
void ember_rms_norm(const float *x, const float *residual, const float *w, float *out, float *sum_out,
                    int64_t rows, int64_t H, float eps, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 4)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * H;
        float *o = out + r * H;
        if (residual) {
            const float *rr = residual + r * H;
            float *s = sum_out + r * H;
            for (int64_t i = 0; i < H; ++i) s[i] = xr[i] + rr[i];
            xr = s;
        }
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= H; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum(acc);
        for (; i < H; ++i) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (i = 0; i < H; ++i) o[i] = w[i] * (xr[i] * inv);
    }
}

/* ember_rope: rotate-half rotary embedding in place on x (rows, heads, D), rows
 * row_stride floats apart, heads D apart: x = x * cos + rotate_half(x) * sin with
 * cos/sin rows of the caches (max_position, D) at positions[r]. Compiled without
 * FMA contraction, this gives PyTorch's numbers exactly. */
void ember_rope(float *x, int64_t rows, int64_t row_stride, int64_t heads, int64_t D, const int64_t *positions,
                const float *cos_cache, const float *sin_cache, int nthreads) {
    const int64_t half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 4)
    for (int64_t r = 0; r < rows; ++r) {
        const float *c = cos_cache + positions[r] * D, *s = sin_cache + positions[r] * D;
        for (int64_t h = 0; h < heads; ++h) {
            float *v = x + r * row_stride + h * D;
            for (int64_t i = 0; i < half; ++i) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + (-b) * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* ember_silu_mul: out[r, i] = silu(gu[r, i]) * gu[r, I + i] for gu (rows, 2 I). */
void ember_silu_mul(const float *gu, float *out, int64_t rows, int64_t I, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 4)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *o = out + r * I;
        int64_t i = 0;
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
