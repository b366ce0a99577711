/* Fused CPU ops of a decode step (chatkv.kernels.cpu_decode builds this with gcc and calls it with
 * ctypes; each function has a pure-torch twin there, which is the oracle and the fallback).
 *
 * At batch 1 a 135M model's decode step is ~60 small torch ops a layer around 4 matmuls; each op
 * costs ~1-3 us of dispatch and allocation for a few hundred numbers. These do that work in one
 * call each. They compute what the torch ops compute, rounding to bfloat16 where those ops round:
 * only the order of fp32 sums (and the norms' sum of squares, in double here) differs.
 * The step's few-row matrix products are in cpu_matmul.c, bf16 <-> float32 in cpu_bf16.h.
 * (Past ~400 lines on purpose: decode_attention, rope_store and rows_attention share one attention
 * core, attend, whose work items and merge order are what makes a row's bits its own.) */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* h[r] += y[r] (y bf16, may be NULL); out[r] = bf16(h[r] * rsqrt(mean(h[r]^2) + eps) * w).
 * h: float32 [rows, n] (the residual stream, updated in place), w: float32 [n], out: bf16 [rows, n]. */
void add_rms(float *h, const uint16_t *y, const float *w, uint16_t *out, int64_t rows, int64_t n, double eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *x = h + r * n;
        if (y) {
            const uint16_t *yr = y + r * n;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) x[i] += bf2f(yr[i]);
        }
        double ss = 0.0;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
        float inv = (float)(1.0 / sqrt(ss / (double)n + eps));
        uint16_t *o = out + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = f2bf(x[i] * inv * w[i]);
    }
}

#define ATTN_SEGMENT 64  /* keys per work item of decode_attention (cpu_decode.py: ATTN_SEGMENT) */
#define ATTN_MAX_GROUP 16 /* query heads per kv head it takes (cpu_decode.py: MAX_GROUP) */

/* exp(x), 16 at a time: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r and 2^n by
 * scalef; within 2 ulp of expf (glibc's scalar expf was half the attention's time); below -87.3
 * it gives 0 and above 88.7 infinity, as expf's underflow and overflow do; NaN stays NaN. */
#ifdef __AVX512F__
static inline __m512 exp_ps(__m512 x) {
    /* max/min return their second operand where one is NaN: x second keeps a NaN */
    x = _mm512_min_ps(_mm512_set1_ps(88.8f), _mm512_max_ps(_mm512_set1_ps(-87.3f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 bf16_round(__m512 f) { /* float32 -> the nearest bf16 (as f2bf), as float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(f)), 16));
}
#endif

/* out[r] = bf16(bf16(silu(g)) * u) where gu[r] = [g (n), u (n)], bf16; as F.silu(g) * u in bf16. */
void silu_mul(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * 2 * n, *u = g + n;
        uint16_t *o = out + r * n;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= n; i += 16) {
            const __m512 x = bf16x16(g + i);
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x));
            const __m512 sl = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm256_storeu_si256((__m256i *)(o + i), to_bf16x16(_mm512_mul_ps(bf16_round(sl), bf16x16(u + i))));
        }
#endif
        for (; i < n; i++) {
            float x = bf2f(g[i]);
            float s = bf2f(f2bf(x / (1.0f + expf(-x))));
            o[i] = f2bf(s * bf2f(u[i]));
        }
    }
}

/* scores[0..n) = exp(scores - mx); returns their sum */
static float exp_shift_sum(float *sc, int64_t n, float mx) {
    int64_t j = 0;
    float sum = 0.0f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    const __m512 m = _mm512_set1_ps(mx);
    for (; j + 16 <= n; j += 16) {
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + j), m));
        _mm512_storeu_ps(sc + j, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (j < n) {
        const __mmask16 k = (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + j), m));
        _mm512_mask_storeu_ps(sc + j, k, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
        j = n;
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; j < n; j++) {
        sc[j] = expf(sc[j] - mx);
        sum += sc[j];
    }
    return sum;
}

/* One work item of decode_attention (see there); D is the head size, a constant where the caller
 * names one (64, 128), so that each head's loops unroll. */
static inline __attribute__((always_inline)) void attention_item(
    int64_t it, const int64_t D, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *blocks,
    const int64_t *lo, const int64_t *ctx, int64_t max_blocks, int64_t block_size, int64_t nh, int64_t nkv,
    int64_t group, int64_t segs, float scale, const uint16_t *q_scratch, float *scores) {
    const int64_t d = D, pw = D + 2;
    const int64_t r = it / (nkv * segs), kvh = (it / segs) % nkv, sg = it % segs, n = ctx[r];
    const int64_t s0 = sg * ATTN_SEGMENT, j_hi = n < s0 + ATTN_SEGMENT ? n : s0 + ATTN_SEGMENT;
    const int64_t j_lo = lo && lo[r] > s0 ? lo[r] : s0; /* a sliding window's first key */
    float *pt = scores + it * group * pw;
    if (j_lo >= j_hi) {
        for (int64_t g = 0; g < group; g++) pt[g * pw] = -INFINITY, pt[g * pw + 1] = 0.0f;
        return;
    }
    const int64_t *bl = blocks + r * max_blocks;
    float qf[ATTN_MAX_GROUP][512], kf[512], sc[ATTN_MAX_GROUP][ATTN_SEGMENT], mx[ATTN_MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        const uint16_t *q = q_scratch + r * nh * d + (kvh * group + g) * d;
        for (int64_t i = 0; i < d; i++) qf[g][i] = bf2f(q[i]) * scale;
        mx[g] = -INFINITY;
    }
    for (int64_t j = j_lo; j < j_hi; j++) {
        const uint16_t *k = k_cache + ((bl[j / block_size] * block_size + j % block_size) * nkv + kvh) * d;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) kf[i] = bf2f(k[i]);
        for (int64_t g = 0; g < group; g++) {
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < d; i++) s += qf[g][i] * kf[i];
            sc[g][j - j_lo] = s;
            if (s > mx[g]) mx[g] = s;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        pt[g * pw] = mx[g];
        pt[g * pw + 1] = exp_shift_sum(sc[g], j_hi - j_lo, mx[g]);
        float *acc = pt + g * pw + 2;
        for (int64_t i = 0; i < d; i++) acc[i] = 0.0f;
    }
    for (int64_t j = j_lo; j < j_hi; j++) {
        const uint16_t *v = v_cache + ((bl[j / block_size] * block_size + j % block_size) * nkv + kvh) * d;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) kf[i] = bf2f(v[i]);
        for (int64_t g = 0; g < group; g++) {
            const float p = sc[g][j - j_lo];
            float *acc = pt + g * pw + 2;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) acc[i] += p * kf[i];
        }
    }
}

#ifdef __AVX512F__
#define ATTN_FAST_MAX_D 128 /* the widest head the register-blocked path takes (D / 16 vectors a query) */

/* out lane t = the sum of v[t]'s 16 lanes, for t < 16: a fixed tree over each vector's own lanes
 * (what one key's score is never depends on the other keys of the block). */
static inline __m512 hsum16(const __m512 *v) {
    __m512 w[8], z[4], u[2];
    for (int t = 0; t < 8; t++) /* [t quarters 0,1 + 2,3 | t+1 ...]: 8 lanes of each of two keys */
        w[t] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * t], v[2 * t + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * t], v[2 * t + 1], 0xEE));
    for (int t = 0; t < 4; t++) /* quarter q of z[t]: key 4t + q, 4 lanes */
        z[t] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * t], w[2 * t + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * t], w[2 * t + 1], 0xDD));
    for (int t = 0; t < 2; t++) /* quarter q of u[t]: keys 8t + q at lanes 0, 1 and 8t + 4 + q at 2, 3 (2 lanes each) */
        u[t] = _mm512_add_ps(_mm512_unpacklo_ps(z[2 * t], z[2 * t + 1]), _mm512_unpackhi_ps(z[2 * t], z[2 * t + 1]));
    /* quarter q: keys q, 8 + q, 4 + q, 12 + q */
    const __m512 s = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, s);
}

/* One work item of decode_attention's register-blocked path: (a run of rows with the same block
 * table, kv head, segment). The segment's keys and values are converted to float32 once for all
 * the run's rows (a verification's rows share them); each row then computes exactly what it
 * computes alone (its own keys, below its own ctx): a key's score is D / 16 fused multiply-adds
 * into one vector, 16 keys' vectors summed by hsum16; the value sum stays in registers. Used for
 * every row of the step, a lone decode included, so a verified row is its lone decode's bits. */
static inline __attribute__((always_inline)) void attention_run_item(
    int64_t it, const int64_t D, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *blocks,
    const int64_t *lo, const int64_t *ctx, const int64_t *run_start, int64_t max_blocks, int64_t block_size, int64_t nh,
    int64_t nkv, int64_t group, int64_t segs, float scale, const uint16_t *q_scratch, float *scores) {
    const int64_t pw = D + 2, nv = D / 16;
    const int64_t run = it / (nkv * segs), kvh = (it / segs) % nkv, sg = it % segs;
    const int64_t r0 = run_start[run], r1 = run_start[run + 1];
    const int64_t j_lo = sg * ATTN_SEGMENT;
    int64_t n_max = 0;
    for (int64_t r = r0; r < r1; r++) n_max = ctx[r] > n_max ? ctx[r] : n_max;
    const int64_t j_hi = n_max < j_lo + ATTN_SEGMENT ? n_max : j_lo + ATTN_SEGMENT;
    const int64_t *bl = blocks + r0 * max_blocks;
    float kf[ATTN_SEGMENT * D], vf[ATTN_SEGMENT * D];
    for (int64_t j = j_lo; j < j_hi; j++) {
        const int64_t at = ((bl[j / block_size] * block_size + j % block_size) * nkv + kvh) * D;
        for (int64_t c = 0; c < nv; c++) {
            _mm512_storeu_ps(kf + (j - j_lo) * D + 16 * c, bf16x16(k_cache + at + 16 * c));
            _mm512_storeu_ps(vf + (j - j_lo) * D + 16 * c, bf16x16(v_cache + at + 16 * c));
        }
    }
    for (int64_t r = r0; r < r1; r++) {
        float *pt = scores + ((r * nkv + kvh) * segs + sg) * group * pw;
        const int64_t n = (ctx[r] < j_hi ? ctx[r] : j_hi) - j_lo; /* this row's keys in the segment */
        /* a sliding window's row starts at its first key: its scores sit at sc[f ..], so which
         * lanes sum them depends on that key alone, never on the other rows */
        const int64_t f = lo && lo[r] > j_lo ? lo[r] - j_lo : 0;
        for (int64_t g = 0; g < group; g++) {
            if (n <= f) {
                pt[g * pw] = -INFINITY, pt[g * pw + 1] = 0.0f;
                continue;
            }
            const uint16_t *q = q_scratch + r * nh * D + (kvh * group + g) * D;
            __m512 qv[ATTN_FAST_MAX_D / 16], acc[ATTN_FAST_MAX_D / 16];
            for (int64_t c = 0; c < nv; c++) qv[c] = _mm512_mul_ps(bf16x16(q + 16 * c), _mm512_set1_ps(scale));
            float sc[ATTN_SEGMENT];
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int64_t b = f; b < n; b += 16) {
                const int64_t m = n - b < 16 ? n - b : 16;
                __m512 part[16];
                for (int64_t t = 0; t < 16; t++) {
                    __m512 s = _mm512_setzero_ps();
                    if (t < m) {
                        const float *k = kf + (b + t) * D;
                        s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
                        for (int64_t c = 1; c < nv; c++) s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), s);
                    }
                    part[t] = s;
                }
                const __mmask16 mk = (__mmask16)(m == 16 ? 0xFFFFu : (1u << m) - 1);
                const __m512 s = hsum16(part);
                _mm512_mask_storeu_ps(sc + b, mk, s);
                mx = _mm512_mask_max_ps(mx, mk, mx, s);
            }
            const float m = _mm512_reduce_max_ps(mx);
            pt[g * pw] = m;
            pt[g * pw + 1] = exp_shift_sum(sc + f, n - f, m);
            for (int64_t c = 0; c < nv; c++) acc[c] = _mm512_setzero_ps();
            for (int64_t j = f; j < n; j++) {
                const __m512 p = _mm512_set1_ps(sc[j]);
                const float *v = vf + j * D;
                for (int64_t c = 0; c < nv; c++) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * c), acc[c]);
            }
            for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(pt + g * pw + 2 + 16 * c, acc[c]);
        }
    }
}
#endif

static int attention_blocked = 1; /* 0: every row its own items (the path before the blocked one) */

/* Choose decode_attention's path (benchmarks/bench_decode_attention.py compares them in one
 * run); returns the one before. Both give every row the same bits whatever else is in the step. */
int set_attention_blocked(int on) {
    const int before = attention_blocked;
    attention_blocked = on;
    return before;
}

/* The attention of decode_attention and rows_attention: `rows` one-token queries (rotated q,
 * bf16 [rows, nh d]) over keys already stored; row r attends to keys [lo[r], ctx[r]) (lo NULL:
 * from 0) of its blocks. See decode_attention for the work items and the scratch. */
static void attend(const uint16_t *q_scratch, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *blocks,
                   const int64_t *lo, const int64_t *ctx, int64_t max_blocks, int64_t block_size, int64_t rows,
                   int64_t nh, int64_t nkv, int64_t d, float scale, float *scores, int64_t segments, int threads,
                   uint16_t *out) {
    const int64_t group = nh / nkv;
    /* Work items: (row, kv head, segment of ATTN_SEGMENT keys), each for the `group` query heads
     * that share the kv head (a key and a value are converted once for all of them). Each item
     * leaves, per query head, its max score m, sum of exp l and unnormalised output in `scores`;
     * then each (row, head) merges its segments in order. Which keys form a segment depends on
     * ctx only, never on the threads: the result is the same bits on any thread count. */
    const int64_t segs = segments; /* per (row, kv head): ceil(max ctx / ATTN_SEGMENT) */
    const int64_t pw = d + 2;          /* per query head of an item: m, l, out[d] */
#ifdef __AVX512F__
    if (attention_blocked && d % 16 == 0 && d <= ATTN_FAST_MAX_D) {
        /* runs of consecutive rows with the same block table (a verification's rows): an item per
         * (run, kv head, segment), the keys converted once for the run */
        int64_t run_start[rows + 1], runs = 0;
        for (int64_t r = 0; r < rows; r++)
            if (r == 0 || memcmp(blocks + r * max_blocks, blocks + (r - 1) * max_blocks, (size_t)max_blocks * sizeof(int64_t)))
                run_start[runs++] = r;
        run_start[runs] = rows;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t it = 0; it < runs * nkv * segs; it++) {
            if (d == 64)
                attention_run_item(it, 64, k_cache, v_cache, blocks, lo, ctx, run_start, max_blocks, block_size, nh, nkv, group, segs, scale, q_scratch, scores);
            else
                attention_run_item(it, d, k_cache, v_cache, blocks, lo, ctx, run_start, max_blocks, block_size, nh, nkv, group, segs, scale, q_scratch, scores);
        }
    } else
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t it = 0; it < rows * nkv * segs; it++) {
        if (d == 64)
            attention_item(it, 64, k_cache, v_cache, blocks, lo, ctx, max_blocks, block_size, nh, nkv, group, segs, scale, q_scratch, scores);
        else if (d == 128)
            attention_item(it, 128, k_cache, v_cache, blocks, lo, ctx, max_blocks, block_size, nh, nkv, group, segs, scale, q_scratch, scores);
        else
            attention_item(it, d, k_cache, v_cache, blocks, lo, ctx, max_blocks, block_size, nh, nkv, group, segs, scale, q_scratch, scores);
    }
    for (int64_t rh = 0; rh < rows * nh; rh++) { /* merge each (row, head)'s segments, in order */
        const int64_t r = rh / nh, h = rh % nh, kvh = h / group, g = h % group;
        const float *p0 = scores + ((r * nkv + kvh) * segs) * group * pw + g * pw;
        float m = -INFINITY;
        for (int64_t sg = 0; sg < segs; sg++) m = p0[sg * group * pw] > m ? p0[sg * group * pw] : m;
        float acc[512], l = 0.0f;
        for (int64_t i = 0; i < d; i++) acc[i] = 0.0f;
        for (int64_t sg = 0; sg < segs; sg++) {
            const float *ps = p0 + sg * group * pw;
            if (ps[1] == 0.0f) continue; /* an empty segment (beyond this row's ctx) */
            const float w = segs == 1 ? 1.0f : expf(ps[0] - m);
            l += w * ps[1];
            for (int64_t i = 0; i < d; i++) acc[i] += w * ps[2 + i];
        }
        uint16_t *o = out + r * nh * d + h * d;
        const float inv = 1.0f / l;
        for (int64_t i = 0; i < d; i++) o[i] = f2bf(acc[i] * inv);
    }
}

/* decode_attention's first part (rope_store for a deterministic engine's wide steps, which then
 * attend through rows_attention): rows' q and k rotated by RoPE (q into q_scratch [rows, nh d], k
 * with v into their slots of the caches), as decode_attention describes. */
void rope_store(const uint16_t *qkv, const uint16_t *table, const int64_t *pos, uint16_t *k_cache, uint16_t *v_cache,
                const int64_t *slot, int64_t rows, int64_t nh, int64_t nkv, int64_t d, uint16_t *q_scratch) {
    const int64_t width = (nh + 2 * nkv) * d, half = d / 2;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *x = qkv + r * width;
        const uint16_t *cs = table + pos[r] * 2 * d, *sn = cs + d;
        uint16_t *qr = q_scratch + r * nh * d;
        uint16_t *kd = k_cache + slot[r] * nkv * d, *vd = v_cache + slot[r] * nkv * d;
        for (int64_t h = 0; h < nh + nkv; h++) {
            const uint16_t *xh = x + h * d;
            uint16_t *dst = h < nh ? qr + h * d : kd + (h - nh) * d;
            int64_t i = 0;
#ifdef __AVX512F__
            if (half % 16 == 0) /* 16 at a time, the same roundings: bf16(bf16(x cos) + bf16(swapped sin)) */
                for (; i < d; i += 16) {
                    const __m512 a = bf16_round(_mm512_mul_ps(bf16x16(xh + i), bf16x16(cs + i)));
                    const __m512 b = bf16_round(_mm512_mul_ps(bf16x16(xh + (i < half ? i + half : i - half)), bf16x16(sn + i)));
                    _mm256_storeu_si256((__m256i *)(dst + i), to_bf16x16(_mm512_add_ps(a, b)));
                }
#endif
            for (; i < d; i++) {
                float sw = bf2f(xh[i < half ? i + half : i - half]);
                float a = bf2f(f2bf(bf2f(xh[i]) * bf2f(cs[i])));
                float b = bf2f(f2bf(sw * bf2f(sn[i])));
                dst[i] = f2bf(a + b);
            }
        }
        memcpy(vd, x + (nh + nkv) * d, (size_t)(nkv * d) * sizeof(uint16_t));
    }
}

/* One decode layer's attention for `rows` one-token queries, each over its own keys:
 * - q and k heads of qkv[r] (bf16 [rows, (nh + 2 nkv) d]) rotated by RoPE as the model's _rotate
 *   does in bf16: bf16(bf16(x cos) + bf16(swapped sin)), cos and sign-folded sin from
 *   table[pos[r]] (bf16 [positions, 2, d]);
 * - every row's rotated k and its v stored at slot[r] of k_cache / v_cache (bf16 [slots, nkv, d]),
 *   all rows before any attends (a row sees the keys earlier rows of the step stored);
 * - row r attends to its first ctx[r] keys, found in blocks[r * max_blocks ...] of block_size
 *   slots: fp32 scores q.k * scale, softmax, sum p v, rounded to bf16 into out [rows, nh d].
 * scores: float32 scratch of rows * nkv * segments * (nh / nkv) * (d + 2), segments: those of
 * ATTN_SEGMENT keys of the longest row (chatkv.kernels.cpu_decode.attention_scratch).
 * The work is split over `threads` OpenMP threads (torch's own libgomp). */
void decode_attention(const uint16_t *qkv, const uint16_t *table, const int64_t *pos, uint16_t *k_cache,
                      uint16_t *v_cache, const int64_t *slot, const int64_t *blocks, const int64_t *ctx,
                      int64_t max_blocks, int64_t block_size, int64_t rows, int64_t nh, int64_t nkv, int64_t d,
                      float scale, uint16_t *q_scratch, float *scores, int64_t segments, int threads,
                      uint16_t *out) {
    rope_store(qkv, table, pos, k_cache, v_cache, slot, rows, nh, nkv, d, q_scratch);
    attend(q_scratch, k_cache, v_cache, blocks, NULL, ctx, max_blocks, block_size, rows, nh, nkv, d, scale, scores,
           segments, threads, out);
}

/* rows_attention: the attention of decode_attention without its RoPE and KV store, for queries
 * rotated and keys stored by the caller (a deterministic engine's every row, prefill chunks
 * included: chatkv.model.forward): q bf16 [rows, nh d]; row r attends to keys [lo[r], ctx[r])
 * of its blocks (lo NULL: from 0; a sliding window's rows start later). A row's bits depend on
 * its own query and keys only: not on the other rows, their number or the threads. */
void rows_attention(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *blocks,
                    const int64_t *lo, const int64_t *ctx, int64_t max_blocks, int64_t block_size, int64_t rows,
                    int64_t nh, int64_t nkv, int64_t d, float scale, float *scores, int64_t segments, int threads,
                    uint16_t *out) {
    attend(q, k_cache, v_cache, blocks, lo, ctx, max_blocks, block_size, rows, nh, nkv, d, scale, scores, segments,
           threads, out);
}

/* The int4 kernel's weights, transposed, for a many-row step without a resident copy
 * (chatkv.quant_prefill.ScratchInt4): out[k, n] = bf16((code - 8) * s + z), the product exact in
 * float32 and the sum rounded to float32, then to bfloat16 once more (as torch.addcmul on the
 * bfloat16 tensors rounds). packed: torch's CPU int4 packing, uint8 [N / block, K, block / 2],
 * byte [b, k, d] holding row b * block + d in its low nibble and b * block + block / 2 + d in its
 * high one; sz: bfloat16 [K / 32, N, 2] (s, z); out: bfloat16 [K, N]. */
void int4_weight_t(const uint8_t *packed, const uint16_t *sz, uint16_t *out, int64_t n, int64_t k, int64_t block,
                   int threads) {
    const int64_t nb = n / block, half = block / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t kb = 0; kb < k * nb; kb++) {
        const int64_t kk = kb / nb, b = kb % nb;
        const uint8_t *p = packed + (b * k + kk) * half;
        const uint16_t *g = sz + ((kk / 32) * n + b * block) * 2;
        uint16_t *o = out + kk * n + b * block;
        int64_t d = 0;
#ifdef __AVX512F__
        for (; d + 16 <= half; d += 16) {
            const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + d)));
            for (int nib = 0; nib < 2; nib++) {
                const __m512i q = nib ? _mm512_srli_epi32(c, 4) : _mm512_and_si512(c, _mm512_set1_epi32(15));
                const __m512 w = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(8)));
                const __m512i pr = _mm512_loadu_si512((const void *)(g + 2 * (nib * half + d))); /* 16 (s, z) */
                const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(pr, 16));
                const __m512 zv = _mm512_castsi512_ps(_mm512_and_si512(pr, _mm512_set1_epi32((int32_t)0xFFFF0000u)));
                /* w * s is exact in float32 (an integer of 4 bits times 8 significant bits): the fused
                 * multiply-add rounds once, as the product and the sum did */
                _mm256_storeu_si256((__m256i *)(o + nib * half + d), to_bf16x16(_mm512_fmadd_ps(w, sv, zv)));
            }
        }
#endif
        for (; d < half; d++) {
            const float lo = (float)((int)(p[d] & 15) - 8), hi = (float)((int)(p[d] >> 4) - 8);
            o[d] = f2bf(lo * bf2f(g[2 * d]) + bf2f(g[2 * d + 1]));
            o[half + d] = f2bf(hi * bf2f(g[2 * (half + d)]) + bf2f(g[2 * (half + d) + 1]));
        }
    }
}


/* Per-channel int8 weights as bfloat16, for a many-row step without a resident copy
 * (chatkv.model.prefill.ScratchInt8): out[r, c] = bf16(codes[r, c] * scale[r]), the product
 * rounded to float32 and then to bfloat16, as torch.mul of the int8 codes and the float32
 * scales into a bfloat16 tensor rounds it. codes: int8 [n, k], scale: float32 [n], out: bf16 [n, k].
 * torch's mixed-dtype mul takes ~15x a plain copy's time here; this is one pass at memory speed. */
void int8_weight(const int8_t *codes, const float *scale, uint16_t *out, int64_t n, int64_t k, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const int8_t *c = codes + r * k;
        uint16_t *o = out + r * k;
        const float s = scale[r];
        int64_t i = 0;
#ifdef __AVX512F__
        const __m512 sv = _mm512_set1_ps(s);
        for (; i + 16 <= k; i += 16) {
            const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + i))));
            _mm256_storeu_si256((__m256i *)(o + i), to_bf16x16(_mm512_mul_ps(w, sv)));
        }
#endif
        for (; i < k; i++) o[i] = f2bf((float)c[i] * s);
    }
}
