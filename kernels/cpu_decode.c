/* Fused CPU ops of a decode step (chatkv.kernels.cpu_decode builds this with gcc and calls it with
 * ctypes; each function has a pure-torch twin there, which is the oracle and the fallback).
 *
 * At batch 1 a 135M model's decode step is ~60 small torch ops a layer around 4 matmuls; each op
 * costs ~1-3 us of dispatch and allocation for a few hundred numbers. These do that work in one
 * call each. They compute what the torch ops compute, rounding to bfloat16 where those ops round:
 * only the order of fp32 sums (and the norms' sum of squares, in double here) differs.
 *
 * bf16 is uint16_t; rounding fp32 -> bf16 is round-to-nearest-even, as torch's. */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

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

/* out[r] = bf16(bf16(silu(g)) * u) where gu[r] = [g (n), u (n)], bf16; as F.silu(g) * u in bf16. */
void silu_mul(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * 2 * n, *u = g + n;
        uint16_t *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            float x = bf2f(g[i]);
            float s = bf2f(f2bf(x / (1.0f + expf(-x))));
            o[i] = f2bf(s * bf2f(u[i]));
        }
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
 * scores: float32 scratch of at least max over r of ctx[r]. */
void decode_attention(const uint16_t *qkv, const uint16_t *table, const int64_t *pos, uint16_t *k_cache,
                      uint16_t *v_cache, const int64_t *slot, const int64_t *blocks, const int64_t *ctx,
                      int64_t max_blocks, int64_t block_size, int64_t rows, int64_t nh, int64_t nkv, int64_t d,
                      float scale, uint16_t *q_scratch, float *scores, uint16_t *out) {
    const int64_t width = (nh + 2 * nkv) * d, half = d / 2, group = nh / nkv;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *x = qkv + r * width;
        const uint16_t *cs = table + pos[r] * 2 * d, *sn = cs + d;
        uint16_t *qr = q_scratch + r * nh * d;
        uint16_t *kd = k_cache + slot[r] * nkv * d, *vd = v_cache + slot[r] * nkv * d;
        for (int64_t h = 0; h < nh + nkv; h++) {
            const uint16_t *xh = x + h * d;
            uint16_t *dst = h < nh ? qr + h * d : kd + (h - nh) * d;
            for (int64_t i = 0; i < d; i++) {
                float sw = bf2f(xh[i < half ? i + half : i - half]);
                float a = bf2f(f2bf(bf2f(xh[i]) * bf2f(cs[i])));
                float b = bf2f(f2bf(sw * bf2f(sn[i])));
                dst[i] = f2bf(a + b);
            }
        }
        memcpy(vd, x + (nh + nkv) * d, (size_t)(nkv * d) * sizeof(uint16_t));
    }
    float acc[512];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t n = ctx[r];
        const int64_t *bl = blocks + r * max_blocks;
        for (int64_t h = 0; h < nh; h++) {
            const int64_t kvh = h / group;
            const uint16_t *q = q_scratch + r * nh * d + h * d;
            float qf[512];
            for (int64_t i = 0; i < d; i++) qf[i] = bf2f(q[i]);
            float mx = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                const uint16_t *k = k_cache + ((bl[j / block_size] * block_size + j % block_size) * nkv + kvh) * d;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t i = 0; i < d; i++) s += qf[i] * bf2f(k[i]);
                s *= scale;
                scores[j] = s;
                if (s > mx) mx = s;
            }
            float sum = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                scores[j] = expf(scores[j] - mx);
                sum += scores[j];
            }
            for (int64_t i = 0; i < d; i++) acc[i] = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                const uint16_t *v = v_cache + ((bl[j / block_size] * block_size + j % block_size) * nkv + kvh) * d;
                const float p = scores[j];
#pragma omp simd
                for (int64_t i = 0; i < d; i++) acc[i] += p * bf2f(v[i]);
            }
            uint16_t *o = out + r * nh * d + h * d;
            const float inv = 1.0f / sum;
            for (int64_t i = 0; i < d; i++) o[i] = f2bf(acc[i] * inv);
        }
    }
}
