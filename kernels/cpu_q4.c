/* Few-row quantised products with int8 activations and integer dot products (chatkv.kernels.cpu_decode
 * builds this beside cpu_matmul.c; chatkv.weights.quantised takes it for steps of up to 16 rows where
 * the switch ``q4_vnni`` is on). As llama.cpp's vec_dot_q4_K_q8_K / vec_dot_q6_K_q8_K: each row's
 * bfloat16 activations are quantised to int8 per group of 32 inputs with one float32 scale
 * (q8_0's formula: d = max|x| / 127, q = round-to-nearest-even(x / d)), and the weights' codes are
 * multiplied with them as integers (AVX512-VNNI vpdpbusd: 64 byte products a instruction), so a
 * 4-bit weight is never widened to bfloat16 and a decode step is bound by reading the weights.
 *
 * The weights are read in the forms chatkv already keeps, no second copy:
 * - q4_mm: torch's CPU int4 packing in blocks of 64 output rows and its bfloat16 (s, z) per group
 *   of 32 inputs (cpu_matmul.c's int4_mm layout; w = (code - 8) s + z). Per (row r, group g,
 *   column j): D = sum (code - 8) q, an exact integer, S = sum q, and
 *     y[r, j] = bf16(sum_g fma(d_g, fma(s, float(D), z * float(S)), .))
 *   in the order of g, one float32 accumulator per (row, column).
 * - q8_mm: int8 codes [n, k] with one bfloat16 scale per output channel (Int8Linear). vpdpbusd
 *   takes one unsigned operand: the activations go in as q + 128 and 128 * (the codes' own sum,
 *   one more vpdpbusd with ones, shared by the rows) is taken off, so D is sum code * q exactly.
 *   Per 64 inputs one float32 lane per 4 inputs takes fma(float(D_lane), d of its group, .); the
 *   16 lanes are added in a fixed tree (lane i + i + 8, then + 4, + 2, + 1) and times the scale.
 *
 * Every row is computed alone in an order that does not depend on the step's other rows, and the
 * threads split the output columns only, so a row's bits are the same in any step and on any
 * thread count (speculation's verified rows are their plain decode's). The portable path (plain C,
 * built everywhere: ``portable`` = 1) computes the same integers and the same float32 operations in
 * the same order (fmaf for every fused multiply-add), so it gives the same bits as the VNNI path.
 * A group with a non-finite activation gives NaN for that row. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#define Q4_MM_ROWS 16 /* cpu_decode.INT4_MM_ROWS */

/* ------------------------------------------------------------------ activations */

/* One row's int8 activations per group of 32: q (int8 [k]), d (float [k / 32]), s (int32 [k / 32], sum of q) */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *s;
    uint8_t *u; /* q + 128 as unsigned (q8_mm only) */
    float *dl;  /* d of each 4-input lane (q8_mm only): k / 4 */
} q8_rows;

/* the group's scale from its largest magnitude; 0 (all codes 0) where it is too small to invert */
static inline float q8_scale(float amax, float *inv) {
    if (!(amax >= 1e-30f)) { *inv = 0.f; return 0.f; }
    const float d = amax / 127.f;
    *inv = 1.f / d;
    return d;
}

static void q8_group_portable(const uint16_t *x, int8_t *q, float *d, int32_t *s) {
    float amax = 0.f;
    int bad = 0;
    for (int i = 0; i < 32; i++) {
        const float v = bf2f(x[i]);
        if (!isfinite(v)) bad = 1;
        const float a = fabsf(v);
        amax = a > amax ? a : amax;
    }
    if (bad) { memset(q, 0, 32); *d = NAN; *s = 0; return; }
    float inv;
    *d = q8_scale(amax, &inv);
    int32_t sum = 0;
    for (int i = 0; i < 32; i++) {
        const int32_t v = (int32_t)rintf(bf2f(x[i]) * inv);
        q[i] = (int8_t)v;
        sum += v;
    }
    *s = sum;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
static inline void q8_group_avx512(const uint16_t *x, int8_t *q, float *d, int32_t *s) {
    const __m512 lo = bf16x16(x), hi = bf16x16(x + 16);
    /* x - x is 0 for finite x, NaN otherwise */
    const __mmask16 bad = _mm512_cmp_ps_mask(_mm512_sub_ps(lo, lo), _mm512_setzero_ps(), _CMP_NEQ_UQ) |
                          _mm512_cmp_ps_mask(_mm512_sub_ps(hi, hi), _mm512_setzero_ps(), _CMP_NEQ_UQ);
    if (bad) { memset(q, 0, 32); *d = NAN; *s = 0; return; }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    float inv;
    *d = q8_scale(amax, &inv);
    const __m512 iv = _mm512_set1_ps(inv);
    const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, iv)), qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, iv));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(ql));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qh));
    *s = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
}
#define Q8_GROUP(x, q, d, s) (portable ? q8_group_portable(x, q, d, s) : q8_group_avx512(x, q, d, s))
#else
#define Q8_GROUP(x, q, d, s) q8_group_portable(x, q, d, s)
#endif

/* The calling thread's buffer for a step's quantised activations, grown as needed and kept. */
static __thread void *q8_buf = NULL;
static __thread size_t q8_cap = 0;

static int q8_quantise(const uint16_t *x, int64_t rows, int64_t k, int lanes, int portable, q8_rows *out) {
    (void)portable;
    const int64_t groups = k / 32, kl = (k + 63) / 64 * 64; /* q8_mm reads whole 64-input chunks */
    const size_t need = (size_t)rows * ((size_t)kl * 2 + (size_t)groups * 8 + (size_t)kl) + 256;
    if (need > q8_cap) {
        free(q8_buf);
        q8_buf = aligned_alloc(64, (need + 63) / 64 * 64);
        q8_cap = q8_buf ? need : 0;
        if (!q8_buf) return -1;
    }
    uint8_t *b = (uint8_t *)q8_buf;
    out->q = (int8_t *)b;
    out->u = b + rows * kl;
    out->dl = (float *)(b + rows * kl * 2);
    out->d = out->dl + rows * (kl / 4);
    out->s = (int32_t *)(out->d + rows * groups);
    for (int64_t r = 0; r < rows; r++) {
        int8_t *q = out->q + r * kl;
        for (int64_t g = 0; g < groups; g++)
            Q8_GROUP(x + r * k + g * 32, q + g * 32, out->d + r * groups + g, out->s + r * groups + g);
        if (lanes) { /* q8_mm: q + 128, and each lane's d; the tail up to 64 inputs is zero */
            memset(q + k, 0, (size_t)(kl - k));
            for (int64_t i = 0; i < kl; i++) out->u[r * kl + i] = (uint8_t)(q[i] + 128);
            for (int64_t i = 0; i < kl / 4; i++) out->dl[r * (kl / 4) + i] = 4 * i < k ? out->d[r * groups + 4 * i / 32] : 0.f;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ q4_mm */

/* the float32 step of one (row, group, column): acc + d * (s * D + z * S), as the VNNI path orders it */
static inline float q4_combine(float acc, float d, float s, float z, int32_t dot, int32_t sum) {
    const float t = z * (float)sum;
    return fmaf(d, fmaf(s, (float)dot, t), acc);
}

static void q4_mm_portable(const q8_rows *a, const uint8_t *packed, const uint16_t *sz, uint16_t *y, int64_t rows,
                           int64_t n, int64_t k, int threads) {
    const int64_t groups = k / 32, blocks = n / 64, kl = (k + 63) / 64 * 64;
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = packed + b * k * 32;
        for (int64_t r = 0; r < rows; r++) {
            const int8_t *q = a->q + r * kl;
            float acc[64] = {0};
            for (int64_t g = 0; g < groups; g++) {
                int32_t dot[64] = {0};
                for (int64_t i = 0; i < 32; i++) {
                    const uint8_t *pk = p + (g * 32 + i) * 32;
                    const int32_t xv = q[g * 32 + i];
                    for (int c = 0; c < 32; c++) {
                        dot[c] += ((int32_t)(pk[c] & 15) - 8) * xv;
                        dot[32 + c] += ((int32_t)(pk[c] >> 4) - 8) * xv;
                    }
                }
                const float d = a->d[r * groups + g];
                const int32_t sum = a->s[r * groups + g];
                for (int c = 0; c < 64; c++) {
                    const uint16_t *e = sz + (g * n + b * 64 + c) * 2;
                    acc[c] = q4_combine(acc[c], d, bf2f(e[0]), bf2f(e[1]), dot[c], sum);
                }
            }
            for (int c = 0; c < 64; c++) y[r * n + b * 64 + c] = f2bf(acc[c]);
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define Q4_VNNI_BUILT 1
#define Q4_RB 4 /* rows a pass over a group's decoded codes: 4 x 4 integer accumulators */

/* byte 4j + m of lane j (j < 16) of the VNNI operand: input 4i + m of column half + j; A holds
 * inputs 4i, 4i + 1 (32 bytes each), B inputs 4i + 2, 4i + 3: byte index 32 m + half + j of (A, B) */
static inline __m512i q4_index(int half) {
    uint8_t ix[64];
    for (int j = 0; j < 16; j++)
        for (int m = 0; m < 4; m++) ix[4 * j + m] = (uint8_t)(32 * m + half + j);
    return _mm512_loadu_si512((const void *)ix);
}

/* group g of block base's 64 columns for rows r0 .. r0 + R - 1: the 4 x R dot products, then
 * acc (float [rows][64], the block's accumulators) takes each column's step */
static inline __attribute__((always_inline)) void q4_group_rows(
        const q8_rows *a, const uint8_t *pg, const uint16_t *sz, float *acc, int64_t n, int64_t kl, int64_t groups,
        int64_t g, int64_t base, int64_t r0, int R, __m512i ix0, __m512i ix1) {
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i dot[Q4_RB][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) dot[r][c] = _mm512_setzero_si512();
    for (int i = 0; i < 8; i++) {
        const __m512i A = _mm512_loadu_si512((const void *)(pg + i * 128));
        const __m512i B = _mm512_loadu_si512((const void *)(pg + i * 128 + 64));
        const __m512i p0 = _mm512_permutex2var_epi8(A, ix0, B), p1 = _mm512_permutex2var_epi8(A, ix1, B);
        const __m512i w[4] = {_mm512_and_si512(p0, m4), _mm512_and_si512(p1, m4),
                              _mm512_and_si512(_mm512_srli_epi16(p0, 4), m4),
                              _mm512_and_si512(_mm512_srli_epi16(p1, 4), m4)};
        for (int r = 0; r < R; r++) {
            int32_t xv;
            memcpy(&xv, a->q + (r0 + r) * kl + g * 32 + 4 * i, 4);
            const __m512i xb = _mm512_set1_epi32(xv);
            for (int c = 0; c < 4; c++) dot[r][c] = _mm512_dpbusd_epi32(dot[r][c], w[c], xb);
        }
    }
    __m512 s[4], z[4];
    for (int c = 0; c < 4; c++) { /* bf16 (s, z) pairs of 16 columns: s the low word, z the high one */
        const __m512i v = _mm512_loadu_si512((const void *)(sz + (g * n + base + 16 * c) * 2));
        s[c] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        z[c] = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int32_t)0xFFFF0000u)));
    }
    for (int r = 0; r < R; r++) {
        const int32_t sum = a->s[(r0 + r) * groups + g];
        const __m512i s8 = _mm512_set1_epi32(8 * sum);
        const __m512 sf = _mm512_set1_ps((float)sum), d = _mm512_set1_ps(a->d[(r0 + r) * groups + g]);
        float *ar = acc + (r0 + r) * 64;
        for (int c = 0; c < 4; c++) {
            /* the codes went in as 0..15: D = sum code q - 8 S */
            const __m512 df = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][c], s8));
            const __m512 t = _mm512_fmadd_ps(s[c], df, _mm512_mul_ps(z[c], sf));
            _mm512_store_ps(ar + 16 * c, _mm512_fmadd_ps(d, t, _mm512_load_ps(ar + 16 * c)));
        }
    }
}

static void q4_mm_vnni(const q8_rows *a, const uint8_t *packed, const uint16_t *sz, uint16_t *y, int64_t rows,
                       int64_t n, int64_t k, int threads) {
    const int64_t groups = k / 32, blocks = n / 64, kl = (k + 63) / 64 * 64;
#pragma omp parallel num_threads(threads)
    {
        const __m512i ix0 = q4_index(0), ix1 = q4_index(16);
        float acc[Q4_MM_ROWS * 64] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *p = packed + b * k * 32;
            const int64_t base = b * 64;
            for (int64_t i = 0; i < rows * 64; i += 16) _mm512_store_ps(acc + i, _mm512_setzero_ps());
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *pg = p + g * 1024;
                if (g + 4 < groups) /* the scales' rows are n * 4 bytes apart: a stride the streams' prefetch misses */
                    for (int c = 0; c < 4; c++) _mm_prefetch((const char *)(sz + ((g + 4) * n + base) * 2) + 64 * c, _MM_HINT_T0);
                for (int64_t r0 = 0; r0 < rows; r0 += Q4_RB) {
                    const int64_t left = rows - r0;
                    /* a constant row count for each call, so that the accumulators are registers */
                    if (left >= 4) q4_group_rows(a, pg, sz, acc, n, kl, groups, g, base, r0, 4, ix0, ix1);
                    else if (left == 3) q4_group_rows(a, pg, sz, acc, n, kl, groups, g, base, r0, 3, ix0, ix1);
                    else if (left == 2) q4_group_rows(a, pg, sz, acc, n, kl, groups, g, base, r0, 2, ix0, ix1);
                    else q4_group_rows(a, pg, sz, acc, n, kl, groups, g, base, r0, 1, ix0, ix1);
                }
            }
            for (int64_t r = 0; r < rows; r++)
                for (int c = 0; c < 4; c++)
                    _mm256_storeu_si256((__m256i *)(y + r * n + base + 16 * c), to_bf16x16(_mm512_load_ps(acc + r * 64 + 16 * c)));
        }
    }
}
#else
#define Q4_VNNI_BUILT 0
#endif

int q4_vnni_native(void) { return Q4_VNNI_BUILT; }

/* y = x @ w.T (module comment): x bf16 [rows, k]; packed uint8 [n / 64, k, 32]; sz bf16 [k / 32, n, 2];
 * y bf16 [rows, n]; rows <= Q4_MM_ROWS, n a multiple of 64, k of 32 (the caller checks). portable: the
 * plain C path. Returns 0, or -1 where the activations' buffer could not be had (y untouched). */
int q4_mm(const uint16_t *x, const uint8_t *packed, const uint16_t *sz, uint16_t *y, int64_t rows, int64_t n,
          int64_t k, int threads, int portable) {
    q8_rows a;
    if (q8_quantise(x, rows, k, 0, portable || !Q4_VNNI_BUILT, &a)) return -1;
#if Q4_VNNI_BUILT
    if (!portable) { q4_mm_vnni(&a, packed, sz, y, rows, n, k, threads); return 0; }
#endif
    q4_mm_portable(&a, packed, sz, y, rows, n, k, threads);
    return 0;
}

/* ------------------------------------------------------------------ q8_mm */

/* the 16 lanes' sum in the VNNI path's tree: i + (i + 8), then + 4, + 2, + 1 */
static inline float q8_tree(const float *v) {
    float b[8], c[4];
    for (int i = 0; i < 8; i++) b[i] = v[i] + v[i + 8];
    for (int i = 0; i < 4; i++) c[i] = b[i] + b[i + 4];
    return (c[0] + c[2]) + (c[1] + c[3]);
}

static void q8_mm_portable(const q8_rows *a, const int8_t *codes, const uint16_t *scale, uint16_t *y, int64_t rows,
                           int64_t n, int64_t k, int threads) {
    const int64_t kl = (k + 63) / 64 * 64;
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const int8_t *w = codes + j * k;
        for (int64_t r = 0; r < rows; r++) {
            const int8_t *q = a->q + r * kl;
            const float *dl = a->dl + r * (kl / 4);
            float lane[16] = {0};
            for (int64_t c = 0; c < kl; c += 64)
                for (int l = 0; l < 16; l++) {
                    int32_t dot = 0;
                    for (int m = 0; m < 4; m++) {
                        const int64_t i = c + 4 * l + m;
                        if (i < k) dot += (int32_t)w[i] * q[i];
                    }
                    lane[l] = fmaf((float)dot, dl[c / 4 + l], lane[l]);
                }
            y[r * n + j] = f2bf(q8_tree(lane) * bf2f(scale[j]));
        }
    }
}

#if Q4_VNNI_BUILT
#define Q8_RB 4 /* rows a pass */
#define Q8_CB 4 /* output channels a pass: 4 x 4 float accumulators */

static inline float q8_tree_avx512(__m512 v) {
    const __m256 b = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    const __m128 e = _mm_add_ps(c, _mm_movehl_ps(c, c)); /* c0 + c2, c1 + c3 */
    return _mm_cvtss_f32(_mm_add_ss(e, _mm_shuffle_ps(e, e, 1)));
}

static inline __attribute__((always_inline)) void q8_cols(const q8_rows *a, const int8_t *codes, const uint16_t *scale,
                                                          uint16_t *y, int64_t n, int64_t k, int64_t kl, int64_t j0,
                                                          int64_t r0, int R) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512 acc[Q8_RB][Q8_CB];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < Q8_CB; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kl; i += 64) {
        const __mmask64 m = i + 64 <= k ? ~0ull : (1ull << (k - i)) - 1; /* k - i is 32 at the tail */
        __m512i w[Q8_CB], w128[Q8_CB];
        for (int c = 0; c < Q8_CB; c++) {
            w[c] = _mm512_maskz_loadu_epi8(m, (const void *)(codes + (j0 + c) * k + i));
            /* 128 * the codes' sum per lane: what q + 128 adds */
            w128[c] = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w[c]), 7);
        }
        for (int r = 0; r < R; r++) {
            const __m512i u = _mm512_load_si512((const void *)(a->u + (r0 + r) * kl + i));
            const __m512 dl = _mm512_loadu_ps(a->dl + (r0 + r) * (kl / 4) + i / 4);
            for (int c = 0; c < Q8_CB; c++) {
                const __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, w[c]), w128[c]);
                acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dl, acc[r][c]);
            }
        }
    }
    for (int c = 0; c < Q8_CB; c++) {
        const float s = bf2f(scale[j0 + c]);
        for (int r = 0; r < R; r++) y[(r0 + r) * n + j0 + c] = f2bf(q8_tree_avx512(acc[r][c]) * s);
    }
}

static void q8_mm_vnni(const q8_rows *a, const int8_t *codes, const uint16_t *scale, uint16_t *y, int64_t rows,
                       int64_t n, int64_t k, int threads) {
    const int64_t kl = (k + 63) / 64 * 64, items = n / Q8_CB;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < items; t++) {
        for (int64_t r0 = 0; r0 < rows; r0 += Q8_RB) {
            const int64_t left = rows - r0;
            if (left >= 4) q8_cols(a, codes, scale, y, n, k, kl, t * Q8_CB, r0, 4);
            else if (left == 3) q8_cols(a, codes, scale, y, n, k, kl, t * Q8_CB, r0, 3);
            else if (left == 2) q8_cols(a, codes, scale, y, n, k, kl, t * Q8_CB, r0, 2);
            else q8_cols(a, codes, scale, y, n, k, kl, t * Q8_CB, r0, 1);
        }
    }
}
#endif

/* y = x @ codes.T * scale (module comment): x bf16 [rows, k]; codes int8 [n, k] (-127..127); scale
 * bf16 [n]; y bf16 [rows, n]; rows <= Q4_MM_ROWS, k a multiple of 32, n of 4 (the caller checks).
 * Returns 0, or -1 where the activations' buffer could not be had. */
int q8_mm(const uint16_t *x, const int8_t *codes, const uint16_t *scale, uint16_t *y, int64_t rows, int64_t n,
          int64_t k, int threads, int portable) {
    q8_rows a;
    if (q8_quantise(x, rows, k, 1, portable || !Q4_VNNI_BUILT, &a)) return -1;
#if Q4_VNNI_BUILT
    if (!portable) { q8_mm_vnni(&a, codes, scale, y, rows, n, k, threads); return 0; }
#endif
    q8_mm_portable(&a, codes, scale, y, rows, n, k, threads);
    return 0;
}
