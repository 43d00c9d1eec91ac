/* Shared by the CPU kernels in this folder, which dflash_trt/kernels/c_loader.py compiles with the
   system's C compiler (this folder on the include path). Plain C with GCC/clang extensions, no
   torch headers; no -ffast-math: results stay IEEE so the bytes are what the tests pin. */
#ifndef DFLASH_KERNELS_H
#define DFLASH_KERNELS_H

#include <stdint.h>
#include <string.h>

/* The largest head_dim the KV-injection epilogue handles: it keeps one head's K row on the stack.
   kv_inject.c exports it as `dflash_max_head_dim`, which Python reads from the loaded library, so
   this line is the only place the bound is written. */
#define DFLASH_MAX_HEAD_DIM 512

/* The CPU-specific (AVX-512) loops where the compiler targets them; -DDFLASH_PORTABLE keeps the
   portable loops, so tests can compare the two builds bit for bit. */
#if defined(__AVX512F__) && !defined(DFLASH_PORTABLE)
#define DFLASH_AVX512 1
#endif

static inline float f32_of_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* Element i of a float32 or bfloat16 array, as float32 (one loop per dtype: NAME = f32, bf16). */
static inline float ld_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }
static inline float ld_bf16(const void *p, int64_t i) { return f32_of_bits((uint32_t)((const uint16_t *)p)[i] << 16); }
static inline void st_f32(void *p, int64_t i, float x) { ((float *)p)[i] = x; }
static inline void st_bf16(void *p, int64_t i, float x) {   /* round to nearest even, as torch */
    uint32_t u; memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { ((uint16_t *)p)[i] = (uint16_t)((u >> 16) | 0x40); return; }
    u += 0x7fffu + ((u >> 16) & 1u); ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
}

#endif
