/* float32 GEMM for a few rows against a prepacked weight: out[M][N] = x[M][K] . W[N][K]^T (+ bias),
   the shape of every decode-time linear layer (M = 1 for an AR step, M = B for a verify block).

   Why our own: at M = 2..17 the BLAS behind torch (MKL sgemm) and oneDNN run far below both the
   memory and the FMA limit (SmolLM2's 1536x576 at M=9: MKL 250-350 us, this kernel 90-120 us, one
   thread, AVX-512; bench/bench_gemm.py), and neither promises that row i of an M-row product equals
   the one-row product bitwise. Here each output is one FMA chain over k = 0..K-1 in order, lane-wise
   in a vector register, whatever M is and however many threads run: batch invariance by
   construction, which keeps greedy DFlash token-identical to greedy AR in float32.

   Layout: W is packed once into panels of PW output columns, panel p = W[p*PW:(p+1)*PW, :]^T stored
   [K][PW] (zero-padded past N), so one k step reads PW contiguous weights that every row in the group
   of MB rows reuses from registers (broadcast x[m][k], FMA into the row's accumulators). The weight
   streams from memory once per group of MB rows: M <= MB reads it once. */
#include "dflash_kernels.h"

#if !defined(DFLASH_PORTABLE) && defined(__AVX512F__)
#include <immintrin.h>
#define VL 16
#define MB 12          /* 12 rows x 2 vectors = 24 accumulators of 32 zmm registers */
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VBCAST(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define GEMM_PATH "avx512"
#define PREFETCH(p, hint) _mm_prefetch((const char *)(p), hint)
#elif !defined(DFLASH_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VL 8
#define MB 6           /* 6 rows x 2 vectors = 12 accumulators of 16 ymm registers */
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VBCAST(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define GEMM_PATH "avx2"
#define PREFETCH(p, hint) _mm_prefetch((const char *)(p), hint)
#else
/* Portable: one "vector" is one float; a*b+c is not contracted (-ffp-contract=off), so this path is
   deterministic too, just slow. */
#define VL 8
#define MB 4
typedef float vec;
#define VZERO() 0.0f
#define VLOAD(p) (*(p))
#define VSTORE(p, v) (*(p) = (v))
#define VBCAST(x) (x)
#define VFMA(a, b, c) ((a) * (b) + (c))
#define GEMM_PATH "portable"
#define PREFETCH(p, hint) ((void)(p))
#define SCALAR_VEC 1
#endif

#define NV 2                 /* vectors per panel */
/* Software prefetch, into L1 4 KiB ahead and into L2 32 KiB ahead (the panels a thread reads are contiguous,
   so past a panel's end is the next one's start): with the hardware prefetcher alone the embedded target's
   linears took 34 ms for an 8-row verify and 22 ms for one row; 28 / 21 ms with the L1 prefetch, 23.4 / 21.3
   ms with both (2-core Sapphire Rapids, float32, 2 threads; 16..512 steps tried, these the best). */
#define PF_L1_STEPS 32
#define PF_L2_STEPS 256
#define PW (VL * NV)         /* panel width: output columns per panel */

/* Python reads these from the library (ctypes), so the layout it allocates is the one compiled here. */
const int32_t dflash_gemm_panel_width = PW;
const int32_t dflash_gemm_row_block = MB;
const char dflash_gemm_path[] = GEMM_PATH;

/* Panels for N outputs: ceil(N / PW); the packed weight holds panels * K * PW floats. */
static inline int64_t panels_of(int64_t N) { return (N + PW - 1) / PW; }

void gemm_pack_f32(const float *w, float *packed, int64_t N, int64_t K, int threads) {
    const int64_t panels = panels_of(N);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * K * PW;
        for (int64_t j = 0; j < PW; j++) {
            const int64_t n = p * PW + j;
            if (n < N) for (int64_t k = 0; k < K; k++) dst[k * PW + j] = w[n * K + k];
            else for (int64_t k = 0; k < K; k++) dst[k * PW + j] = 0.0f;
        }
    }
}

/* mb rows (1..MB) against one panel; the row loop has a compile-time trip count at each call site
   below, so the accumulators stay in registers. Every output's chain is the same for any mb. */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t K, const float *panel,
        const float *bias, float *out, int64_t ldo, int64_t ncols, int mb) {
#ifdef SCALAR_VEC
    /* one output at a time: the same k order as the vector paths, just one lane wide */
    for (int i = 0; i < mb; i++)
        for (int64_t j = 0; j < ncols; j++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc = x[i * K + k] * panel[k * PW + j] + acc;
            out[i * ldo + j] = acc + (bias ? bias[j] : 0.0f);
        }
#else
    vec acc[MB][NV];
    for (int i = 0; i < mb; i++) for (int v = 0; v < NV; v++) acc[i][v] = VZERO();
    for (int64_t k = 0; k < K; k++) {
        const vec w0 = VLOAD(panel + k * PW), w1 = VLOAD(panel + k * PW + VL);
        PREFETCH(panel + (k + PF_L1_STEPS) * PW, _MM_HINT_T0);
        PREFETCH(panel + (k + PF_L1_STEPS) * PW + VL, _MM_HINT_T0);
        PREFETCH(panel + (k + PF_L2_STEPS) * PW, _MM_HINT_T1);
        PREFETCH(panel + (k + PF_L2_STEPS) * PW + VL, _MM_HINT_T1);
        for (int i = 0; i < mb; i++) {
            const vec xb = VBCAST(x[i * K + k]);
            acc[i][0] = VFMA(xb, w0, acc[i][0]);
            acc[i][1] = VFMA(xb, w1, acc[i][1]);
        }
    }
    float r[PW];
    for (int i = 0; i < mb; i++) {
        VSTORE(r, acc[i][0]);
        VSTORE(r + VL, acc[i][1]);
        for (int64_t j = 0; j < ncols; j++) out[i * ldo + j] = r[j] + (bias ? bias[j] : 0.0f);
    }
#endif
}

void gemm_f32(const float *x, const float *packed, const float *bias, float *out,
              int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t panels = panels_of(N);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * PW, ncols = N - n0 < PW ? N - n0 : PW;
        const float *panel = packed + p * K * PW, *b = bias ? bias + n0 : 0;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const float *xs = x + m0 * K;
            float *os = out + m0 * N + n0;
            switch (M - m0 < MB ? (int)(M - m0) : MB) {
#define ROWS(n) case n: panel_rows(xs, K, panel, b, os, N, ncols, n); break;
                ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#if MB > 4
                ROWS(5) ROWS(6)
#endif
#if MB > 6
                ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12)
#endif
#undef ROWS
            }
        }
    }
}
