/* Quantised matrix products of steps of a few rows (chatkv.kernels.cpu_decode builds this with gcc
 * beside cpu_decode.c and calls it with ctypes; chatkv.quant decides when). A batch-1 decode step
 * streams every weight once; verifying k speculative proposals is k + 1 rows over the same
 * weights. torch's weight-only kernels decode each weight tile again for every row (2.3-2.8x the
 * one-row time at 6 rows, benchmarks/bench_verify_rows.py); these decode it once for all rows.
 * Every row is computed alone, in an order that does not depend on the step's other rows, so a
 * verified proposal's logits are its plain decode's bit for bit (chatkv.fused_decode), and the
 * threads split the output columns only, so the bits are the same on any thread count.
 * Non-finite activations give non-finite outputs, as torch's kernels do, though not always the
 * same ones: an infinite input times a zero code is NaN here where torch's sum may be inf.
 * (Past ~400 lines on purpose: the AVX-512 and AMX forms of each product, and int4_mm_many, share
 * the decode helpers and must keep the same order of sums: split apart, they could drift.) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_bf16.h"

/* y = x @ w.T for torch's CPU int4 packing in blocks of 64 rows (int4_weight_t's layout) and its
 * bfloat16 (s, z): y[r, j] = bf16(sum_g s[g, j] D[r, g, j] + z[g, j] X[r, g]), where D is row r's
 * dot product with the codes - 8 over group g (32 inputs) and X its sum of x there. Each weight
 * tile is read and decoded once for all the step's rows (torch's kernel decodes it again for each
 * row: 2.3x the time at 6 rows). The products go through AVX512-BF16's dot product (the codes - 8
 * are exact in bfloat16, as x is), one chain of 16 input pairs a group, in the same order for
 * every row whatever the rows of the step: a row's numbers do not depend on the others, so a
 * verified proposal's logits are its plain decode's bit for bit (chatkv.fused_decode). Up to 8
 * rows take one pass over a tile; more decode it again for the rest.
 * x: bf16 [rows, k]; packed: uint8 [n / 64, k, 32]; sz: bf16 [k / 32, n, 2]; y: bf16 [rows, n].
 * The caller (cpu_decode.int4_mm) checks rows <= INT4_MM_ROWS and k / 32 <= INT4_MM_GROUPS. */
#define INT4_MM_ROWS 16
#define INT4_MM_GROUPS 1024
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
int int4_mm_native(void) { return 1; }

/* Shared by int4_mm_tile and int4_mm_amx. The byte permutation for 32 columns of a block: c0 + j
 * (low nibbles of bytes half + j) and c0 + 32 + j (high ones); byte lane 4j of a dword takes byte
 * d = half + j of input k, lane 4j + 2 byte d of input k + 1, the two others zero: (code k, code
 * k + 1) as a pair of words. half is 0 or 16. */
static inline __m512i int4_pair_index(int64_t half) {
    uint8_t ix[64];
    for (int j = 0; j < 16; j++) { ix[4 * j] = (uint8_t)(half + j); ix[4 * j + 1] = 0; ix[4 * j + 2] = (uint8_t)(32 + half + j); ix[4 * j + 3] = 0; }
    return _mm512_loadu_si512((const void *)ix);
}
/* code - 8 in bfloat16 by a word's low 4 bits (bit 4, a neighbour nibble's, ignored) */
static inline __m512i int4_code_table(void) {
    uint16_t tb[32];
    for (int i = 0; i < 32; i++) tb[i] = f2bf((float)((i & 15) - 8));
    return _mm512_loadu_si512((const void *)tb);
}
/* group g's scales and zeros of columns col .. col + 15, as float32 */
static inline __attribute__((always_inline)) void int4_scale_zero(const uint16_t *sz, int64_t g, int64_t n, int64_t col,
                                                                  __m512 *s, __m512 *z) {
    const __m512i v = _mm512_loadu_si512((const void *)(sz + (g * n + col) * 2));
    *s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *z = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int32_t)0xFFFF0000u)));
}

#define INT4_MM_RB 8 /* rows a pass over a tile: 2 x 8 accumulators (measured: one pass of 9-12 rows was slower than 8 + the rest) */
static inline __attribute__((always_inline)) void int4_mm_tile(
        const uint16_t *x, const uint8_t *p, const uint16_t *sz, const float *xs, uint16_t *y,
        int64_t n, int64_t k, int64_t c0, int R) {
    /* the tile's 32 columns: c0 + j and c0 + 32 + j (int4_pair_index) */
    const int64_t half = (c0 % 64) / 16 * 16; /* 0 or 16 */
    const __m512i idx = int4_pair_index(half), table = int4_code_table();
    const int64_t groups = k / 32, base = c0 - half; /* the block's first column */
    __m512 ylo[INT4_MM_RB], yhi[INT4_MM_RB]; /* in memory between groups: the registers hold the group's sums */
    for (int r = 0; r < R; r++) { ylo[r] = _mm512_setzero_ps(); yhi[r] = _mm512_setzero_ps(); }
    for (int64_t g = 0; g < groups; g++) {
        __m512 al[INT4_MM_RB], ah[INT4_MM_RB]; /* the group's sums: one chain of 16 input pairs each */
        for (int r = 0; r < R; r++) { al[r] = ah[r] = _mm512_setzero_ps(); }
        const uint8_t *pg = p + g * 32 * 32;
        const uint16_t *xg0 = x + g * 32;
        for (int i = 0; i < 16; i++) {
            const __m512i pr = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, idx, _mm512_loadu_si512((const void *)(pg + i * 64)));
            const __m512bh wl = (__m512bh)_mm512_permutexvar_epi16(pr, table);
            const __m512bh wh = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(pr, 4), table);
            for (int r = 0; r < R; r++) { /* x's pair broadcast from memory inside the instruction */
                const int32_t *xp = (const int32_t *)(xg0 + r * k + 2 * i);
                __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(al[r]) : "v"(wl), "m"(*xp));
                __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(ah[r]) : "v"(wh), "m"(*xp));
            }
        }
        __m512 sl, zl, sh, zh;
        int4_scale_zero(sz, g, n, base + half, &sl, &zl);
        int4_scale_zero(sz, g, n, base + 32 + half, &sh, &zh);
        for (int r = 0; r < R; r++) {
            const __m512 xg = _mm512_set1_ps(xs[r * groups + g]);
            ylo[r] = _mm512_fmadd_ps(zl, xg, _mm512_fmadd_ps(sl, al[r], ylo[r]));
            yhi[r] = _mm512_fmadd_ps(zh, xg, _mm512_fmadd_ps(sh, ah[r], yhi[r]));
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_si256((__m256i *)(y + r * n + base + half), to_bf16x16(ylo[r]));
        _mm256_storeu_si256((__m256i *)(y + r * n + base + 32 + half), to_bf16x16(yhi[r]));
    }
}

/* AMX (Intel Sapphire Rapids and later): the same two products with tile dot products. A
 * vdpbf16ps multiplies 32 input pairs of one row; a tdpbf16ps 16 rows x 16 columns x 32 inputs at
 * about the cost of 16 of them, so each extra row of a step is nearly free where the AVX-512
 * kernels above pay the whole dot product again (0.12-0.27 of a one-row step per extra row on the
 * default model against 0.05-0.06 here, benchmarks/bench_verify_rows.py). A C element is row m
 * of A times column n of B: a row's result does not depend on the step's other rows. The tiles'
 * sums are not vdpbf16ps's bit for bit (measured: 4% of the default model's group sums differ in
 * the last bit, in either direction from the exact sum), so when the process has AMX (asked of
 * the kernel once, amx_enable) every step takes them, one row included: a verified proposal's
 * logits are its plain decode's bit for bit. A one-row step costs the same either way in a real
 * decode step, whose weights come from memory (11.7 ms against 11.9 on AVX-512; alone with its
 * weights in cache a one-row product takes 1.3x AVX-512's time). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_BUILT 1
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } amx_config;
static int amx_on = 0;

static void amx_configure(const int *rows, const int *colsb, int tiles) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < tiles; t++) { c.rows[t] = (uint8_t)rows[t]; c.colsb[t] = (uint16_t)colsb[t]; }
    _tile_loadconfig(&c);
}

/* int4_mm with tiles. A work item is int4_mm's 32 columns (c0 + j and c0 + 32 + j, j < 16). Per
 * group of 32 inputs: A = the rows' 32 inputs (tile 4, read from x), B = the 32 x 16 codes - 8 of
 * each 16 columns as input pairs (tiles 5, 6), decoded as int4_mm_tile decodes them; tiles 0 and
 * 1 = the group's dot products D, stored and then scaled as int4_mm_tile scales al and ah (the
 * helpers above int4_mm_tile: the same decode and scales). */
static void int4_mm_amx(const uint16_t *x, const uint8_t *packed, const uint16_t *sz, const float *xs, uint16_t *y,
                        int64_t rows, int64_t n, int64_t k, int threads) {
    const int64_t groups = k / 32, tiles = n / 32;
#pragma omp parallel num_threads(threads)
    {
        const int tr[7] = {(int)rows, (int)rows, 0, 0, (int)rows, 16, 16}, tc[7] = {64, 64, 0, 0, 64, 64, 64};
        amx_configure(tr, tc, 7);
        const __m512i ix[2] = {int4_pair_index(0), int4_pair_index(16)}, table = int4_code_table();
        uint16_t bbuf[2][2][16 * 32] __attribute__((aligned(64))); /* [group parity][tile][pair row, column pair] */
        float cbuf[2][16 * 16] __attribute__((aligned(64)));
        float acc[16][32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t b = t / 2, half = (t % 2) * 16, base = b * 64;
            const uint8_t *p = packed + b * k * 32;
            const __m512i idx = ix[t % 2];
            for (int64_t r = 0; r < rows; r++) { _mm512_store_ps(acc[r], _mm512_setzero_ps()); _mm512_store_ps(acc[r] + 16, _mm512_setzero_ps()); }
            for (int64_t g = 0; g < groups; g++) {
                uint16_t *b0 = bbuf[g & 1][0], *b1 = bbuf[g & 1][1];
                const uint8_t *pg = p + g * 32 * 32;
                for (int i = 0; i < 16; i++) {
                    const __m512i pr = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, idx, _mm512_loadu_si512((const void *)(pg + i * 64)));
                    _mm512_store_si512((void *)(b0 + i * 32), _mm512_permutexvar_epi16(pr, table));
                    _mm512_store_si512((void *)(b1 + i * 32), _mm512_permutexvar_epi16(_mm512_srli_epi16(pr, 4), table));
                }
                _tile_zero(0);
                _tile_zero(1);
                _tile_loadd(4, x + g * 32, k * 2);
                _tile_loadd(5, b0, 64);
                _tile_loadd(6, b1, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_dpbf16ps(1, 4, 6);
                _tile_stored(0, cbuf[0], 64);
                _tile_stored(1, cbuf[1], 64);
                __m512 sl, zl, sh, zh;
                int4_scale_zero(sz, g, n, base + half, &sl, &zl);
                int4_scale_zero(sz, g, n, base + 32 + half, &sh, &zh);
                for (int64_t r = 0; r < rows; r++) {
                    const __m512 xg = _mm512_set1_ps(xs[r * groups + g]);
                    _mm512_store_ps(acc[r], _mm512_fmadd_ps(zl, xg, _mm512_fmadd_ps(sl, _mm512_load_ps(cbuf[0] + r * 16), _mm512_load_ps(acc[r]))));
                    _mm512_store_ps(acc[r] + 16, _mm512_fmadd_ps(zh, xg, _mm512_fmadd_ps(sh, _mm512_load_ps(cbuf[1] + r * 16), _mm512_load_ps(acc[r] + 16))));
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                _mm256_storeu_si256((__m256i *)(y + r * n + base + half), to_bf16x16(_mm512_load_ps(acc[r])));
                _mm256_storeu_si256((__m256i *)(y + r * n + base + 32 + half), to_bf16x16(_mm512_load_ps(acc[r] + 16)));
            }
        }
        _tile_release();
    }
}

/* int8_mm with tiles, transposed: A = 16 output channels' codes as bfloat16 (tile 3), B = the
 * rows' inputs as pairs, column r = row r (tile 7, laid out once a call), C = channels x rows
 * (tile 2), summed over all inputs in the tile and scaled at the end. */
static void int8_mm_amx(const uint16_t *x, const int8_t *codes, const uint16_t *scale, uint16_t *y, int64_t rows,
                        int64_t n, int64_t k, int threads) {
    /* B for every 32 inputs, [pair][row]: k / 2 x rows, laid out once; on the stack up to 16 KiB
     * (the default model's 576 inputs at 16 rows take 18 KiB: the heap). Where the heap has none
     * left, each thread lays out each step's 16 pairs itself: slower, the same numbers. */
    uint32_t small[4096] __attribute__((aligned(64)));
    const size_t need = (size_t)(k / 2 * rows);
    uint32_t *xt = amx_on == 2 ? NULL : need <= 4096 ? small : aligned_alloc(64, (need * 4 + 63) / 64 * 64);
    if (xt)
        for (int64_t i = 0; i < k / 2; i++)
            for (int64_t r = 0; r < rows; r++) memcpy(&xt[i * rows + r], x + r * k + 2 * i, 4);
    const int64_t blocks = n / 16;
#pragma omp parallel num_threads(threads)
    {
        const int tr[8] = {0, 0, 16, 16, 0, 0, 0, 16}, tc[8] = {0, 0, (int)rows * 4, 64, 0, 0, 0, (int)rows * 4};
        amx_configure(tr, tc, 8);
        uint16_t abuf[2][16 * 32] __attribute__((aligned(64)));
        uint32_t xb[16 * 16] __attribute__((aligned(64)));
        float cbuf[16 * 16] __attribute__((aligned(64)));
        const __m512i gather = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
#pragma omp for schedule(static)
        for (int64_t bl = 0; bl < blocks; bl++) {
            const int8_t *cb = codes + bl * 16 * k;
            _tile_zero(2);
            for (int64_t i = 0; i < k; i += 32) {
                uint16_t *a = abuf[(i / 32) & 1];
                for (int c = 0; c < 16; c++) {
                    const int8_t *pc = cb + c * k + i;
                    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)pc)));
                    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(pc + 16))));
                    _mm512_store_si512((void *)(a + c * 32), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
                }
                _tile_loadd(3, a, 64);
                const uint32_t *bt = xt ? xt + (i / 2) * rows : xb;
                if (!xt)
                    for (int64_t q = 0; q < 16; q++)
                        for (int64_t r = 0; r < rows; r++) memcpy(&xb[q * rows + r], x + r * k + i + 2 * q, 4);
                _tile_loadd(7, bt, rows * 4);
                _tile_dpbf16ps(2, 3, 7);
            }
            _tile_stored(2, cbuf, 64);
            const __m512 s = bf16x16(scale + bl * 16);
            for (int64_t r = 0; r < rows; r++) {
                const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(gather, _mm512_set1_epi32((int)r)), cbuf, 4);
                _mm256_storeu_si256((__m256i *)(y + r * n + bl * 16), to_bf16x16(_mm512_mul_ps(v, s)));
            }
        }
        _tile_release();
    }
    if (xt != small) free(xt);
}

/* int4_mm_amx for any number of rows: the same numbers as int4_mm over INT4_MM_ROWS rows at a time
 * (each row's group dot products, scales and sums in the same order), with each group's B tiles
 * decoded once per column tile for all the rows instead of once per 16 (a deterministic engine's
 * prefill: chatkv.model.forward.row_chunks). The rows go through A in tiles of 16, the last one
 * from a zero-padded copy (a tile's rows are independent: the padding changes no valid row).
 * xs: each row's sum over each group, as int4_mm computes it. Returns 0, or -1 without memory. */
static int int4_mm_amx_many(const uint16_t *x, const uint8_t *packed, const uint16_t *sz, const float *xs, uint16_t *y,
                            int64_t rows, int64_t n, int64_t k, int threads) {
    const int64_t groups = k / 32, tiles = n / 32, mt = (rows + 15) / 16;
    uint16_t *xp = NULL;
    if (rows % 16) {
        xp = aligned_alloc(64, (size_t)((mt * 16 * k * 2 + 63) / 64 * 64));
        if (!xp) return -1;
        memcpy(xp, x, (size_t)(rows * k * 2));
        memset(xp + rows * k, 0, (size_t)((mt * 16 - rows) * k * 2));
    }
    const uint16_t *xa = xp ? xp : x;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const int tr[7] = {16, 16, 0, 0, 16, 16, 16}, tc[7] = {64, 64, 0, 0, 64, 64, 64};
        amx_configure(tr, tc, 7);
        const __m512i ix[2] = {int4_pair_index(0), int4_pair_index(16)}, table = int4_code_table();
        uint16_t bbuf[2][16 * 32] __attribute__((aligned(64)));
        float cbuf[2][16 * 16] __attribute__((aligned(64)));
        float *acc = aligned_alloc(64, (size_t)(rows * 32 * 4 + 64));
        if (!acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (!acc) continue;
            const int64_t b = t / 2, half = (t % 2) * 16, base = b * 64;
            const uint8_t *p = packed + b * k * 32;
            const __m512i idx = ix[t % 2];
            memset(acc, 0, (size_t)(rows * 32 * 4));
            for (int64_t g = 0; g < groups; g++) {
                uint16_t *b0 = bbuf[0], *b1 = bbuf[1];
                const uint8_t *pg = p + g * 32 * 32;
                for (int i = 0; i < 16; i++) {
                    const __m512i pr = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, idx, _mm512_loadu_si512((const void *)(pg + i * 64)));
                    _mm512_store_si512((void *)(b0 + i * 32), _mm512_permutexvar_epi16(pr, table));
                    _mm512_store_si512((void *)(b1 + i * 32), _mm512_permutexvar_epi16(_mm512_srli_epi16(pr, 4), table));
                }
                _tile_loadd(5, b0, 64);
                _tile_loadd(6, b1, 64);
                __m512 sl, zl, sh, zh;
                int4_scale_zero(sz, g, n, base + half, &sl, &zl);
                int4_scale_zero(sz, g, n, base + 32 + half, &sh, &zh);
                for (int64_t m = 0; m < mt; m++) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_loadd(4, xa + m * 16 * k + g * 32, k * 2);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_stored(0, cbuf[0], 64);
                    _tile_stored(1, cbuf[1], 64);
                    for (int64_t r = 0; r < 16 && m * 16 + r < rows; r++) {
                        float *ar = acc + (m * 16 + r) * 32;
                        const __m512 xg = _mm512_set1_ps(xs[(m * 16 + r) * groups + g]);
                        _mm512_store_ps(ar, _mm512_fmadd_ps(zl, xg, _mm512_fmadd_ps(sl, _mm512_load_ps(cbuf[0] + r * 16), _mm512_load_ps(ar))));
                        _mm512_store_ps(ar + 16, _mm512_fmadd_ps(zh, xg, _mm512_fmadd_ps(sh, _mm512_load_ps(cbuf[1] + r * 16), _mm512_load_ps(ar + 16))));
                    }
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                _mm256_storeu_si256((__m256i *)(y + r * n + base + half), to_bf16x16(_mm512_load_ps(acc + r * 32)));
                _mm256_storeu_si256((__m256i *)(y + r * n + base + 32 + half), to_bf16x16(_mm512_load_ps(acc + r * 32 + 16)));
            }
        }
        free(acc);
        _tile_release();
    }
    free(xp);
    return failed ? -1 : 0;
}

/* Ask Linux for the AMX tile state once (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA; torch's
 * oneDNN asks the same); on = 1 turns the tile kernels on where granted, 0 off (benchmarks
 * compare), -1 asks; 2 is on with int8_mm's path for a heap with no room left (tests). Whether
 * they run (2 for that path). */
int amx_enable(int on) {
    static int granted = -1;
    if (on < 0) return amx_on;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    amx_on = granted ? on : 0;
    return amx_on;
}
#else
#define AMX_BUILT 0
int amx_enable(int on) { (void)on; return 0; }
#endif

void int4_mm(const uint16_t *x, const uint8_t *packed, const uint16_t *sz, uint16_t *y, int64_t rows, int64_t n,
             int64_t k, int threads) {
    const int64_t groups = k / 32;
    float xs[INT4_MM_ROWS * INT4_MM_GROUPS]; /* each row's sum over each group, fp32, in a fixed order */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++)
            xs[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(bf16x16(x + r * k + g * 32), bf16x16(x + r * k + g * 32 + 16)));
#if AMX_BUILT
    if (amx_on) { int4_mm_amx(x, packed, sz, xs, y, rows, n, k, threads); return; }
#endif
    const int64_t tiles = n / 32; /* two a block of 64 columns */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t b = t / 2, c0 = b * 64 + (t % 2) * 16;
        const uint8_t *p = packed + b * k * 32;
        for (int64_t r0 = 0; r0 < rows; r0 += INT4_MM_RB) {
            const int64_t left = rows - r0;
            const uint16_t *xr = x + r0 * k;
            const float *xsr = xs + r0 * groups;
            uint16_t *yr = y + r0 * n;
            /* a constant row count for each call, so that the accumulators are registers */
            if (left >= 8) int4_mm_tile(xr, p, sz, xsr, yr, n, k, c0, 8);
            else if (left == 7) int4_mm_tile(xr, p, sz, xsr, yr, n, k, c0, 7);
            else if (left == 6) int4_mm_tile(xr, p, sz, xsr, yr, n, k, c0, 6);
            else if (left == 5) int4_mm_tile(xr, p, sz, xsr, yr, n, k, c0, 5);
            else if (left == 4) int4_mm_tile(xr, p, sz, xsr, yr, n, k, c0, 4);
            else if (left == 3) int4_mm_tile(xr, p, sz, xsr, yr, n, k, c0, 3);
            else if (left == 2) int4_mm_tile(xr, p, sz, xsr, yr, n, k, c0, 2);
            else int4_mm_tile(xr, p, sz, xsr, yr, n, k, c0, 1);
        }
    }
}

/* int4_mm for any number of rows: the same numbers as int4_mm called INT4_MM_ROWS rows at a time,
 * in one pass over the weights where AMX runs (int4_mm_amx_many), else in those calls. */
void int4_mm_many(const uint16_t *x, const uint8_t *packed, const uint16_t *sz, uint16_t *y, int64_t rows, int64_t n,
                  int64_t k, int threads) {
#if AMX_BUILT
    if (amx_on && rows > INT4_MM_ROWS) {
        const int64_t groups = k / 32;
        float *xs = malloc((size_t)(rows * groups * 4));
        if (xs) {
            for (int64_t r = 0; r < rows; r++)
                for (int64_t g = 0; g < groups; g++)
                    xs[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(bf16x16(x + r * k + g * 32), bf16x16(x + r * k + g * 32 + 16)));
            const int done = int4_mm_amx_many(x, packed, sz, xs, y, rows, n, k, threads);
            free(xs);
            if (done == 0) return;
        }
    }
#endif
    for (int64_t r0 = 0; r0 < rows; r0 += INT4_MM_ROWS)
        int4_mm(x + r0 * k, packed, sz, y + r0 * n, rows - r0 < INT4_MM_ROWS ? rows - r0 : INT4_MM_ROWS, n, k, threads);
}
#else
int int4_mm_native(void) { return 0; }
int amx_enable(int on) { (void)on; return 0; }
void int4_mm(const uint16_t *x, const uint8_t *packed, const uint16_t *sz, uint16_t *y, int64_t rows, int64_t n,
             int64_t k, int threads) {
    (void)x; (void)packed; (void)sz; (void)y; (void)rows; (void)n; (void)k; (void)threads;
}
void int4_mm_many(const uint16_t *x, const uint8_t *packed, const uint16_t *sz, uint16_t *y, int64_t rows, int64_t n,
                  int64_t k, int threads) {
    (void)x; (void)packed; (void)sz; (void)y; (void)rows; (void)n; (void)k; (void)threads;
}
#endif

/* y = x @ codes.T * scale for int8 codes per output channel (chatkv.quant.Int8Linear: the output
 * matrix): y[r, j] = bf16(scale[j] * sum_i x[r, i] code[j, i]). 32 codes at a time are converted
 * to bfloat16 (exact: |code| <= 127) and go through AVX512-BF16's dot product with x's pairs, 16
 * float32 lanes a channel added in a fixed order at the end. Each channel's codes are read and
 * converted once for all the step's rows (torch's kernel: 2.5x its one-row time at 6 rows); a row's
 * numbers do not depend on the other rows. x: bf16 [rows, k]; codes: int8 [n, k]; scale: bf16 [n];
 * y: bf16 [rows, n]; k a multiple of 32, n of 2, rows <= INT4_MM_ROWS (cpu_decode.int8_mm_call). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define INT8_MM_RB 12 /* rows a pass: 12 x 2 accumulators in registers */
#define INT8_MM_CB 2 /* output channels a pass */
static inline __attribute__((always_inline)) void int8_mm_cols(
        const uint16_t *x, const int8_t *codes, const uint16_t *scale, uint16_t *y, int64_t n, int64_t k,
        int64_t j0, int R) {
    __m512 a[INT8_MM_RB][INT8_MM_CB];
    for (int r = 0; r < R; r++) for (int c = 0; c < INT8_MM_CB; c++) a[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 32) {
        for (int c = 0; c < INT8_MM_CB; c++) {
            const int8_t *p = codes + (j0 + c) * k + i;
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
            const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo); /* word i: code i */
            for (int r = 0; r < R; r++)
                a[r][c] = _mm512_dpbf16_ps(a[r][c], w, (__m512bh)_mm512_loadu_si512((const void *)(x + r * k + i)));
        }
    }
    for (int c = 0; c < INT8_MM_CB; c++) {
        const float s = bf2f(scale[j0 + c]);
        for (int r = 0; r < R; r++) y[r * n + j0 + c] = f2bf(_mm512_reduce_add_ps(a[r][c]) * s);
    }
}

static void int8_mm_avx512(const uint16_t *x, const int8_t *codes, const uint16_t *scale, uint16_t *y, int64_t rows,
                           int64_t n, int64_t k, int threads) {
    const int64_t items = n / INT8_MM_CB;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < items; t++) {
        for (int64_t r0 = 0; r0 < rows; r0 += INT8_MM_RB) {
            const int64_t left = rows - r0;
            const uint16_t *xr = x + r0 * k;
            uint16_t *yr = y + r0 * n;
            if (left >= 12) int8_mm_cols(xr, codes, scale, yr, n, k, t * INT8_MM_CB, 12);
            else if (left == 11) int8_mm_cols(xr, codes, scale, yr, n, k, t * INT8_MM_CB, 11);
            else if (left == 10) int8_mm_cols(xr, codes, scale, yr, n, k, t * INT8_MM_CB, 10);
            else if (left == 9) int8_mm_cols(xr, codes, scale, yr, n, k, t * INT8_MM_CB, 9);
            else if (left == 8) int8_mm_cols(xr, codes, scale, yr, n, k, t * INT8_MM_CB, 8);
            else if (left == 7) int8_mm_cols(xr, codes, scale, yr, n, k, t * INT8_MM_CB, 7);
            else if (left == 6) int8_mm_cols(xr, codes, scale, yr, n, k, t * INT8_MM_CB, 6);
            else if (left == 5) int8_mm_cols(xr, codes, scale, yr, n, k, t * INT8_MM_CB, 5);
            else if (left == 4) int8_mm_cols(xr, codes, scale, yr, n, k, t * INT8_MM_CB, 4);
            else if (left == 3) int8_mm_cols(xr, codes, scale, yr, n, k, t * INT8_MM_CB, 3);
            else if (left == 2) int8_mm_cols(xr, codes, scale, yr, n, k, t * INT8_MM_CB, 2);
            else int8_mm_cols(xr, codes, scale, yr, n, k, t * INT8_MM_CB, 1);
        }
    }
}
void int8_mm(const uint16_t *x, const int8_t *codes, const uint16_t *scale, uint16_t *y, int64_t rows, int64_t n,
             int64_t k, int threads) {
#if defined(AMX_BUILT) && AMX_BUILT
    if (amx_on && n % 16 == 0) { int8_mm_amx(x, codes, scale, y, rows, n, k, threads); return; }
#endif
    int8_mm_avx512(x, codes, scale, y, rows, n, k, threads);
}
int int8_mm_native(void) { return 1; }
#else
int int8_mm_native(void) { return 0; }
void int8_mm(const uint16_t *x, const int8_t *codes, const uint16_t *scale, uint16_t *y, int64_t rows, int64_t n,
             int64_t k, int threads) {
    (void)x; (void)codes; (void)scale; (void)y; (void)rows; (void)n; (void)k; (void)threads;
}
#endif
