/* Ember's CPU kernels for GGUF quantized weights (OpenMP), built and loaded by
 * ember/hardware/cpu_quant.py, which checks every argument before calling in.
 *
 *   ember_quant_act     float32 activations (M, K) -> 8-bit blocks of 32: int8 q, float d,
 *                       and the int16 sum of q over each half block (what offsets need)
 *   ember_quant_linear  y = x @ W.T (+ b) for W (N, K) in a GGUF type and x given as
 *                       ember_quant_act's blocks, with one instruction set's kernel
 *   ember_quant_linear_f32  both in one call, from float32 x
 *   ember_quant_act_split, *_split  two-stage activations: x = d q + d' q' (the second
 *                       stage quantizes what the first leaves), about 15 bits per block
 *   ember_quant_dequant W -> float32 (N, K), the same numbers as gguf.quants.dequantize
 *   ember_quant_rows    chosen rows of W, dequantized (a quantized embedding table)
 *
 * The product is llama.cpp's: the activation row is quantized to 8 bits per block of 32
 * (d = max|x| / 127, q = round(x / d)) and every weight block's integers are multiplied
 * with the activation's integers exactly, in int32; each block's sum is then scaled in
 * float. Every type is written as  w = a * u + c  over sub-blocks, u an unsigned integer
 * (4, 5 or 6 bits), so  sum(w x) = a dx sum(u q) + c dx sum(q): the first term is what
 * the SIMD units do (unsigned x signed bytes), the second uses the block sums. Q8_0 is
 * signed: its sign moves onto the activation (|w| x sign(w) q), as llama.cpp does.
 *
 * One kernel body is compiled per instruction set (this file includes itself): avx2 (the
 * byte products by _mm256_maddubs_epi16 + _mm256_madd_epi16; pairs of products fit int16:
 * u <= 128 and |q| <= 127) and avx512vnni (_mm256_dpbusd_epi32, one instruction, no
 * intermediate int16; x8 products of X8Z_MIN_ROWS rows or more in 512-bit registers,
 * linear_x8_zmm), each under its own target attribute so one library serves every CPU
 * and Python picks what the CPU can run. "ref" is plain C, the check for the others.
 * The amx ISA is avx512vnni's kernels plus tile kernels for x8 products of many rows
 * (AMX-INT8, the same numbers; AMX-BF16, the bf16 mode's), after the x8 kernels below.
 */
#ifndef EMBER_QUANT_BODY
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define INLINE static inline __attribute__((always_inline))

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };
/* ISA_AMX is avx512vnni's kernels plus AMX-INT8 tiles for x8 products of AMX_MIN_ROWS rows or more */
enum { ISA_REF = 0, ISA_AVX2 = 1, ISA_AVX512VNNI = 2, ISA_AMX = 3 };

/* IEEE half -> float, exact (subnormals, infinities and NaN too) */
INLINE float f16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else {
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Q4_K / Q5_K: 8 six-bit scales and mins from 12 bytes */
INLINE void k_scale_min(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

static int64_t block_values(int type) {
    return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K ? 256 : 32;
}

static int64_t block_bytes(int type) {
    switch (type) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

/* ---- activations ----------------------------------------------------------------- */

INLINE int hsum_i32(__m256i v) {
    __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4e));
    x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xb1));
    return _mm_cvtsi128_si32(x);
}

/* llama.cpp's quantize_row_q8_0 (AVX2) for one block of 32 at p: d = max|x| / 127,
 * q = round(x / d) (to nearest even), s the sums of q over each half */
static inline __attribute__((always_inline)) void quant_block(const float *p, int8_t *q, float *d, int16_t *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(p + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float dd = _mm_cvtss_f32(m4) / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
    __m256i n[4];
    for (int j = 0; j < 4; j++)
        n[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(id)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    s[0] = (int16_t)hsum_i32(_mm256_add_epi32(n[0], n[1]));
    s[1] = (int16_t)hsum_i32(_mm256_add_epi32(n[2], n[3]));
    __m256i a = _mm256_packs_epi32(n[0], n[1]), b = _mm256_packs_epi32(n[2], n[3]);
    a = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, a);
    *d = dd;
}

void ember_quant_act(const float *x, int64_t M, int64_t K, int8_t *q, float *d, int16_t *s, int nthreads) {
    int64_t nb = K / 32;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K > 65536)
    for (int64_t i = 0; i < M * nb; i++) quant_block(x + i * 32, q + i * 32, d + i, s + 2 * i);
}

/* Two-stage activations: row i of x (M, K) as rows 2i and 2i + 1 of ember_quant_act's
 * blocks, 2i those of x itself and 2i + 1 those of what they leave, r = x - d q (each
 * value within d / 2, so the second stage's step is at most d / 254): x = d q + d' q'
 * to about 15 bits per block instead of 8 */
void ember_quant_act_split(const float *x, int64_t M, int64_t K, int8_t *q, float *d, int16_t *s, int nthreads) {
    int64_t nb = K / 32;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K > 32768)
    for (int64_t i = 0; i < M * nb; i++) {
        const int64_t m = i / nb, b = i % nb, hi = 2 * m * nb + b, lo = hi + nb;
        const float *p = x + i * 32;
        quant_block(p, q + hi * 32, d + hi, s + 2 * hi);
        float r[32];
        for (int j = 0; j < 32; j++) r[j] = p[j] - d[hi] * (float)q[hi * 32 + j];
        quant_block(r, q + lo * 32, d + lo, s + 2 * lo);
    }
}

/* ---- dequantization (the order of gguf.quants' float32 operations) ---------------- */

static void dequant_block(int type, const uint8_t *w, float *out) {
    switch (type) {
    case T_Q4_0: {
        float d = f16(w);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((w[2 + j] & 0x0f) - 8);
            out[j + 16] = d * (float)((w[2 + j] >> 4) - 8);
        }
        break;
    }
    case T_Q4_1: {
        float d = f16(w), m = f16(w + 2);
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)(w[4 + j] & 0x0f) + m;
            out[j + 16] = d * (float)(w[4 + j] >> 4) + m;
        }
        break;
    }
    case T_Q5_0: case T_Q5_1: {
        int has_min = type == T_Q5_1;
        float d = f16(w), m = has_min ? f16(w + 2) : 0.0f;
        const uint8_t *qh = w + (has_min ? 4 : 2), *qs = qh + 4;
        uint32_t h = (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) | ((uint32_t)qh[3] << 24);
        for (int j = 0; j < 16; j++) {
            int lo = (qs[j] & 0x0f) | (((h >> j) & 1) << 4), hi = (qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4);
            if (has_min) { out[j] = d * (float)lo + m; out[j + 16] = d * (float)hi + m; }
            else { out[j] = d * (float)(lo - 16); out[j + 16] = d * (float)(hi - 16); }
        }
        break;
    }
    case T_Q8_0: {
        float d = f16(w);
        for (int j = 0; j < 32; j++) out[j] = (float)(int8_t)w[2 + j] * d;
        break;
    }
    case T_Q4_K: case T_Q5_K: {
        float d = f16(w), dmin = f16(w + 2);
        uint8_t sc[8], mn[8];
        k_scale_min(w + 4, sc, mn);
        int five = type == T_Q5_K;
        const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
        for (int c = 0; c < 4; c++) {
            for (int half = 0; half < 2; half++) {
                int j = 2 * c + half;
                float dl = d * (float)sc[j], ml = dmin * (float)mn[j];
                for (int l = 0; l < 32; l++) {
                    int u = half ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 0x0f;
                    if (five) u |= ((qh[l] >> j) & 1) << 4;
                    out[32 * j + l] = dl * (float)u - ml;
                }
            }
        }
        break;
    }
    case T_Q6_K: {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        float d = f16(w + 208);
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++)
                for (int l = 0; l < 32; l++) {
                    int lo = ql[64 * h + 32 * (g & 1) + l], u = (g < 2 ? lo & 0x0f : lo >> 4);
                    u |= ((qh[32 * h + l] >> (2 * g)) & 3) << 4;
                    int e = 128 * h + 32 * g + l;
                    out[e] = (d * (float)sc[e / 16]) * (float)(u - 32);
                }
        break;
    }
    }
}

static int dequant_row_avx2(int type, const uint8_t *w, float *out, int64_t K);

/* many rows (prefill) dequantize tiles of W for a float GEMM: vectorized for the types
 * that have it (same operations, so the same numbers), block by block otherwise */
int ember_quant_dequant(int type, const uint8_t *w, int64_t N, int64_t K, float *out, int nthreads) {
    int64_t bv = block_values(type), bb = block_bytes(type);
    if (!bb || K % bv) return -1;
    int64_t nb = K / bv;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        if (dequant_row_avx2(type, w + n * nb * bb, out + n * K, K)) continue;
        for (int64_t b = 0; b < nb; b++) dequant_block(type, w + (n * nb + b) * bb, out + n * K + b * bv);
    }
    return 0;
}

/* ---- reference dot products: one weight row with one quantized activation row ---- */

/* sum over a 32-block of (a u + c) * dx q, with u the block's unsigned integers */
INLINE float ref_block(const uint8_t *u, float a, float c, const int8_t *q, float dx, const int16_t *s) {
    int sum = 0;
    for (int j = 0; j < 32; j++) sum += (int)u[j] * q[j];
    return a * dx * (float)sum + c * dx * (float)(s[0] + s[1]);
}

static float dot_ref(int type, const uint8_t *w, const int8_t *q, const float *dx, const int16_t *s, int64_t K) {
    float acc = 0.0f;
    uint8_t u[32];
    int64_t nb = K / block_values(type), bb = block_bytes(type);
    for (int64_t b = 0; b < nb; b++, w += bb) {
        switch (type) {
        case T_Q8_0: {
            float d = f16(w);
            int sum = 0;
            for (int j = 0; j < 32; j++) sum += (int)(int8_t)w[2 + j] * q[32 * b + j];
            acc += d * dx[b] * (float)sum;
            break;
        }
        case T_Q4_0: case T_Q4_1: {
            int has_min = type == T_Q4_1;
            const uint8_t *qs = w + (has_min ? 4 : 2);
            for (int j = 0; j < 16; j++) { u[j] = qs[j] & 0x0f; u[j + 16] = qs[j] >> 4; }
            float d = f16(w), c = has_min ? f16(w + 2) : -8.0f * d;
            acc += ref_block(u, d, c, q + 32 * b, dx[b], s + 2 * b);
            break;
        }
        case T_Q5_0: case T_Q5_1: {
            int has_min = type == T_Q5_1;
            const uint8_t *qh = w + (has_min ? 4 : 2), *qs = qh + 4;
            uint32_t h = (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) | ((uint32_t)qh[3] << 24);
            for (int j = 0; j < 16; j++) {
                u[j] = (qs[j] & 0x0f) | (((h >> j) & 1) << 4);
                u[j + 16] = (qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4);
            }
            float d = f16(w), c = has_min ? f16(w + 2) : -16.0f * d;
            acc += ref_block(u, d, c, q + 32 * b, dx[b], s + 2 * b);
            break;
        }
        case T_Q4_K: case T_Q5_K: {
            int five = type == T_Q5_K;
            float d = f16(w), dmin = f16(w + 2);
            uint8_t sc[8], mn[8];
            k_scale_min(w + 4, sc, mn);
            const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
            for (int j = 0; j < 8; j++) {
                int c = j / 2;
                for (int l = 0; l < 32; l++) {
                    u[l] = j & 1 ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 0x0f;
                    if (five) u[l] |= ((qh[l] >> j) & 1) << 4;
                }
                int64_t ab = 8 * b + j;
                acc += ref_block(u, d * (float)sc[j], -dmin * (float)mn[j], q + 32 * ab, dx[ab], s + 2 * ab);
            }
            break;
        }
        case T_Q6_K: {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *sc = (const int8_t *)(w + 192);
            float d = f16(w + 208);
            for (int h = 0; h < 2; h++)
                for (int g = 0; g < 4; g++) {
                    int64_t ab = 8 * b + 4 * h + g;
                    const int8_t *qa = q + 32 * ab;
                    for (int half = 0; half < 2; half++) {
                        int sum = 0;
                        for (int l = 16 * half; l < 16 * half + 16; l++) {
                            int lo = ql[64 * h + 32 * (g & 1) + l], uu = (g < 2 ? lo & 0x0f : lo >> 4);
                            uu |= ((qh[32 * h + l] >> (2 * g)) & 3) << 4;
                            sum += uu * qa[l];
                        }
                        float a = d * (float)sc[8 * h + 2 * g + half];
                        acc += a * dx[ab] * (float)sum - 32.0f * a * dx[ab] * (float)s[2 * ab + half];
                    }
                }
            break;
        }
        }
    }
    return acc;
}

/* w row, activation q, its block scales dx, half-block sums s, fs = dx * (s0 + s1) per block, K */
typedef float (*dot_fn)(const uint8_t *, const int8_t *, const float *, const int16_t *, const float *, int64_t);
/* one weight row against R <= ROWS activation rows (q, dx, fs of row r at r K, r K/32,
 * r K/32): R dot products into out, each the number dot_fn gives for that row alone */
#define ROWS 4
/* x8 products run their activation rows in blocks of this many, each block against
 * every weight group before the next: the block's 8-bit activations (256 x K bytes)
 * stay in the core's cache while the weights stream past, where a prefill of thousands
 * of rows re-read all of them from memory once per group */
#define X8_M_BLOCK 256
typedef void (*rows_fn)(const uint8_t *, const int8_t *, const float *, const float *, int64_t, int64_t, float *);

/* ---- 8 rows interleaved (x8) ------------------------------------------------------------
 * Q4_0, Q4_1 and Q8_0 weights whose row count is a multiple of 8 can be repacked (same
 * size, same numbers) so that one 256-bit product covers 8 output rows: for each group of
 * 8 rows and each block of 32 columns, the 8 rows' f16 scales d (and Q4_1's mins m), then
 * the values in 4-column chunks, chunk j of row n in 32-bit lane n. Q4 types hold chunk i
 * in the low nibbles and chunk i + 4 in the high nibbles of 32 bytes (i < 4); Q8_0 holds
 * chunk j's signed bytes in 32 bytes. A broadcast of the activation's 4 bytes of chunk j
 * against that register gives every row's partial sum at once: no horizontal sums, and
 * each group's scales convert in one instruction. */
static int64_t x8_head_bytes(int type) { return type == T_Q4_1 ? 32 : 16; }
static int x8_type(int type) { return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0; }

INLINE float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* ---- the SIMD bodies, once per instruction set ------------------------------------ */
#define EMBER_QUANT_BODY
#define SFX(name) name##_avx2
#define TARGET __attribute__((target("avx2,fma,f16c")))
#define DOT32(u, q) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (q)), _mm256_set1_epi16(1))
#define DOTACC(acc, u, q) _mm256_add_epi32((acc), DOT32(u, q))
#define HAS_VNNI 0
#include __FILE__
#undef SFX
#undef TARGET
#undef DOT32
#undef DOTACC
#undef HAS_VNNI
#define SFX(name) name##_avx512vnni
#define TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define DOT32(u, q) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (q))
#define DOTACC(acc, u, q) _mm256_dpbusd_epi32((acc), (u), (q))
#define HAS_VNNI 1
#include __FILE__
#undef SFX
#undef TARGET
#undef DOT32
#undef DOTACC
#undef HAS_VNNI

/* 32 values of a block as int32 -> float, times d (then + m): gguf's order, no FMA */
__attribute__((target("avx2,fma,f16c"))) INLINE void store32(__m256i bytes, int is_signed, __m256 d, __m256 m,
                                                       int has_min, int offset, float *out) {
    __m128i halves[2] = {_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)};
    for (int h = 0; h < 2; h++)
        for (int e = 0; e < 2; e++) {
            __m128i eight = e ? _mm_srli_si128(halves[h], 8) : halves[h];
            __m256i v = is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
            if (offset) v = _mm256_sub_epi32(v, _mm256_set1_epi32(offset));
            __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(v), d);
            if (has_min) f = _mm256_add_ps(f, m);
            _mm256_storeu_ps(out + 16 * h + 8 * e, f);
        }
}

__attribute__((target("avx2,fma,f16c"))) static int dequant_row_avx2(int type, const uint8_t *w, float *out, int64_t K) {
    if (type != T_Q4_0 && type != T_Q4_1 && type != T_Q8_0) return 0;
    int64_t bb = block_bytes(type);
    for (int64_t b = 0; b < K / 32; b++, w += bb, out += 32) {
        __m256 d = _mm256_set1_ps(h2f_avx2(w));
        if (type == T_Q8_0) store32(_mm256_loadu_si256((const __m256i *)(w + 2)), 1, d, d, 0, 0, out);
        else if (type == T_Q4_0) store32(nibbles16_avx2(w + 2), 0, d, d, 0, 8, out);
        else store32(nibbles16_avx2(w + 4), 0, d, _mm256_set1_ps(h2f_avx2(w + 2)), 1, 0, out);
    }
    return 1;
}

static dot_fn simd_dot(int isa, int type) {
    if (isa == ISA_AMX) isa = ISA_AVX512VNNI; /* tiles only for x8 products */
    if (isa == ISA_AVX2) return dot_for_type_avx2(type);
    if (isa == ISA_AVX512VNNI) return dot_for_type_avx512vnni(type);
    return 0;
}

static rows_fn simd_rows(int isa, int type) {
    if (isa == ISA_AMX) isa = ISA_AVX512VNNI;
    if (isa == ISA_AVX2) return rows_for_type_avx2(type);
    if (isa == ISA_AVX512VNNI) return rows_for_type_avx512vnni(type);
    return 0;
}

/* 1 where this library has a kernel for (isa, type); whether the CPU can run it is the caller's question */
int ember_quant_has_kernel(int isa, int type) {
    if (!block_bytes(type)) return 0;
    return isa == ISA_REF || simd_dot(isa, type) != 0;
}

int ember_quant_linear(int isa, int type, const uint8_t *w, int64_t N, int64_t K, const int8_t *q, const float *dx,
                       const int16_t *s, int64_t M, const float *bias, float *y, int nthreads) {
    int64_t bv = block_values(type), bb = block_bytes(type);
    if (!bb || K % bv || !ember_quant_has_kernel(isa, type)) return -1;
    int64_t row_bytes = K / bv * bb, nb = K / 32;
    dot_fn fn = simd_dot(isa, type);
    rows_fn rows = simd_rows(isa, type);
    /* each block's offset term needs dx * sum(q): once per activation block, not per weight row */
    float *fs = malloc((size_t)(M * nb) * sizeof(float));
    if (!fs) return -2;
    for (int64_t i = 0; i < M * nb; i++) fs[i] = dx[i] * (float)(s[2 * i] + s[2 * i + 1]);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
        float b = bias ? bias[n] : 0.0f;
        if (rows && M > 1) {
            float t[ROWS];
            for (int64_t m = 0; m < M; m += ROWS) {
                int64_t R = M - m < ROWS ? M - m : ROWS;
                rows(row, q + m * K, dx + m * nb, fs + m * nb, K, R, t);
                for (int64_t r = 0; r < R; r++) y[(m + r) * N + n] = t[r] + b;
            }
            continue;
        }
        for (int64_t m = 0; m < M; m++) {
            const int8_t *qm = q + m * K;
            const float *dm = dx + m * nb;
            const int16_t *sm = s + m * (K / 16);
            y[m * N + n] = (fn ? fn(row, qm, dm, sm, fs + m * nb, K) : dot_ref(type, row, qm, dm, sm, K)) + b;
        }
    }
    free(fs);
    return 0;
}

/* W (N, K) GGUF rows -> the x8 layout (N * row bytes, the same size); -1 for another type
 * or N % 8. A Q4 block's byte i holds value i (low nibble) and value i + 16 (high), so
 * its 4-byte chunks are already the x8 chunk pairs: the bytes only move (and back, in
 * unpack_x8_block) */
int ember_quant_repack_x8(int type, const uint8_t *w, int64_t N, int64_t K, uint8_t *out) {
    int64_t bb = block_bytes(type);
    if (!x8_type(type) || !bb || K % 32 || N % 8) return -1;
    const int64_t nb = K / 32, row_bytes = nb * bb, head = x8_head_bytes(type), chunks = type == T_Q8_0 ? 8 : 4;
    for (int64_t g = 0; g < N / 8; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *o = out + (g * nb + b) * 8 * bb;
            for (int64_t n = 0; n < 8; n++) {
                const uint8_t *blk = w + (g * 8 + n) * row_bytes + b * bb;
                memcpy(o + 2 * n, blk, 2);                               /* d */
                if (type == T_Q4_1) memcpy(o + 16 + 2 * n, blk + 2, 2); /* m */
                const uint8_t *qs = blk + (type == T_Q4_1 ? 4 : 2);
                for (int64_t i = 0; i < chunks; i++) memcpy(o + head + 32 * i + 4 * n, qs + 4 * i, 4);
            }
        }
    return 0;
}

/* one group-block of the x8 layout back into its 8 rows' GGUF blocks (row n's at
 * rows + n * row_bytes): the 4-byte chunks are the blocks' own bytes, moved */
static void unpack_x8_block(int type, const uint8_t *o, uint8_t *rows, int64_t row_bytes) {
    const int64_t head = x8_head_bytes(type), chunks = type == T_Q8_0 ? 8 : 4;
    for (int64_t n = 0; n < 8; n++) {
        uint8_t *blk = rows + n * row_bytes;
        memcpy(blk, o + 2 * n, 2);
        if (type == T_Q4_1) memcpy(blk + 2, o + 16 + 2 * n, 2);
        uint8_t *qs = blk + (type == T_Q4_1 ? 4 : 2);
        for (int64_t i = 0; i < chunks; i++) memcpy(qs + 4 * i, o + head + 32 * i + 4 * n, 4);
    }
}

/* the x8 layout -> float32 (N, K): ember_quant_dequant's numbers for the rows it came
 * from (each group's 8 rows rebuilt, then dequantized as ember_quant_dequant does) */
int ember_quant_dequant_x8(int type, const uint8_t *p, int64_t N, int64_t K, float *out, int nthreads) {
    int64_t bb = block_bytes(type);
    if (!x8_type(type) || !bb || K % 32 || N % 8) return -1;
    int64_t nb = K / 32, row_bytes = nb * bb;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        uint8_t *rows = malloc((size_t)(8 * row_bytes));
        if (!rows) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < N / 8; g++) {
            if (!rows) continue;
            for (int64_t b = 0; b < nb; b++) unpack_x8_block(type, p + (g * nb + b) * 8 * bb, rows + b * bb, row_bytes);
            for (int64_t n = 0; n < 8; n++) {
                float *o = out + (g * 8 + n) * K;
                if (dequant_row_avx2(type, rows + n * row_bytes, o, K)) continue;
                for (int64_t b = 0; b < nb; b++) dequant_block(type, rows + n * row_bytes + b * bb, o + 32 * b);
            }
        }
        free(rows);
    }
    return failed ? -2 : 0;
}

/* ember_quant_rows: out[t] = row ids[t] of W (N, K) dequantized, gguf's numbers bit for
 * bit, with W as read (x8 = 0) or in the x8 layout (a row's 8-row group is unpacked, then
 * the row dequantized as ember_quant_dequant does): token embeddings looked up in a
 * quantized table (a tied LM head's). -1, nothing written, for an id outside [0, N) or
 * an unsupported type or shape; -2 when out of memory. */
int ember_quant_rows(int type, const uint8_t *w, int64_t N, int64_t K, int x8, const int64_t *ids, int64_t T,
                     float *out, int nthreads) {
    const int64_t bv = block_values(type), bb = block_bytes(type);
    if (!bb || K % bv || (x8 && (!x8_type(type) || N % 8))) return -1;
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) return -1;
    const int64_t nb = K / bv, row_bytes = nb * bb;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (T > 16)
    {
        uint8_t *rows = x8 ? malloc((size_t)(8 * row_bytes)) : 0;
        if (x8 && !rows) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const uint8_t *row = w + ids[t] * row_bytes;
            if (x8) {
                if (!rows) continue;
                const int64_t g = ids[t] / 8;
                for (int64_t b = 0; b < nb; b++) unpack_x8_block(type, w + (g * nb + b) * 8 * bb, rows + b * bb, row_bytes);
                row = rows + ids[t] % 8 * row_bytes;
            }
            float *o = out + t * K;
            if (dequant_row_avx2(type, row, o, K)) continue;
            for (int64_t b = 0; b < nb; b++) dequant_block(type, row + b * bb, o + b * bv);
        }
        free(rows);
    }
    return failed ? -2 : 0;
}

/* The products' per-call buffers (8-bit activations, tiles) come from here: one buffer
 * per slot and calling thread, kept and grown, never freed (the largest product's: a few
 * MiB for a prompt). A fresh malloc beyond glibc's mmap threshold (128 KiB: 128 rows of
 * 1536 columns already) is new pages on every call, and on this project's virtual
 * machines their faults cost as much as the product: a 128-row AMX-BF16 product of
 * 1536 x 576 took 0.59 ms with malloc/free per call against 0.31 ms without (Intel Xeon,
 * one thread). 0 when out of memory. */
static _Thread_local void *scratch_buf[3];
static _Thread_local size_t scratch_cap[3];
static void *scratch(int slot, size_t bytes) {
    if (bytes > scratch_cap[slot]) {
        free(scratch_buf[slot]);
        scratch_buf[slot] = malloc(bytes);
        scratch_cap[slot] = scratch_buf[slot] ? bytes : 0;
    }
    return scratch_buf[slot];
}

/* float32 x (M, K) as ember_quant_act's blocks in scratch slot 0 (returned; 0 when out
 * of memory): q int8 (Mp, K), dx (Mp, K/32), s (Mp, K/16), the rows
 * past M (Mp >= M: AMX tiles take 16) all zeros */
static void *act_blocks(const float *x, int64_t M, int64_t Mp, int64_t K, int nthreads, int8_t **q, float **dx,
                        int16_t **s, int split) {
    const int64_t rows = split ? 2 * M : M;
    size_t nq = (size_t)(Mp * K), nx = (size_t)(rows * K);
    void *buf = scratch(0, nq + nq / 32 * sizeof(float) + nq / 16 * sizeof(int16_t));
    if (!buf) return 0;
    *q = buf;
    *dx = (float *)(*q + nq);
    *s = (int16_t *)(*dx + nq / 32);
    if (split) ember_quant_act_split(x, M, K, *q, *dx, *s, nthreads);
    else ember_quant_act(x, M, K, *q, *dx, *s, nthreads);
    memset(*q + nx, 0, nq - nx);
    memset(*dx + nx / 32, 0, (nq - nx) / 32 * sizeof(float));
    memset(*s + nx / 16, 0, (nq - nx) / 16 * sizeof(int16_t));
    return buf;
}

/* The x8 layout on AVX-512 (the avx512vnni ISA's products of X8Z_MIN_ROWS rows or more):
 * two groups of 8 rows side by side in one 512-bit register (lanes 0-7 group g, 8-15
 * group g + 1; a lone last group fills both halves and only the low one is stored), so
 * one _mm512_dpbusd_epi32 gives 16 output rows' partial sums where the 256-bit kernels'
 * products give 8. Q4_0's -8 and Q8_0's +128 (VNNI
 * multiplies unsigned bytes: w + 128, once per block) come off the integer sums exactly,
 * via the activation's block sums; the integer sums are exact in both kernels and each
 * lane's float operations run in linear_x8_avx2's order, so every output equals its bit
 * for bit. ROWS_Z activation rows per pass: a verification of 5 drafts (6 rows) is one.
 * Under X8Z_MIN_ROWS rows the 256-bit kernel is faster (AMD EPYC with AVX-512, SmolLM2's
 * layers streamed from memory: 1 row 2.9 against 3.7 ms, 4 rows 4.4 against 5.0; 6 rows
 * 4.7 against 5.2, 16 rows 10.8 against 17.3). */
#define ROWS_Z 6
#define X8Z_MIN_ROWS 5
#define TARGET_Z __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

TARGET_Z INLINE __m512i load_pair(const uint8_t *lo, const uint8_t *hi) {
    __m512i v = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo));
    return _mm512_inserti64x4(v, _mm256_loadu_si256((const __m256i *)hi), 1);
}

TARGET_Z INLINE __m512 scales_pair(const uint8_t *lo, const uint8_t *hi) { /* 8 + 8 f16 -> 16 floats */
    __m128i l = _mm_loadu_si128((const __m128i *)lo), h = _mm_loadu_si128((const __m128i *)hi);
    return _mm512_cvtph_ps(_mm256_set_m128i(h, l));
}

/* R (1..ROWS_Z) activation rows against one pair of groups; called with constant type
 * and R (x8z_tiles), so the loops over rows unroll and the accumulators stay in
 * registers. q, dx and s start at the tile's first row, y at its first output. */
TARGET_Z INLINE void x8z_tile(const int type, const int R, const uint8_t *lo, const uint8_t *hi, int64_t nb,
                              int64_t K, const int8_t *q, const float *dx, const int16_t *s, __mmask16 keep,
                              __m512 b16, float *y, int64_t N) {
    const int64_t gb = 8 * block_bytes(type), head = x8_head_bytes(type);
    const int q8 = type == T_Q8_0, has_min = type == T_Q4_1;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc[ROWS_Z], off[ROWS_Z];
    for (int r = 0; r < R; r++) acc[r] = off[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *ol = lo + b * gb, *oh = hi + b * gb;
        const __m512 d = scales_pair(ol, oh);
        const __m512 mn = has_min ? scales_pair(ol + 16, oh + 16) : _mm512_setzero_ps();
        __m512i u[8];
        if (q8) {
            for (int j = 0; j < 8; j++)
                u[j] = _mm512_xor_si512(load_pair(ol + head + 32 * j, oh + head + 32 * j), _mm512_set1_epi8((char)0x80));
        } else {
            for (int i = 0; i < 4; i++) {
                __m512i v = load_pair(ol + head + 32 * i, oh + head + 32 * i);
                u[i] = _mm512_and_si512(v, m4);
                u[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t ib = r * nb + b;
            const uint8_t *xr = (const uint8_t *)(q + r * K + 32 * b);
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int j = 0; j < 8; j += 2) {
                int32_t c0, c1;
                memcpy(&c0, xr + 4 * j, 4);
                memcpy(&c1, xr + 4 * j + 4, 4);
                s0 = _mm512_dpbusd_epi32(s0, u[j], _mm512_set1_epi32(c0));
                s1 = _mm512_dpbusd_epi32(s1, u[j + 1], _mm512_set1_epi32(c1));
            }
            __m512i sum = _mm512_add_epi32(s0, s1);
            const int32_t qsum = (int32_t)s[2 * ib] + (int32_t)s[2 * ib + 1];
            if (type == T_Q4_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * qsum));
            else if (q8) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * qsum));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(dx[ib])), acc[r]);
            if (has_min) off[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(dx[ib] * (float)qsum), off[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * N, keep, _mm512_add_ps(_mm512_add_ps(acc[r], off[r]), b16));
}

#define X8Z_CASE(T, R) \
    case (T) * 8 + (R): x8z_tile(T, R, lo, hi, nb, K, q, dx, s, keep, b16, y, N); break;
#define X8Z_CASES(T) X8Z_CASE(T, 1) X8Z_CASE(T, 2) X8Z_CASE(T, 3) X8Z_CASE(T, 4) X8Z_CASE(T, 5) X8Z_CASE(T, 6)
TARGET_Z static void x8z_tiles(int type, int R, const uint8_t *lo, const uint8_t *hi, int64_t nb, int64_t K,
                               const int8_t *q, const float *dx, const int16_t *s, __mmask16 keep, __m512 b16,
                               float *y, int64_t N) {
    switch (type * 8 + R) {
        X8Z_CASES(T_Q4_0)
        X8Z_CASES(T_Q4_1)
        X8Z_CASES(T_Q8_0)
    }
}
#undef X8Z_CASES
#undef X8Z_CASE

TARGET_Z static void linear_x8_zmm(int type, const uint8_t *p, int64_t N, int64_t K, const int8_t *q,
                                          const float *dx, const int16_t *s, int64_t M, const float *bias, float *y,
                                          int nthreads) {
    const int64_t nb = K / 32, gb = 8 * block_bytes(type), groups = N / 8;
#pragma omp parallel num_threads(nthreads)
    for (int64_t mb = 0; mb < M; mb += X8_M_BLOCK) {
        const int64_t me = M - mb < X8_M_BLOCK ? M : mb + X8_M_BLOCK;
#pragma omp for schedule(static) nowait
        for (int64_t pair = 0; pair < (groups + 1) / 2; pair++) {
            const int64_t g = 2 * pair;
            const int whole = g + 1 < groups;
            const __mmask16 keep = whole ? 0xffff : 0x00ff;
            const uint8_t *lo = p + g * nb * gb, *hi = whole ? lo + nb * gb : lo;
            const __m512 b16 = bias ? _mm512_maskz_loadu_ps(keep, bias + 8 * g) : _mm512_setzero_ps();
            for (int64_t m0 = mb; m0 < me; m0 += ROWS_Z)
                x8z_tiles(type, (int)(me - m0 < ROWS_Z ? me - m0 : ROWS_Z), lo, hi, nb, K, q + m0 * K, dx + m0 * nb,
                          s + 2 * m0 * nb, keep, b16, y + m0 * N + 8 * g, N);
        }
    }
}

/* ---- AMX-INT8 (the amx ISA) --------------------------------------------------------------
 * x8 products of AMX_MIN_ROWS rows or more on the tile unit: one TDPBSSD multiplies a tile
 * of 16 activation rows by one block (16 x 32 signed bytes) with a tile of one block of
 * 16 output rows (8 tile rows of 64 bytes: tile row j holds chunk j, columns 4j..4j+3, of
 * each output row n at bytes 4n..4n+3 -- the order the x8 layout already keeps a group's
 * chunks in), giving 16 x 16 int32 sums: 8192 multiply-adds where one _mm512_dpbusd_epi32
 * does 64. Every block has its own scales, so each block's sums leave the tile unit
 * (TILESTORED) and are scaled in AVX-512 exactly as x8z_tile scales its own: the integer
 * sums are the same (Q4_0's nibbles are unpacked as u - 8 and Q8_0's bytes multiply as
 * signed, which gives the corrected sums directly) and, per output, the float operations
 * run in the same order, so every output equals the 512-bit kernel's bit for bit (tested).
 * Per call, each stripe of 16 output rows is unpacked once into bytes (nb x 512 bytes:
 * 9 KiB at 576 columns) and every tile of 16 activation rows streams past it; activation
 * rows are padded to a multiple of 16 with zeros. The tile registers are configured in
 * each OpenMP thread and released at the end of the call; Linux lets a process use the
 * tile data only after asking (ember_quant_amx_init). */
#define AMX_MIN_ROWS 64
#define TARGET_AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
/* The tile instructions in inline assembly, each naming the memory it reads or writes as
 * an operand (GCC's _tile_loadd names none, so the compiler could move the stores of the
 * unpacked weights past it; a "memory" clobber instead would keep the accumulators in
 * memory). Every tile here is 512 contiguous bytes (activations and weights) or 1024
 * (the sums, rows of 64 bytes). */
#define AMX_LOAD(t, base, stride)                                                                          \
    __asm__ volatile("tileloadd (%1,%2,1), %%tmm" #t ::"m"(*(const int8_t(*)[512])(base)), "r"(base), \
                     "r"((long)(stride)))
#define AMX_STORE(t, base)                                                                               \
    __asm__ volatile("tilestored %%tmm" #t ", (%1,%2,1)" : "=m"(*(char(*)[1024])(base)) : "r"(base), "r"(64L))
#define AMX_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define AMX_DPBSSD(c, a, b) __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* 0 once Linux has granted this process the AMX tile data (ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA, then ARCH_GET_XCOMP_PERM to check); negative where it will not.
 * Until it has, the amx ISA's products refuse to run (a tile instruction would kill the
 * process with SIGILL). */
static int amx_granted;
int ember_quant_amx_init(void) {
#ifdef SYS_arch_prctl
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return -1;
    if (syscall(SYS_arch_prctl, 0x1022, &granted) || !(granted & (1ul << 18))) return -2;
    amx_granted = 1;
    return 0;
#else
    return -1;
#endif
}

/* the stripe of groups lo and hi (hi == lo for a lone last group) as B tiles: block b's 8
 * tile rows of 64 signed bytes at bt + 512 b, its 16 scales at d + 16 b, Q4_1's mins at
 * mn + 16 b */
TARGET_AMX static void amx_unpack(int type, const uint8_t *lo, const uint8_t *hi, int64_t nb, int8_t *bt, float *d,
                                  float *mn) {
    const int64_t gb = 8 * block_bytes(type), head = x8_head_bytes(type);
    const __m512i m4 = _mm512_set1_epi8(0x0f), zero = _mm512_set1_epi8(type == T_Q4_0 ? 8 : 0);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *ol = lo + b * gb, *oh = hi + b * gb;
        int8_t *o = bt + 512 * b;
        _mm512_storeu_ps(d + 16 * b, scales_pair(ol, oh));
        if (type == T_Q4_1) _mm512_storeu_ps(mn + 16 * b, scales_pair(ol + 16, oh + 16));
        if (type == T_Q8_0) {
            for (int j = 0; j < 8; j++) _mm512_storeu_si512(o + 64 * j, load_pair(ol + head + 32 * j, oh + head + 32 * j));
            continue;
        }
        for (int i = 0; i < 4; i++) {
            __m512i v = load_pair(ol + head + 32 * i, oh + head + 32 * i);
            _mm512_storeu_si512(o + 64 * i, _mm512_sub_epi8(_mm512_and_si512(v, m4), zero));
            _mm512_storeu_si512(o + 64 * (i + 4), _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), zero));
        }
    }
}

/* one block's 16 x 16 sums c into acc: acc[r] += float(c[r]) * (d * dx_r), x8z_tile's
 * operations; dx16 holds the block's 16 activation scales */
TARGET_AMX INLINE void amx_scale(__m512 *acc, const int32_t *c, const float *d16, const float *dx16) {
    const __m512 d = _mm512_loadu_ps(d16);
    for (int r = 0; r < 16; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * r)),
                                 _mm512_mul_ps(d, _mm512_set1_ps(dx16[r])), acc[r]);
}

/* 16 activation rows (rows of them stored) against one unpacked stripe. qt is the tile's
 * activations as nb blocks of 16 x 32 bytes (each tile load reads 8 whole cache lines),
 * dxt and fst its scales and Q4_1 offsets as nb blocks of 16, y its first output; c is
 * 5 x 256 int32, 64-byte aligned. Software-pipelined: the tile unit multiplies block
 * b + 1 (tiles 1/3/5 or 0/2/4, alternating) while block b's sums are stored, and each
 * block's sums are scaled one block later, when their store has reached the cache. The
 * loops over rows have constant bounds, so the accumulators stay in registers. */
TARGET_AMX static void amx_rows(int type, const int8_t *bt, const float *d, const float *mn, int64_t nb,
                                const int8_t *qt, const float *dxt, const float *fst, int64_t rows, __mmask16 keep,
                                __m512 b16, float *y, int64_t N, int32_t *c) {
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    AMX_ZERO(0);
    AMX_LOAD(2, qt, 32);
    AMX_LOAD(4, bt, 64);
    AMX_DPBSSD(0, 2, 4);
    for (int64_t b = 0; b < nb; b += 2) {
        if (b + 1 < nb) {
            AMX_ZERO(1);
            AMX_LOAD(3, qt + 512 * (b + 1), 32);
            AMX_LOAD(5, bt + 512 * (b + 1), 64);
            AMX_DPBSSD(1, 3, 5);
        }
        AMX_STORE(0, c + 256 * (b & 3));
        if (b) amx_scale(acc, c + 256 * ((b - 1) & 3), d + 16 * (b - 1), dxt + 16 * (b - 1));
        if (b + 1 >= nb) break;
        if (b + 2 < nb) {
            AMX_ZERO(0);
            AMX_LOAD(2, qt + 512 * (b + 2), 32);
            AMX_LOAD(4, bt + 512 * (b + 2), 64);
            AMX_DPBSSD(0, 2, 4);
        }
        AMX_STORE(1, c + 256 * ((b + 1) & 3));
        amx_scale(acc, c + 256 * (b & 3), d + 16 * b, dxt + 16 * b);
    }
    amx_scale(acc, c + 256 * ((nb - 1) & 3), d + 16 * (nb - 1), dxt + 16 * (nb - 1));
    __m512 off[16];
    for (int r = 0; r < 16; r++) off[r] = _mm512_setzero_ps();
    if (type == T_Q4_1) { /* the mins' term: blocks outer, so the 16 rows' sums run side by side */
        float *sums = (float *)(c + 1024);
        for (int r = 0; r < 16; r++) _mm512_store_ps(sums + 16 * r, acc[r]);
        for (int64_t b = 0; b < nb; b++) {
            const __m512 m = _mm512_loadu_ps(mn + 16 * b);
            for (int r = 0; r < 16; r++) off[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(fst[16 * b + r]), off[r]);
        }
        for (int r = 0; r < 16; r++) acc[r] = _mm512_load_ps(sums + 16 * r);
    }
    for (int r = 0; r < 16; r++)
        _mm512_mask_storeu_ps(y + r * N, r < rows ? keep : 0, _mm512_add_ps(_mm512_add_ps(acc[r], off[r]), b16));
}

/* ember_quant_act's blocks of Mp rows (a multiple of 16) -> per tile of 16 rows: qt, its
 * nb blocks of 16 rows x 32 bytes one after the other; dxt and fst, its nb blocks of 16
 * scales d and offsets d * sum(q) */
static void amx_tile_layout(const int8_t *q, const float *dx, const int16_t *s, int64_t Mp, int64_t K, int8_t *qt,
                            float *dxt, float *fst) {
    const int64_t nb = K / 32;
    for (int64_t t = 0; t < Mp / 16; t++)
        for (int64_t b = 0; b < nb; b++)
            for (int64_t r = 0; r < 16; r++) {
                const int64_t i = (16 * t + r) * nb + b, o = (t * nb + b) * 16 + r;
                memcpy(qt + 32 * o, q + 32 * i, 32);
                dxt[o] = dx[i];
                fst[o] = dx[i] * (float)((int32_t)s[2 * i] + (int32_t)s[2 * i + 1]);
            }
}

/* qt, dxt and fst: amx_tile_layout's, of round_up(M, 16) rows (the padding zeros) */
TARGET_AMX static int linear_x8_amx(int type, const uint8_t *p, int64_t N, int64_t K, const int8_t *qt,
                                    const float *dxt, const float *fst, int64_t M, const float *bias, float *y,
                                    int nthreads) {
    const int64_t nb = K / 32, gb = 8 * block_bytes(type), groups = N / 8;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        amx_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 6; t++) {
            cfg.rows[t] = t >= 4 ? 8 : 16; /* 0-1 sums, 2-3 activations, 4-5 weights */
            cfg.colsb[t] = t == 2 || t == 3 ? 32 : 64;
        }
        int32_t c[1280] __attribute__((aligned(64))); /* 4 blocks' sums, then 16 x 16 floats */
        int8_t *bt = malloc((size_t)nb * (512 + 2 * 16 * sizeof(float)));
        float *d = (float *)(bt + 512 * nb), *mn = d + 16 * nb;
        if (!bt) {
#pragma omp atomic write
            failed = 1;
        } else {
            _tile_loadconfig(&cfg);
        }
        for (int64_t mb = 0; mb < M; mb += X8_M_BLOCK) {
            const int64_t me = M - mb < X8_M_BLOCK ? M : mb + X8_M_BLOCK;
#pragma omp for schedule(static) nowait
            for (int64_t pair = 0; pair < (groups + 1) / 2; pair++) {
                if (!bt) continue;
                const int64_t g = 2 * pair;
                const int whole = g + 1 < groups;
                const __mmask16 keep = whole ? 0xffff : 0x00ff;
                const uint8_t *lo = p + g * nb * gb;
                amx_unpack(type, lo, whole ? lo + nb * gb : lo, nb, bt, d, mn);
                const __m512 b16 = bias ? _mm512_maskz_loadu_ps(keep, bias + 8 * g) : _mm512_setzero_ps();
                for (int64_t m0 = mb; m0 < me; m0 += 16)
                    amx_rows(type, bt, d, mn, nb, qt + m0 * K, dxt + m0 * nb, fst + m0 * nb,
                             me - m0 < 16 ? me - m0 : 16, keep, b16, y + m0 * N + 8 * g, N, c);
            }
        }
        if (bt) _tile_release();
        free(bt);
    }
    return failed ? -2 : 0;
}

/* ---- AMX-BF16: x8 weights in bfloat16 on the tile unit (the amx ISA's bf16 mode) -------------
 * Where the prefill mode is bf16, products of many rows multiply bfloat16 on tiles rather
 * than 8-bit activations: per call each stripe of 16 output rows is dequantized (gguf's
 * float operations, then rounded to bfloat16, nearest even) straight into TDPBF16PS's B
 * layout (per block of 32 columns, 16 tile rows of 64 bytes: tile row k holds columns 2k
 * and 2k + 1 of each output row n at bytes 4n..4n+3), which stays in the core's cache
 * while every pair of 16-row activation tiles (bfloat16, nearest even) streams past it.
 * The sums accumulate in float32 inside the tiles over all of K -- no per-block scaling
 * leaves the tile unit, which is what bounds the int8 kernel above -- and are stored once
 * per tile. The same numbers class as the bf16 mode's dequantized tiles through oneDNN
 * (bfloat16 weights and activations, float32 sums), without a float copy of the weight
 * or oneDNN's re-layout per call. */
#define TARGET_AMXB \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,amx-tile,amx-bf16")))
#define AMX_LOAD1K(t, base) \
    __asm__ volatile("tileloadd (%1,%2,1), %%tmm" #t ::"m"(*(const int8_t(*)[1024])(base)), "r"(base), "r"(64L))
#define AMX_DPBF16PS(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

/* 16 lanes' 4 values (byte k of lane n: column 4j + k of output row n) -> the two B tile
 * rows of chunk j: (w0, w1) and (w2, w3) interleaved per lane, as bfloat16 */
TARGET_AMXB INLINE void amxb_chunk(int type, __m512i u, __m512 d, __m512 m, int8_t *row) {
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 w[4];
    for (int k = 0; k < 4; k++) {
        __m512i v = type == T_Q8_0 ? _mm512_srai_epi32(_mm512_slli_epi32(u, 24 - 8 * k), 24)
                                   : _mm512_and_si512(_mm512_srli_epi32(u, 8 * k), _mm512_set1_epi32(0xff));
        if (type == T_Q4_0) v = _mm512_sub_epi32(v, _mm512_set1_epi32(8));
        w[k] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(v)); /* gguf: d * u (+ m), no FMA */
        if (type == T_Q4_1) w[k] = _mm512_add_ps(w[k], m);
    }
    for (int h = 0; h < 2; h++) {
        __m512i bf = (__m512i)_mm512_cvtne2ps_pbh(w[2 * h + 1], w[2 * h]); /* w[2h] in 0-15, w[2h+1] in 16-31 */
        _mm512_storeu_si512(row + 64 * h, _mm512_permutexvar_epi16(pairs, bf));
    }
}

/* the stripe of groups lo and hi as bfloat16 B tiles: block b's 16 rows of 64 bytes at bt + 1024 b */
TARGET_AMXB static void amxb_unpack(int type, const uint8_t *lo, const uint8_t *hi, int64_t nb, int8_t *bt) {
    const int64_t gb = 8 * block_bytes(type), head = x8_head_bytes(type);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *ol = lo + b * gb, *oh = hi + b * gb;
        const __m512 d = scales_pair(ol, oh), m = type == T_Q4_1 ? scales_pair(ol + 16, oh + 16) : d;
        int8_t *o = bt + 1024 * b;
        if (type == T_Q8_0) {
            for (int j = 0; j < 8; j++) amxb_chunk(type, load_pair(ol + head + 32 * j, oh + head + 32 * j), d, m, o + 128 * j);
            continue;
        }
        for (int i = 0; i < 4; i++) {
            const __m512i v = load_pair(ol + head + 32 * i, oh + head + 32 * i);
            amxb_chunk(type, _mm512_and_si512(v, m4), d, m, o + 128 * i);
            amxb_chunk(type, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), d, m, o + 128 * (i + 4));
        }
    }
}

/* float32 x (M, K) -> bfloat16 (nearest even) in tiles: per tile of 16 rows, its nb blocks
 * of 16 rows x 32 values one after the other; rows M..Mp-1 zeros */
TARGET_AMXB static void amxb_act(const float *x, int64_t M, int64_t Mp, int64_t K, int8_t *xt, int nthreads) {
    const int64_t nb = K / 32;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (Mp * K > 65536)
    for (int64_t m = 0; m < Mp; m++)
        for (int64_t b = 0; b < nb; b++) {
            int8_t *o = xt + (((m / 16) * nb + b) * 16 + m % 16) * 64;
            if (m >= M) { memset(o, 0, 64); continue; }
            const float *p = x + m * K + 32 * b;
            _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p)));
        }
}

/* one 16 x 16 tile of sums (c) into y's rows m0.. (rows of them, below M), 16 columns at
 * col (keep: the 8 of a lone last group), plus the bias */
TARGET_AMXB INLINE void amxb_store(const float *c, int64_t m0, int64_t M, int64_t N, int64_t col, __mmask16 keep,
                                   __m512 b16, float *y) {
    for (int64_t r = 0; r < 16 && m0 + r < M; r++)
        _mm512_mask_storeu_ps(y + (m0 + r) * N + col, keep, _mm512_add_ps(_mm512_load_ps(c + 16 * r), b16));
}

/* Work is split by pairs of stripes (32 output rows): both are unpacked, then every pair
 * of activation tiles multiplies them into 4 tiles of sums (0: tile 0 x stripe 0, 1:
 * tile 1 x stripe 0, 2 and 3 likewise for stripe 1), 4 products per 4 tile loads where
 * one stripe gave 2 per 3, the chains of dependent products interleaved four deep (the
 * tile loop alone, Intel Xeon: 7 against 11 ns a product; this kernel, 1536 x 576 Q4_1:
 * 128 rows 0.29 -> 0.16 ms, 4096 rows 10.5 -> 5.5 ms). A lone last stripe multiplies
 * twice and stores once. */
TARGET_AMXB static int linear_x8_amx_bf16(int type, const uint8_t *p, int64_t N, int64_t K, const int8_t *xt,
                                         int64_t M, int64_t Mp, const float *bias, float *y, int nthreads) {
    const int64_t nb = K / 32, gb = 8 * block_bytes(type), groups = N / 8, stripes = (groups + 1) / 2;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        amx_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64; /* 0-3 sums, 4-5 activations, 6-7 weights */
        float c[1024] __attribute__((aligned(64)));
        int8_t *bt = malloc((size_t)nb * 2048);
        if (!bt) {
#pragma omp atomic write
            failed = 1;
        } else {
            _tile_loadconfig(&cfg);
        }
        for (int64_t mb = 0; mb < Mp; mb += X8_M_BLOCK) { /* the block's activations stay in cache */
            const int64_t me = Mp - mb < X8_M_BLOCK ? Mp : mb + X8_M_BLOCK;
#pragma omp for schedule(static) nowait
            for (int64_t quad = 0; quad < (stripes + 1) / 2; quad++) {
                if (!bt) continue;
                const int has1 = 2 * quad + 1 < stripes;
                __mmask16 keep[2];
                __m512 b16[2];
                for (int h = 0; h < 1 + has1; h++) {
                    const int64_t g = 4 * quad + 2 * h;
                    const int whole = g + 1 < groups;
                    const uint8_t *lo = p + g * nb * gb;
                    keep[h] = whole ? 0xffff : 0x00ff;
                    amxb_unpack(type, lo, whole ? lo + nb * gb : lo, nb, bt + h * nb * 1024);
                    b16[h] = bias ? _mm512_maskz_loadu_ps(keep[h], bias + 8 * g) : _mm512_setzero_ps();
                }
                const int8_t *bt1 = bt + (has1 ? nb * 1024 : 0);
                for (int64_t m0 = mb; m0 < me; m0 += 32) {
                    const int8_t *a0 = xt + m0 * K * 2, *a1 = a0 + 16 * K * 2;
                    const int two = m0 + 16 < me;
                    AMX_ZERO(0);
                    AMX_ZERO(1);
                    AMX_ZERO(2);
                    AMX_ZERO(3);
                    for (int64_t b = 0; b < nb; b++) {
                        AMX_LOAD1K(6, bt + 1024 * b);
                        AMX_LOAD1K(7, bt1 + 1024 * b);
                        AMX_LOAD1K(4, a0 + 1024 * b);
                        AMX_DPBF16PS(0, 4, 6);
                        AMX_DPBF16PS(2, 4, 7);
                        if (two) {
                            AMX_LOAD1K(5, a1 + 1024 * b);
                            AMX_DPBF16PS(1, 5, 6);
                            AMX_DPBF16PS(3, 5, 7);
                        }
                    }
                    AMX_STORE(0, c);
                    AMX_STORE(2, c + 512);
                    if (two) {
                        AMX_STORE(1, c + 256);
                        AMX_STORE(3, c + 768);
                    }
                    for (int t = 0; t < 1 + two; t++)
                        for (int h = 0; h < 1 + has1; h++)
                            amxb_store(c + 256 * t + 512 * h, m0 + 16 * t, M, N, 32 * quad + 16 * h, keep[h], b16[h], y);
                }
            }
        }
        if (bt) _tile_release();
        free(bt);
    }
    return failed ? -2 : 0;
}

/* y = x @ W.T (+ b) for x8 weights in bfloat16 on AMX tiles (see above), float32 y (M, N);
 * -1 for another type or shape, -3 before ember_quant_amx_init has been granted */
int ember_quant_linear_x8_bf16(int type, const uint8_t *p, int64_t N, int64_t K, const float *x, int64_t M,
                               const float *bias, float *y, int nthreads) {
    if (!x8_type(type) || K % 32 || N % 8) return -1;
    if (!amx_granted) return -3;
    const int64_t Mp = (M + 15) / 16 * 16;
    int8_t *xt = scratch(1, (size_t)(Mp * K) * 2);
    if (!xt) return -2;
    amxb_act(x, M, Mp, K, xt, nthreads);
    int rc = linear_x8_amx_bf16(type, p, N, K, xt, M, Mp, bias, y, nthreads);
    return rc;
}

/* y = x @ W.T (+ b) for x8 weights; split: two-stage activations (ember_quant_act_split),
 * both stages of a row through the kernel side by side (one read of each weight block
 * serves both), their outputs added in scratch slot 2 */
static int linear_x8(int isa, int type, const uint8_t *p, int64_t N, int64_t K, const float *x, int64_t M,
                     const float *bias, float *y, int nthreads, int split) {
    if (!x8_type(type) || K % 32 || N % 8 || (isa != ISA_AVX2 && isa != ISA_AVX512VNNI && isa != ISA_AMX)) return -1;
    if (isa == ISA_AMX && !amx_granted) return -3;
    const int64_t rows = split ? 2 * M : M;
    const int amx = isa == ISA_AMX && rows >= AMX_MIN_ROWS;
    const int64_t Mp = amx ? (rows + 15) / 16 * 16 : rows, nb = K / 32;
    float *out = y;
    if (split && !(out = scratch(2, (size_t)(rows * N) * sizeof(float)))) return -2;
    int8_t *q;
    float *dx;
    int16_t *s;
    void *acts = act_blocks(x, M, Mp, K, nthreads, &q, &dx, &s, split);
    if (!acts) return -2;
    const float *b = split ? 0 : bias;
    int rc = 0;
    if (amx) {
        float *dxt = scratch(1, (size_t)(Mp * nb) * 2 * sizeof(float) + (size_t)(Mp * K));
        if (!dxt) rc = -2;
        else {
            float *fst = dxt + Mp * nb;
            int8_t *qt = (int8_t *)(fst + Mp * nb);
            amx_tile_layout(q, dx, s, Mp, K, qt, dxt, fst);
            rc = linear_x8_amx(type, p, N, K, qt, dxt, fst, rows, b, out, nthreads);
        }
    } else if (isa == ISA_AVX2) linear_x8_avx2(type, p, N, K, q, dx, s, rows, b, out, nthreads);
    else if (rows < X8Z_MIN_ROWS) linear_x8_avx512vnni(type, p, N, K, q, dx, s, rows, b, out, nthreads);
    else linear_x8_zmm(type, p, N, K, q, dx, s, rows, b, out, nthreads);
    if (split && !rc) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * N > 65536)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++)
                y[m * N + n] = out[2 * m * N + n] + out[(2 * m + 1) * N + n] + (bias ? bias[n] : 0.0f);
    }
    return rc;
}

int ember_quant_linear_x8(int isa, int type, const uint8_t *p, int64_t N, int64_t K, const float *x, int64_t M,
                          const float *bias, float *y, int nthreads) {
    return linear_x8(isa, type, p, N, K, x, M, bias, y, nthreads, 0);
}

/* ember_quant_linear_x8 with two-stage activations (ember_quant_act_split): about 15 bits
 * per block where one stage keeps 8, for twice the integer products on one read of W */
int ember_quant_linear_x8_split(int isa, int type, const uint8_t *p, int64_t N, int64_t K, const float *x,
                                int64_t M, const float *bias, float *y, int nthreads) {
    return linear_x8(isa, type, p, N, K, x, M, bias, y, nthreads, 1);
}

/* ember_quant_act (split: ember_quant_act_split, the two stages' outputs added in scratch
 * slot 2) then ember_quant_linear in one call (the activation's blocks in scratch slot 0):
 * float32 x (M, K) -> y (M, N) */
static int linear_f32(int isa, int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M,
                      const float *bias, float *y, int nthreads, int split) {
    if (K % 32 || !ember_quant_has_kernel(isa, type)) return -1;
    const int64_t rows = split ? 2 * M : M;
    float *out = y;
    if (split && !(out = scratch(2, (size_t)(rows * N) * sizeof(float)))) return -2;
    int8_t *q;
    float *dx;
    int16_t *s;
    void *acts = act_blocks(x, M, rows, K, nthreads, &q, &dx, &s, split);
    if (!acts) return -2;
    int rc = ember_quant_linear(isa, type, w, N, K, q, dx, s, rows, split ? 0 : bias, out, nthreads);
    if (split && !rc) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * N > 65536)
        for (int64_t m = 0; m < M; m++)
            for (int64_t n = 0; n < N; n++)
                y[m * N + n] = out[2 * m * N + n] + out[(2 * m + 1) * N + n] + (bias ? bias[n] : 0.0f);
    }
    return rc;
}

int ember_quant_linear_f32(int isa, int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M,
                           const float *bias, float *y, int nthreads) {
    return linear_f32(isa, type, w, N, K, x, M, bias, y, nthreads, 0);
}

int ember_quant_linear_f32_split(int isa, int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M,
                                 const float *bias, float *y, int nthreads) {
    return linear_f32(isa, type, w, N, K, x, M, bias, y, nthreads, 1);
}

/* The products a CPU graph records (ember.hardware.cpu_graphs; ember_cpu.c's ember_replay
 * runs them): each takes its arguments as one array, pointers as addresses. */
#define PTR(i) ((void *)(intptr_t)a[i])
int ember_quant_linear_x8__packed(const int64_t *a) {
    return ember_quant_linear_x8((int)a[0], (int)a[1], PTR(2), a[3], a[4], PTR(5), a[6], PTR(7), PTR(8), (int)a[9]);
}
int ember_quant_linear_x8_split__packed(const int64_t *a) {
    return ember_quant_linear_x8_split((int)a[0], (int)a[1], PTR(2), a[3], a[4], PTR(5), a[6], PTR(7), PTR(8),
                                       (int)a[9]);
}
int ember_quant_linear_f32__packed(const int64_t *a) {
    return ember_quant_linear_f32((int)a[0], (int)a[1], PTR(2), a[3], a[4], PTR(5), a[6], PTR(7), PTR(8), (int)a[9]);
}
int ember_quant_linear_f32_split__packed(const int64_t *a) {
    return ember_quant_linear_f32_split((int)a[0], (int)a[1], PTR(2), a[3], a[4], PTR(5), a[6], PTR(7), PTR(8),
                                        (int)a[9]);
}
int ember_quant_rows__packed(const int64_t *a) {
    return ember_quant_rows((int)a[0], PTR(1), a[2], a[3], (int)a[4], PTR(5), a[6], PTR(7), (int)a[8]);
}
int ember_quant_linear_x8_bf16__packed(const int64_t *a) {
    return ember_quant_linear_x8_bf16((int)a[0], PTR(1), a[2], a[3], PTR(4), a[5], PTR(6), PTR(7), (int)a[8]);
}
#undef PTR

#else /* EMBER_QUANT_BODY: one instruction set's kernels; SFX, TARGET and DOT32 say which */

TARGET INLINE float SFX(h2f)(const uint8_t *p) { /* F16C: one instruction where f16() takes a dozen */
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

TARGET INLINE __m256i SFX(nibbles16)(const uint8_t *p) { /* 16 bytes -> 32 values: low nibbles, then high */
    __m128i t = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0f));
}

TARGET INLINE __m256i SFX(bits32)(const uint8_t *p) { /* bit j of a little-endian uint32 -> 0x10 in byte j */
    uint32_t h;
    memcpy(&h, p, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

TARGET INLINE __m256 SFX(q8_block)(const uint8_t *w, const int8_t *q, float dx, __m256 acc) {
    __m256i wq = _mm256_loadu_si256((const __m256i *)(w + 2));
    __m256i xq = _mm256_loadu_si256((const __m256i *)q);
    __m256i p = DOT32(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
    return _mm256_fmadd_ps(_mm256_set1_ps(SFX(h2f)(w) * dx), _mm256_cvtepi32_ps(p), acc);
}

/* two blocks per iteration into two accumulators: the FMA latency is not the bound */
TARGET static float SFX(dot_q8_0)(const uint8_t *w, const int8_t *q, const float *dx, const int16_t *s,
                                  const float *fs, int64_t K) {
    (void)s;
    (void)fs;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t nb = K / 32, b = 0;
    for (; b + 1 < nb; b += 2, w += 68) {
        acc0 = SFX(q8_block)(w, q + 32 * b, dx[b], acc0);
        acc1 = SFX(q8_block)(w + 34, q + 32 * b + 32, dx[b + 1], acc1);
    }
    if (b < nb) acc0 = SFX(q8_block)(w, q + 32 * b, dx[b], acc0);
    return hsum8(_mm256_add_ps(acc0, acc1));
}

/* Q4_0, Q4_1, Q5_0, Q5_1: 32-blocks, w = d u + c */
TARGET INLINE __m256 SFX(block_32)(int type, const uint8_t *w, const int8_t *q, float dx, float fs, __m256 acc,
                                   float *offset) {
    const int has_min = type == T_Q4_1 || type == T_Q5_1, five = type == T_Q5_0 || type == T_Q5_1;
    __m256i u = SFX(nibbles16)(w + 2 + 2 * has_min + 4 * five);
    if (five) u = _mm256_or_si256(u, SFX(bits32)(w + 2 + 2 * has_min));
    __m256i xq = _mm256_loadu_si256((const __m256i *)q);
    float d = SFX(h2f)(w), c = has_min ? SFX(h2f)(w + 2) : (five ? -16.0f : -8.0f) * d;
    *offset += c * fs;
    return _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(DOT32(u, xq)), acc);
}

TARGET INLINE float SFX(dot_32)(int type, const uint8_t *w, const int8_t *q, const float *dx, const float *fs,
                                int64_t K) {
    const int64_t bb = block_bytes(type), nb = K / 32;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float off0 = 0.0f, off1 = 0.0f;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2, w += 2 * bb) {
        acc0 = SFX(block_32)(type, w, q + 32 * b, dx[b], fs[b], acc0, &off0);
        acc1 = SFX(block_32)(type, w + bb, q + 32 * b + 32, dx[b + 1], fs[b + 1], acc1, &off1);
    }
    if (b < nb) acc0 = SFX(block_32)(type, w, q + 32 * b, dx[b], fs[b], acc0, &off0);
    return hsum8(_mm256_add_ps(acc0, acc1)) + off0 + off1;
}

TARGET static float SFX(dot_q4_0)(const uint8_t *w, const int8_t *q, const float *dx, const int16_t *s,
                                  const float *fs, int64_t K) {
    (void)s;
    return SFX(dot_32)(T_Q4_0, w, q, dx, fs, K);
}
TARGET static float SFX(dot_q4_1)(const uint8_t *w, const int8_t *q, const float *dx, const int16_t *s,
                                  const float *fs, int64_t K) {
    (void)s;
    return SFX(dot_32)(T_Q4_1, w, q, dx, fs, K);
}
TARGET static float SFX(dot_q5_0)(const uint8_t *w, const int8_t *q, const float *dx, const int16_t *s,
                                  const float *fs, int64_t K) {
    (void)s;
    return SFX(dot_32)(T_Q5_0, w, q, dx, fs, K);
}
TARGET static float SFX(dot_q5_1)(const uint8_t *w, const int8_t *q, const float *dx, const int16_t *s,
                                  const float *fs, int64_t K) {
    (void)s;
    return SFX(dot_32)(T_Q5_1, w, q, dx, fs, K);
}

/* The 32-block types against several activation rows: each weight block is unpacked
 * once and multiplied with every row's block (a speculative verification's k + 1 rows, a
 * small batch), where dot_32 / dot_q8_0 unpack it once per row. Sums run in dot_32's
 * order (even blocks, odd blocks, then the two), so every row's result is bit for bit
 * the one-row kernel's: a request's numbers do not depend on what shares its step. */
TARGET INLINE void SFX(rows_32)(int type, const uint8_t *w, const int8_t *q, const float *dx, const float *fs,
                                int64_t K, int64_t R, float *out) {
    const int q8 = type == T_Q8_0, has_min = type == T_Q4_1 || type == T_Q5_1;
    const int five = type == T_Q5_0 || type == T_Q5_1;
    const int64_t bb = block_bytes(type), nb = K / 32;
    __m256 acc[2][ROWS];
    float off[2][ROWS];
    for (int64_t r = 0; r < R; r++) {
        acc[0][r] = acc[1][r] = _mm256_setzero_ps();
        off[0][r] = off[1][r] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++, w += bb) {
        const int k = (int)(b & 1); /* dot_32's accumulator of block b: odd ones, even ones (the tail too) */
        __m256i u, wq = _mm256_setzero_si256();
        float d = SFX(h2f)(w), c = 0.0f;
        if (q8) {
            wq = _mm256_loadu_si256((const __m256i *)(w + 2));
            u = _mm256_sign_epi8(wq, wq);
        } else {
            u = SFX(nibbles16)(w + 2 + 2 * has_min + 4 * five);
            if (five) u = _mm256_or_si256(u, SFX(bits32)(w + 2 + 2 * has_min));
            c = has_min ? SFX(h2f)(w + 2) : (five ? -16.0f : -8.0f) * d;
        }
        for (int64_t r = 0; r < R; r++) {
            __m256i xq = _mm256_loadu_si256((const __m256i *)(q + r * K + 32 * b));
            if (q8) xq = _mm256_sign_epi8(xq, wq);
            acc[k][r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[r * nb + b]), _mm256_cvtepi32_ps(DOT32(u, xq)), acc[k][r]);
            if (!q8) off[k][r] += c * fs[r * nb + b];
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float v = hsum8(_mm256_add_ps(acc[0][r], acc[1][r]));
        out[r] = q8 ? v : v + off[0][r] + off[1][r];
    }
}

#define ROWS_WRAPPER(name, T) \
    TARGET static void SFX(name)(const uint8_t *w, const int8_t *q, const float *dx, const float *fs, int64_t K, \
                                 int64_t R, float *out) { SFX(rows_32)(T, w, q, dx, fs, K, R, out); }
ROWS_WRAPPER(rows_q4_0, T_Q4_0)
ROWS_WRAPPER(rows_q4_1, T_Q4_1)
ROWS_WRAPPER(rows_q5_0, T_Q5_0)
ROWS_WRAPPER(rows_q5_1, T_Q5_1)
ROWS_WRAPPER(rows_q8_0, T_Q8_0)
#undef ROWS_WRAPPER

static rows_fn SFX(rows_for_type)(int type) {
    switch (type) {
    case T_Q8_0: return SFX(rows_q8_0);
    case T_Q4_0: return SFX(rows_q4_0);
    case T_Q4_1: return SFX(rows_q4_1);
    case T_Q5_0: return SFX(rows_q5_0);
    case T_Q5_1: return SFX(rows_q5_1);
    default: return 0;
    }
}

/* Q4_K, Q5_K: 256-blocks of 8 sub-blocks of 32, w = d sc_j u - dmin mn_j */
TARGET INLINE float SFX(dot_k45)(int five, const uint8_t *w, const int8_t *q, const float *dx, const float *fs,
                                 int64_t K) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps();
    float offset = 0.0f;
    const int64_t bb = five ? 176 : 144;
    for (int64_t b = 0; b < K / 256; b++, w += bb) {
        float d = SFX(h2f)(w), dmin = SFX(h2f)(w + 2);
        uint8_t sc[8], mn[8];
        k_scale_min(w + 4, sc, mn);
        const uint8_t *qs = w + (five ? 48 : 16);
        __m256i hv = five ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m256i u0 = _mm256_and_si256(v, m4), u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (five) {
                __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * c), one);
                __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * c + 1), one);
                u0 = _mm256_or_si256(u0, _mm256_slli_epi16(h0, 4));
                u1 = _mm256_or_si256(u1, _mm256_slli_epi16(h1, 4));
            }
            int64_t a0 = 8 * b + 2 * c, a1 = a0 + 1;
            __m256i p0 = DOT32(u0, _mm256_loadu_si256((const __m256i *)(q + 32 * a0)));
            __m256i p1 = DOT32(u1, _mm256_loadu_si256((const __m256i *)(q + 32 * a1)));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[2 * c] * dx[a0]), _mm256_cvtepi32_ps(p0), acc);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc[2 * c + 1] * dx[a1]), _mm256_cvtepi32_ps(p1), acc);
            offset -= dmin * ((float)mn[2 * c] * fs[a0] + (float)mn[2 * c + 1] * fs[a1]);
        }
    }
    return hsum8(acc) + offset;
}

TARGET static float SFX(dot_q4_k)(const uint8_t *w, const int8_t *q, const float *dx, const int16_t *s,
                                  const float *fs, int64_t K) {
    (void)s;
    return SFX(dot_k45)(0, w, q, dx, fs, K);
}
TARGET static float SFX(dot_q5_k)(const uint8_t *w, const int8_t *q, const float *dx, const int16_t *s,
                                  const float *fs, int64_t K) {
    (void)s;
    return SFX(dot_k45)(1, w, q, dx, fs, K);
}

/* Q6_K: 256-blocks of 16 sub-blocks of 16, w = d sc_k (u - 32), u six bits */
TARGET static float SFX(dot_q6_k)(const uint8_t *w, const int8_t *q, const float *dx, const int16_t *s,
                                  const float *fs, int64_t K) {
    (void)fs;
    const __m256i m4 = _mm256_set1_epi8(0x0f), m3 = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps();
    float offset = 0.0f;
    for (int64_t b = 0; b < K / 256; b++, w += 210) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        float d = SFX(h2f)(w + 208);
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            __m256i hv = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            for (int g = 0; g < 4; g++) {
                __m256i lo = g & 1 ? l1 : l0;
                lo = g < 2 ? _mm256_and_si256(lo, m4) : _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * g), m3);
                __m256i u = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
                int64_t ab = 8 * b + 4 * h + g;
                __m256i p = DOT32(u, _mm256_loadu_si256((const __m256i *)(q + 32 * ab)));
                /* int32 lanes 0-3 hold the first 16 values, lanes 4-7 the next 16 */
                float a0 = d * (float)sc[8 * h + 2 * g] * dx[ab], a1 = d * (float)sc[8 * h + 2 * g + 1] * dx[ab];
                __m256 scale = _mm256_set_m128(_mm_set1_ps(a1), _mm_set1_ps(a0));
                acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(p), acc);
                offset -= 32.0f * (a0 * (float)s[2 * ab] + a1 * (float)s[2 * ab + 1]);
            }
        }
    }
    return hsum8(acc) + offset;
}

/* the x8 layout (see ember_quant_repack_x8) times M activation rows, ROWS at a time: y
 * (M, N) (+ bias), 8 output rows per 256-bit product. Every row's numbers are its own
 * whatever M is. Q4_0's -8 and Q8_0's +128 (VNNI: unsigned x signed) come off the integer
 * sums exactly, via the activation's block sums; Q4_1's mins add m dx sum(q) in float.
 * The avx512vnni ISA also has linear_x8_zmm (16 output rows per 512-bit product), which
 * it takes for larger M. */
/* R (1..ROWS) activation rows against one group; called with constant type and R
 * (x8_tiles), so the loops over rows unroll and the accumulators stay in registers. q,
 * dx and s start at the tile's first row, y at its first output. */
TARGET INLINE void SFX(x8_tile)(const int type, const int R, const uint8_t *o, int64_t nb, int64_t K,
                                const int8_t *q, const float *dx, const int16_t *s, __m256 b8, float *y, int64_t N) {
    const int64_t gb = 8 * block_bytes(type), head = x8_head_bytes(type);
    const int q8 = type == T_Q8_0, has_min = type == T_Q4_1;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc[ROWS], off[ROWS];
    for (int r = 0; r < R; r++) acc[r] = off[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, o += gb) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o));
        const __m256 mn = has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 16))) : _mm256_setzero_ps();
        __m256i u[8];
        if (q8) { /* VNNI multiplies unsigned bytes: w + 128, once per block */
            for (int j = 0; j < 8; j++) {
                u[j] = _mm256_loadu_si256((const __m256i *)(o + head + 32 * j));
                if (HAS_VNNI) u[j] = _mm256_xor_si256(u[j], _mm256_set1_epi8((char)0x80));
            }
        } else {
            for (int i = 0; i < 4; i++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(o + head + 32 * i));
                u[i] = _mm256_and_si256(v, m4);
                u[i + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t ib = r * nb + b;
            const uint8_t *xr = (const uint8_t *)(q + r * K + 32 * b);
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
            for (int j = 0; j < 8; j += 2) {
                int32_t c0, c1;
                memcpy(&c0, xr + 4 * j, 4);
                memcpy(&c1, xr + 4 * j + 4, 4);
                __m256i x0 = _mm256_set1_epi32(c0), x1 = _mm256_set1_epi32(c1), u0 = u[j], u1 = u[j + 1];
                if (q8 && !HAS_VNNI) { /* |w| and the sign on the activation: pairs fit int16 */
                    x0 = _mm256_sign_epi8(x0, u0);
                    x1 = _mm256_sign_epi8(x1, u1);
                    u0 = _mm256_sign_epi8(u0, u0);
                    u1 = _mm256_sign_epi8(u1, u1);
                }
                s0 = DOTACC(s0, u0, x0);
                s1 = DOTACC(s1, u1, x1);
            }
            __m256i sum = _mm256_add_epi32(s0, s1);
            const int32_t qsum = (int32_t)s[2 * ib] + (int32_t)s[2 * ib + 1];
            if (type == T_Q4_0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * qsum));
            else if (q8 && HAS_VNNI) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(128 * qsum));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(dx[ib])), acc[r]);
            if (has_min) off[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(dx[ib] * (float)qsum), off[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * N, _mm256_add_ps(_mm256_add_ps(acc[r], off[r]), b8));
}

#define X8_CASE(T, R) \
    case (T) * 8 + (R): SFX(x8_tile)(T, R, o, nb, K, q, dx, s, b8, y, N); break;
#define X8_CASES(T) X8_CASE(T, 1) X8_CASE(T, 2) X8_CASE(T, 3) X8_CASE(T, 4)
TARGET static void SFX(x8_tiles)(int type, int R, const uint8_t *o, int64_t nb, int64_t K, const int8_t *q,
                                 const float *dx, const int16_t *s, __m256 b8, float *y, int64_t N) {
    switch (type * 8 + R) {
        X8_CASES(T_Q4_0)
        X8_CASES(T_Q4_1)
        X8_CASES(T_Q8_0)
    }
}
#undef X8_CASES
#undef X8_CASE

TARGET static void SFX(linear_x8)(int type, const uint8_t *p, int64_t N, int64_t K, const int8_t *q,
                                  const float *dx, const int16_t *s, int64_t M, const float *bias, float *y,
                                  int nthreads) {
    const int64_t nb = K / 32, gb = 8 * block_bytes(type);
#pragma omp parallel num_threads(nthreads)
    for (int64_t mb = 0; mb < M; mb += X8_M_BLOCK) {
        const int64_t me = M - mb < X8_M_BLOCK ? M : mb + X8_M_BLOCK;
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < N / 8; g++) {
            const __m256 b8 = bias ? _mm256_loadu_ps(bias + 8 * g) : _mm256_setzero_ps();
            for (int64_t m0 = mb; m0 < me; m0 += ROWS)
                SFX(x8_tiles)(type, (int)(me - m0 < ROWS ? me - m0 : ROWS), p + g * nb * gb, nb, K, q + m0 * K,
                              dx + m0 * nb, s + 2 * m0 * nb, b8, y + m0 * N + 8 * g, N);
        }
    }
}


static dot_fn SFX(dot_for_type)(int type) {
    switch (type) {
    case T_Q8_0: return SFX(dot_q8_0);
    case T_Q4_0: return SFX(dot_q4_0);
    case T_Q4_1: return SFX(dot_q4_1);
    case T_Q5_0: return SFX(dot_q5_0);
    case T_Q5_1: return SFX(dot_q5_1);
    case T_Q4_K: return SFX(dot_q4_k);
    case T_Q5_K: return SFX(dot_q5_k);
    case T_Q6_K: return SFX(dot_q6_k);
    default: return 0;
    }
}

#endif /* EMBER_QUANT_BODY */
