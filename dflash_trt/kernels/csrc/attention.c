/* float32 decode attention for the CPU runtime: T query rows against a static KV cache, causal (with an
   optional sliding window and gpt-oss's per-head sink logit), GQA without copying K/V per head.

   Why our own: torch's float32 kernels are not row-invariant (SDPA, and MKL's bmm once a call has more
   than one row), so a T-token verify pass would differ from T one-token AR steps in the last bits and
   greedy DFlash could leave greedy AR at a near-tie; one torch call per query row is invariant but pays
   ~10 op dispatches per row and layer (most of a 9-token verify pass of SmolLM2). Here each row is one
   loop over exactly its own keys (0..p, or its window), in the same order whatever T is: scores
   q.k_j * scale, a max-subtracted softmax and sum_j p_j v_j. Heads run in parallel; rows never split. */
#include <math.h>
#include <stdlib.h>

#include "dflash_kernels.h"

/* q [nh][T][hd] (after RoPE); k/v caches [nkv][L][hd] with rows [0, start+T) written; sinks [nh] or
   NULL; out [T][nh][hd] (the layout o_proj reads). window 0: full causal. Returns nothing; a row whose
   scratch cannot be allocated is left as NaN (the caller checks the library loaded, not malloc). */
void attend_f32(const float *q, const float *kc, const float *vc, int64_t L, const float *sinks, float *out,
                int64_t nh, int64_t nkv, int64_t T, int64_t hd, int64_t start, int64_t window, float scale,
                int threads) {
    const int64_t rep = nh / nkv;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t h = 0; h < nh; h++) {
        float *s = malloc(sizeof(float) * (size_t)(start + T));
        const float *k = kc + (h / rep) * L * hd, *v = vc + (h / rep) * L * hd;
        for (int64_t t = 0; t < T; t++) {
            const float *qr = q + (h * T + t) * hd;
            float *o = out + (t * nh + h) * hd;
            const int64_t p = start + t, lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
            if (!s) { for (int64_t d = 0; d < hd; d++) o[d] = NAN; continue; }
            float m = sinks ? sinks[h] : -INFINITY;
            for (int64_t j = lo; j <= p; j++) {
                float dot = 0.0f;
                #pragma omp simd reduction(+:dot)
                for (int64_t d = 0; d < hd; d++) dot += qr[d] * k[j * hd + d];
                s[j] = dot * scale;
                m = s[j] > m ? s[j] : m;
            }
            float sum = sinks ? expf(sinks[h] - m) : 0.0f;
            for (int64_t j = lo; j <= p; j++) { s[j] = expf(s[j] - m); sum += s[j]; }
            const float inv = 1.0f / sum;
            for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
            for (int64_t j = lo; j <= p; j++) {
                const float pj = s[j] * inv;
                #pragma omp simd
                for (int64_t d = 0; d < hd; d++) o[d] += pj * v[j * hd + d];
            }
        }
        free(s);
    }
}

/* attend_f32 for a layer's q, k, v rows as its projections give them, before RoPE (row i of q at q + i*ldq,
   heads and head_dim dense; likewise k, v): rotate-half RoPE on q and k with cos/sin [T][hd], k and v
   written to the caches at rows start..start+T-1, then attend_f32. One call where torch needed some 20 ops
   a layer (slices, neg, cat, products, cache copies). The RoPE is apply_rope's arithmetic, x*cos + rot*sin
   as two rounded products and a rounded sum (-ffp-contract=off), so the results are bitwise torch's. */
static void rope_rows(const float *x, int64_t ld, int64_t T, int64_t heads, int64_t hd, const float *cos,
                      const float *sin, float *dst, int64_t head_stride, int64_t row_stride) {
    const int64_t half = hd / 2;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t t = 0; t < T; t++) {
            const float *r = x + t * ld + h * hd, *c = cos + t * hd, *s = sin + t * hd;
            float *o = dst + h * head_stride + t * row_stride;
            for (int64_t d = 0; d < half; d++) o[d] = r[d] * c[d] + (-r[d + half]) * s[d];
            for (int64_t d = half; d < hd; d++) o[d] = r[d] * c[d] + r[d - half] * s[d];
        }
}

void rope_attend_f32(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv,
                     const float *cos, const float *sin, float *kc, float *vc, int64_t L, const float *sinks,
                     float *out, int64_t nh, int64_t nkv, int64_t T, int64_t hd, int64_t start, int64_t window,
                     float scale, int threads) {
    float *qr = malloc(sizeof(float) * (size_t)(nh * T * hd));
    if (!qr) { for (int64_t i = 0; i < T * nh * hd; i++) out[i] = NAN; return; }
    rope_rows(q, ldq, T, nh, hd, cos, sin, qr, T * hd, hd);
    rope_rows(k, ldk, T, nkv, hd, cos, sin, kc + start * hd, L * hd, hd);
    for (int64_t h = 0; h < nkv; h++)
        for (int64_t t = 0; t < T; t++) memcpy(vc + (h * L + start + t) * hd, v + t * ldv + h * hd, sizeof(float) * hd);
    attend_f32(qr, kc, vc, L, sinks, out, nh, nkv, T, hd, start, window, scale, threads);
    free(qr);
}
