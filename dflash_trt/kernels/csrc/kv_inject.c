/* The CPU epilogue of dflash_trt/runtime/kv_inject.py's fused path (2) as one C loop: hidden_norm's
   1/rms, bias, k_norm, RoPE and the write into the cache rows, per token and kv head, in float32.
   In torch the same epilogue is ~12 ops; at decode sizes each costs more than its arithmetic once
   the GEMMs have evicted the dispatcher's code and data from cache (bench/bench_kv_inject.py), so
   one call instead of twelve is most of the fused path's gain over the reference. */
#include <math.h>

#include "dflash_kernels.h"

/* Python reads the bound from here (ctypes), so it cannot disagree with the array below. */
const int32_t dflash_max_head_dim = DFLASH_MAX_HEAD_DIM;

#define EPILOGUE(NAME, LD, ST)                                                                    \
void kv_epilogue_##NAME(const void *ctx, const void *kv, const void *bias, const void *knw,     \
        const void *cos, const void *sin, const int64_t *pos, const int64_t *slots, int64_t start, \
        int64_t T, int64_t H, int64_t L, int64_t nkv, int64_t hd, float eps,                     \
        void *kc, void *vc, int64_t sP, int64_t sL, int64_t sH, int64_t sT, int64_t shift) {     \
    const int64_t N = L * 2 * nkv * hd, half = hd / 2, mask = ((int64_t)1 << shift) - 1;       \
    float k[DFLASH_MAX_HEAD_DIM];                                                                 \
    for (int64_t t = 0; t < T; t++) {                                                             \
        float ss = 0.0f;                                                                          \
        for (int64_t i = 0; i < H; i++) { float x = LD(ctx, t * H + i); ss += x * x; }            \
        const float rstd = 1.0f / sqrtf(ss / (float)H + eps);                                     \
        const int64_t slot = slots ? slots[t] : start + t;                                        \
        if (slot < 0) continue;                                                                   \
        const int64_t row = (slot >> shift) * sP + (slot & mask) * sT, p = pos[t];               \
        for (int64_t l = 0; l < L; l++) for (int64_t h = 0; h < nkv; h++) {                       \
            const int64_t ko = (l * 2 * nkv + h) * hd, vo = ((l * 2 + 1) * nkv + h) * hd;         \
            const int64_t dst = row + l * sL + h * sH;                                            \
            float kss = 0.0f;                                                                     \
            for (int64_t i = 0; i < hd; i++) {                                                    \
                float x = LD(kv, t * N + ko + i) * rstd + (bias ? LD(bias, ko + i) : 0.0f);        \
                k[i] = x; kss += x * x;                                                           \
            }                                                                                     \
            const float kr = 1.0f / sqrtf(kss / (float)hd + eps);                                 \
            for (int64_t i = 0; i < hd; i++) k[i] = k[i] * kr * LD(knw, l * hd + i);              \
            for (int64_t i = 0; i < hd; i++) {                                                    \
                float rot = i < half ? -k[i + half] : k[i - half];                                \
                ST(kc, dst + i, k[i] * LD(cos, p * hd + i) + rot * LD(sin, p * hd + i));          \
                ST(vc, dst + i, LD(kv, t * N + vo + i) * rstd + (bias ? LD(bias, vo + i) : 0.0f)); \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
}
EPILOGUE(f32, ld_f32, st_f32)
EPILOGUE(bf16, ld_bf16, st_bf16)
