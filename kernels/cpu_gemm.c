/* Row-invariant matrix products for the float modes (chatkv.kernels.cpu_invariant builds nothing itself:
 * this file is compiled into the library of cpu_decode.c; chatkv.model.forward takes it when the
 * engine is deterministic).
 *
 * y = x @ w.T (+ bias) where every output element is one fixed chain of float32 sums over the
 * inputs in order, whatever the number of rows in the call and whatever the number of threads:
 * the threads split the output columns only, and no path is chosen by the row count. So a row's
 * numbers are the same alone, beside 31 other rows, in a prefill chunk of any length or on any
 * thread count. oneDNN's products are not: the same row comes out differently at 33 or 64 rows
 * than alone (its kernel and blocking change with the row count; benchmarks/bench_deterministic.py).
 *
 * Weights are packed once, at load: 16 output columns a block, the inputs as pairs,
 * packed[block][k / 2][16][2] (AMX's B-tile layout, and the one vdpbf16ps reads), zero-padded to
 * whole blocks. Three paths, one per machine (never mixed on one machine):
 * - AMX tiles (tdpbf16ps): 16 rows x 16 columns a tile, the inputs 32 at a time in order;
 * - AVX512-BF16 (vdpbf16ps): per row, 16 columns a vector, the input pairs in order;
 * - plain C: the same order, two fused multiply-adds a pair.
 * AMX and vdpbf16ps round their pair sums their own way, so the paths' bits differ from each other;
 * each is fixed on its machine. The float32 products (fp32 mode) pack [block][k][16] floats and
 * run one fused multiply-add an input, in order. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_bf16.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* w bf16 [n, k] -> packed bf16 [ceil(n / 16), k / 2, 16, 2]; k even (the caller checks) */
void gemm_pack_bf16(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k) {
    const int64_t blocks = (n + 15) / 16, kp = k / 2;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t p = 0; p < kp; p++)
            for (int64_t j = 0; j < 16; j++) {
                const int64_t col = b * 16 + j;
                uint16_t *dst = packed + ((b * kp + p) * 16 + j) * 2;
                dst[0] = col < n ? w[col * k + 2 * p] : 0;
                dst[1] = col < n ? w[col * k + 2 * p + 1] : 0;
            }
}

/* w float32 [n, k] -> packed float32 [ceil(n / 16), k, 16] */
void gemm_pack_f32(const float *w, float *packed, int64_t n, int64_t k) {
    const int64_t blocks = (n + 15) / 16;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < 16; j++) {
                const int64_t col = b * 16 + j;
                packed[(b * k + i) * 16 + j] = col < n ? w[col * k + i] : 0.0f;
            }
}

/* the 16 sums of columns col .. col + 15 of one row, plus bias, to bf16 (only the n - col valid ones) */
static inline void store_row(uint16_t *y, const float *acc, const float *bias, int64_t col, int64_t n) {
    for (int64_t j = 0; j < 16 && col + j < n; j++) y[col + j] = f2bf(bias ? acc[j] + bias[col + j] : acc[j]);
}

/* The plain-C path: per row and 16 columns, two fused multiply-adds an input pair, in order. */
static void gemm_bf16_plain(const uint16_t *x, int64_t rows, const uint16_t *packed, const float *bias, uint16_t *y,
                            int64_t n, int64_t k, int threads) {
    const int64_t blocks = (n + 15) / 16, kp = k / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *pb = packed + b * kp * 32;
        for (int64_t r = 0; r < rows; r++) {
            float acc[16] = {0};
            const uint16_t *xr = x + r * k;
            for (int64_t p = 0; p < kp; p++) {
                const float a0 = bf2f(xr[2 * p]), a1 = bf2f(xr[2 * p + 1]);
                const uint16_t *w = pb + p * 32;
                for (int j = 0; j < 16; j++) {
                    acc[j] = __builtin_fmaf(a0, bf2f(w[2 * j]), acc[j]);
                    acc[j] = __builtin_fmaf(a1, bf2f(w[2 * j + 1]), acc[j]);
                }
            }
            store_row(y + r * n, acc, bias, b * 16, n);
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define GEMM_VR 4 /* rows a pass (x pair broadcasts) */
#define GEMM_VB 4 /* column blocks a pass: GEMM_VR x GEMM_VB independent chains */
/* One pass of the AVX512-BF16 path: rows r0 .. r0 + NR, column blocks b0 .. b0 + NB, one accumulator
 * per (row, 16 columns) and vdpbf16ps over the input pairs in order. NR and NB are constants at
 * each call site, so the loops unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void gemm_avx512_pass(const uint16_t *x, int64_t r0, const int NR,
                                                                   const uint16_t *packed, int64_t b0, const int NB,
                                                                   const float *bias, uint16_t *y, int64_t n,
                                                                   int64_t k) {
    const int64_t kp = k / 2;
    __m512 acc[GEMM_VR][GEMM_VB];
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    const uint16_t *pw[GEMM_VB];
    for (int j = 0; j < NB; j++) pw[j] = packed + (b0 + j) * kp * 32;
    const uint32_t *px[GEMM_VR];
    for (int i = 0; i < NR; i++) px[i] = (const uint32_t *)(x + (r0 + i) * k);
    for (int64_t p = 0; p < kp; p++) {
        __m512i w[GEMM_VB];
        for (int j = 0; j < NB; j++) w[j] = _mm512_loadu_si512((const void *)(pw[j] + p * 32));
        for (int i = 0; i < NR; i++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)px[i][p]);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, (__m512bh)w[j]);
        }
    }
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < NB; j++) {
            float out[16];
            _mm512_storeu_ps(out, acc[i][j]);
            store_row(y + (r0 + i) * n, out, bias, (b0 + j) * 16, n);
        }
}

/* The AVX512-BF16 path: passes of GEMM_VR rows x GEMM_VB column blocks, the edges in smaller ones. */
static void gemm_bf16_avx512(const uint16_t *x, int64_t rows, const uint16_t *packed, const float *bias, uint16_t *y,
                             int64_t n, int64_t k, int threads) {
    const int64_t blocks = (n + 15) / 16, groups = (blocks + GEMM_VB - 1) / GEMM_VB;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t b0 = g * GEMM_VB;
        const int nb = blocks - b0 < GEMM_VB ? (int)(blocks - b0) : GEMM_VB;
        int64_t r0 = 0;
        if (nb == GEMM_VB)
            for (; r0 + GEMM_VR <= rows; r0 += GEMM_VR) gemm_avx512_pass(x, r0, GEMM_VR, packed, b0, GEMM_VB, bias, y, n, k);
        for (; r0 < rows; r0++) /* the last rows one at a time; the last column blocks one at a time too */
            if (nb == GEMM_VB)
                gemm_avx512_pass(x, r0, 1, packed, b0, GEMM_VB, bias, y, n, k);
            else
                for (int j = 0; j < nb; j++) gemm_avx512_pass(x, r0, 1, packed, b0 + j, 1, bias, y, n, k);
    }
}
#define GEMM_AVX512_BUILT 1
#else
#define GEMM_AVX512_BUILT 0
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <sys/syscall.h>
#include <unistd.h>
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } gemm_tilecfg;

/* The AMX path: the rows in tiles of 16 (a last partial tile from a zero-padded copy), two column
 * blocks a pass; C tile (i, j) sums A tile i times B tile j over the inputs 32 at a time, in order.
 * tdpbf16ps computes each element from its own row and column only: the other rows of a tile
 * change nothing. k % 32 == 0 (the caller checks). */
static void gemm_bf16_amx(const uint16_t *x, int64_t rows, const uint16_t *packed, const float *bias, uint16_t *y,
                          int64_t n, int64_t k, int threads) {
    const int64_t blocks = (n + 15) / 16, kp = k / 2, kb = k / 32, mt = (rows + 15) / 16;
    const int64_t pairs = (blocks + 1) / 2;
    uint16_t *xp = NULL; /* the rows padded to whole tiles where the last one is partial */
    if (rows % 16) {
        xp = aligned_alloc(64, (size_t)((mt * 16 * k * 2 + 63) / 64 * 64));
        if (!xp) { gemm_bf16_avx512(x, rows, packed, bias, y, n, k, threads); return; }
        memcpy(xp, x, (size_t)(rows * k * 2));
        memset(xp + rows * k, 0, (size_t)((mt * 16 - rows) * k * 2));
    }
    const uint16_t *xa = xp ? xp : x;
#pragma omp parallel num_threads(threads)
    {
        gemm_tilecfg c;
        memset(&c, 0, sizeof c);
        c.palette = 1;
        for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
        _tile_loadconfig(&c);
        float cbuf[16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t q = 0; q < pairs; q++) {
            const int64_t b0 = 2 * q;
            const int two = b0 + 1 < blocks;
            const uint16_t *p0 = packed + b0 * kp * 32, *p1 = packed + (b0 + two) * kp * 32;
            for (int64_t m = 0; m < mt; m += 2) {
                const int rm = m + 1 < mt; /* a second row tile */
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t i = 0; i < kb; i++) {
                    _tile_loadd(6, p0 + i * 16 * 32, 64);
                    _tile_loadd(7, p1 + i * 16 * 32, 64);
                    _tile_loadd(4, xa + m * 16 * k + i * 32, k * 2);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (rm) {
                        _tile_loadd(5, xa + (m + 1) * 16 * k + i * 32, k * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                for (int t = 0; t < (rm ? 4 : 2); t++) {
                    if (t == 1 || t == 3) {
                        if (!two) continue;
                    }
                    switch (t) {
                    case 0: _tile_stored(0, cbuf, 64); break;
                    case 1: _tile_stored(1, cbuf, 64); break;
                    case 2: _tile_stored(2, cbuf, 64); break;
                    default: _tile_stored(3, cbuf, 64); break;
                    }
                    const int64_t r0 = (m + t / 2) * 16, col = (b0 + t % 2) * 16;
                    for (int64_t r = 0; r < 16 && r0 + r < rows; r++) store_row(y + (r0 + r) * n, cbuf + r * 16, bias, col, n);
                }
            }
        }
        _tile_release();
    }
    free(xp);
}
static int gemm_amx_granted = -1;
#define GEMM_AMX_BUILT 1
#else
#define GEMM_AMX_BUILT 0
#endif

/* Which path gemm_bf16 takes on this machine: 2 AMX, 1 AVX512-BF16, 0 plain C. ``want`` < 0 asks;
 * otherwise the most it may use (tests compare the paths; an engine never changes it after load). */
static int gemm_path = -1;
int gemm_bf16_path(int want) {
    int best = 0;
#if GEMM_AVX512_BUILT
    best = 1;
#endif
#if GEMM_AMX_BUILT
    if (gemm_amx_granted < 0) gemm_amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    if (gemm_amx_granted) best = 2;
#endif
    if (gemm_path < 0) gemm_path = best;
    if (want >= 0) gemm_path = want < best ? want : best;
    return gemm_path;
}

/* y bf16 [rows, n] = x bf16 [rows, k] @ w.T (+ bias float32 [n]), w packed by gemm_pack_bf16 */
void gemm_bf16(const uint16_t *x, int64_t rows, const uint16_t *packed, const float *bias, uint16_t *y, int64_t n,
               int64_t k, int threads) {
    const int path = gemm_bf16_path(-1);
#if GEMM_AMX_BUILT
    if (path == 2 && k % 32 == 0) { gemm_bf16_amx(x, rows, packed, bias, y, n, k, threads); return; }
#endif
#if GEMM_AVX512_BUILT
    if (path >= 1) { gemm_bf16_avx512(x, rows, packed, bias, y, n, k, threads); return; }
#endif
    (void)path;
    gemm_bf16_plain(x, rows, packed, bias, y, n, k, threads);
}

/* y float32 [rows, n] = x float32 [rows, k] @ w.T (+ bias), w packed by gemm_pack_f32: per (row,
 * column) one fused multiply-add an input, in order (vectorised over 16 columns only). */
void gemm_f32(const float *x, int64_t rows, const float *packed, const float *bias, float *y, int64_t n, int64_t k,
              int threads) {
    const int64_t blocks = (n + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const float *pb = packed + b * k * 16;
        for (int64_t r = 0; r < rows; r++) {
            float acc[16] = {0};
            const float *xr = x + r * k;
            for (int64_t i = 0; i < k; i++) {
                const float a = xr[i];
                const float *w = pb + i * 16;
                for (int j = 0; j < 16; j++) acc[j] = __builtin_fmaf(a, w[j], acc[j]);
            }
            for (int64_t j = 0; j < 16 && b * 16 + j < n; j++) y[r * n + b * 16 + j] = bias ? acc[j] + bias[b * 16 + j] : acc[j];
        }
    }
}
