/* Fused CPU kernels for the NVFP4 hot loops of dflash_trt/io/formats.py (its torch code does the
   same without a compiler). In eager torch, encoding one element takes ~15 passes over memory
   (divide, abs, seven comparisons, sign, pack); these loops do it in one pass each. The division
   stays IEEE fp32 so the bytes equal ModelOpt's (tests compare both paths). */
#include "dflash_kernels.h"

/* |x| of an IEEE float ordered as its bits with the sign cleared (integer max vectorizes; a
   float max with NaN semantics does not): amax and "any NaN/Inf" (bits >= exponent all-ones)
   in one pass. */
#define ABS_BITS_f32(p, i) (((const uint32_t *)(p))[i] & 0x7fffffffu)
#define ABS_BITS_bf16(p, i) ((uint32_t)(((const uint16_t *)(p))[i] & 0x7fffu) << 16)
/* One copy of each loop per input dtype, so the compiler can vectorize the inner loops. */
#define ABS_MAX(NAME)                                                                             \
void abs_max_##NAME(const void *in, int64_t n, float *out, int32_t *bad) {                      \
    uint32_t m = 0;                                                                               \
    _Pragma("omp parallel for schedule(static) reduction(max:m)")                                 \
    for (int64_t i = 0; i < n; i++) { uint32_t a = ABS_BITS_##NAME(in, i); m = a > m ? a : m; }  \
    *bad = m >= 0x7f800000u;                                                                      \
    *out = f32_of_bits(m);                                                                        \
}
ABS_MAX(f32)
ABS_MAX(bf16)

/* NVFP4 encode: x / denom (IEEE fp32 division, as ModelOpt), E2M1 code by thresholds, sign, two
   codes per byte (low nibble = even element). With GCC >= 12 or clang, one block of 16 is one
   64-byte vector (the compiler lowers it to AVX-512 / AVX2 / NEON): ~2x the scalar loop. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint8_t v8b __attribute__((vector_size(8)));
typedef uint16_t v16h __attribute__((vector_size(32)));
/* (through a pointer: returning a 64-byte vector by value has an ABI that differs with and
   without AVX-512, which GCC warns about even for static functions) */
static inline void load16_f32(const void *in, int64_t b, v16f *x) { memcpy(x, (const float *)in + b * 16, 64); }
static inline void load16_bf16(const void *in, int64_t b, v16f *x) {
    v16h h; memcpy(&h, (const uint16_t *)in + b * 16, 32);
    v16u u = __builtin_convertvector(h, v16u) << 16; memcpy(x, &u, 64);
}
#define ENCODE1(NAME)                                                                             \
static inline void encode1_##NAME(const void *in, int64_t b, float d, uint8_t *out) {           \
    v16f x; load16_##NAME(in, b, &x); x /= d;                                                     \
    v16u xb; memcpy(&xb, &x, 64); xb &= 0x7fffffffu; v16f a; memcpy(&a, &xb, 64);                \
    v16i c = -((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f)              \
               + (a >= 3.5f) + (a > 5.0f));                                                       \
    c |= (x < 0.0f) & 8;                                                                          \
    v8i ev = __builtin_shufflevector(c, c, 0, 2, 4, 6, 8, 10, 12, 14);                            \
    v8i od = __builtin_shufflevector(c, c, 1, 3, 5, 7, 9, 11, 13, 15);                            \
    v8b p = __builtin_convertvector(ev | (od << 4), v8b);                                         \
    memcpy(out + b * 8, &p, 8);                                                                   \
}
#else
#define ENCODE1(NAME)                                                                             \
static inline void encode1_##NAME(const void *in, int64_t b, float d, uint8_t *out) {           \
    uint8_t c[16];                                                                                \
    for (int i = 0; i < 16; i++) {                                                                \
        float x = ld_##NAME(in, b * 16 + i) / d;                                                  \
        float a = x < 0 ? -x : x;                                                                 \
        c[i] = (uint8_t)((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f)      \
                         + (a >= 3.5f) + (a > 5.0f)) | (uint8_t)((x < 0.0f) << 3);                \
    }                                                                                             \
    uint64_t packed = 0;                                                                          \
    for (int j = 0; j < 8; j++) packed |= (uint64_t)(c[2 * j] | (c[2 * j + 1] << 4)) << (8 * j);  \
    memcpy(out + b * 8, &packed, 8);  /* little-endian: byte j = elements 2j (low), 2j+1 */       \
}
#endif
#define ENCODE(NAME) ENCODE1(NAME)                                                                \
void nvfp4_encode_##NAME(const void *in, int64_t nblocks, const float *denom, uint8_t *out) {    \
    _Pragma("omp parallel for schedule(static)")                                                  \
    for (int64_t b = 0; b < nblocks; b++) encode1_##NAME(in, b, denom[b], out);                  \
}
ENCODE(f32)
ENCODE(bf16)

/* float -> float8_e4m3fn code, round to nearest even, for x in [2^-9, 448] (what the block
   scales are clamped to): normals round the mantissa to 3 bits; below 2^-6, x * 512 is exact and
   its nearest-even integer is the subnormal code (8 carries into the smallest normal, 0x08).
   Pinned bit-for-bit against torch's cast over every fp32 value of the range (tests/test_formats.py). */
static inline uint8_t e4m3_code(float x) {
    uint32_t u; memcpy(&u, &x, 4);
    int e8 = (int)((u >> 23) & 0xff) - 127 + 7;
    if (e8 <= 0) {
        float q = x * 512.0f;                         /* in [1, 8): exact */
        uint32_t qi = (uint32_t)q; float fr = q - (float)qi;
        if (fr > 0.5f || (fr == 0.5f && (qi & 1u))) qi++;
        return (uint8_t)qi;
    }
    uint32_t mant = u & 0x7fffffu, m3 = mant >> 20, rem = mant & 0xfffffu;
    if (rem > 0x80000u || (rem == 0x80000u && (m3 & 1u))) m3++;
    if (m3 == 8) { m3 = 0; e8++; }
    return (uint8_t)((e8 << 3) | m3);
}
static inline float e4m3_value(uint8_t c) {
    int e8 = c >> 3, m3 = c & 7;
    return e8 == 0 ? (float)m3 * (1.0f / 512.0f) : (1.0f + (float)m3 * 0.125f) * f32_of_bits((uint32_t)(e8 - 7 + 127) << 23);
}
/* The whole NVFP4 quantization of nblocks blocks in one pass, the same ops as the torch code
   (nvfp4_block_scales, then nvfp4_quantize): s = amax / (6 * g) (fp32), 0 -> 1, clamp to
   [2^-9, 448], cast to e4m3; denom = float(s8) * g; codes of x / denom. */
#define FUSED1(NAME)                                                                              \
static inline uint32_t block_max1_##NAME(const void *in, int64_t b) {                         \
    uint32_t m = 0;                                                                               \
    for (int i = 0; i < 16; i++) { uint32_t a = ABS_BITS_##NAME(in, b * 16 + i); m = a > m ? a : m; } \
    return m;                                                                                     \
}                                                                                                 \
static inline void fused1_##NAME(const void *in, int64_t b, float g, const uint32_t *bmax,      \
                                 uint8_t *scales, uint8_t *out) {                                 \
    const uint32_t m = bmax ? bmax[b] : block_max1_##NAME(in, b);                                \
    float sv = f32_of_bits(m) / (6.0f * g);                                                       \
    if (sv == 0.0f) sv = 1.0f;                                                                    \
    sv = sv < 0.001953125f ? 0.001953125f : (sv > 448.0f ? 448.0f : sv);                         \
    const uint8_t c = e4m3_code(sv);                                                              \
    scales[b] = c;                                                                                \
    encode1_##NAME(in, b, e4m3_value(c) * g, out);                                                \
}
FUSED1(f32)
FUSED1(bf16)
#ifdef DFLASH_AVX512
/* AVX-512: 16 blocks at a time. The block maxima go into one vector, so the scale arithmetic and
   the e4m3 rounding run on 16 blocks at once (in the portable loop below they are ~40 scalar
   instructions per block). The same bits as the portable loop (a test compares the two builds). */
#include <immintrin.h>
/* e4m3 code of 16 floats in [2^-9, 448], bit-identical to e4m3_code */
static inline __m512i e4m3_code16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i e8 = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 23), _mm512_set1_epi32(0xff)),
                                        _mm512_set1_epi32(120));
    const __m512i mant = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffff));
    const __m512i m3 = _mm512_srli_epi32(mant, 20), rem = _mm512_and_si512(mant, _mm512_set1_epi32(0xfffff));
    const __m512i half = _mm512_set1_epi32(0x80000);
    const __mmask16 up = _mm512_cmpgt_epu32_mask(rem, half) |
        (_mm512_cmpeq_epi32_mask(rem, half) & _mm512_test_epi32_mask(m3, _mm512_set1_epi32(1)));
    /* rounding up carries a mantissa of 7 into the exponent, as the scalar code's m3 == 8 case */
    __m512i normal = _mm512_or_si512(_mm512_slli_epi32(e8, 3), m3);
    normal = _mm512_mask_add_epi32(normal, up, normal, _mm512_set1_epi32(1));
    /* below 2^-6: x * 512 is exact; its nearest-even integer is the code */
    const __m512i sub = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(512.0f)),
                                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(e8, _mm512_setzero_si512()), sub, normal);
}
static inline __m512 e4m3_value16(__m512i c) {
    const __m512i e8 = _mm512_srli_epi32(c, 3), m3 = _mm512_and_si512(c, _mm512_set1_epi32(7));
    const __m512 normal = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_slli_epi32(_mm512_add_epi32(e8, _mm512_set1_epi32(120)), 23), _mm512_slli_epi32(m3, 20)));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(m3), _mm512_set1_ps(1.0f / 512.0f));
    return _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(e8, _mm512_setzero_si512()), sub, normal);
}
/* Two blocks (32 elements) as fp32 vectors of their even and odd elements: lanes 0-7 are block
   b's elements 0, 2, .., 14 (ev) and 1, 3, .., 15 (od), lanes 8-15 block b+1's. This order makes
   the nibble packing one shift and add (byte j = code 2j | code 2j+1 << 4), and for bf16 the
   split is the conversion: the low half of each 32-bit word is the even element. */
static inline void pair_bf16(const void *in, int64_t b, __m512 *ev, __m512 *od) {
    const __m512i r = _mm512_loadu_si512((const uint16_t *)in + b * 16);
    *ev = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
    *od = _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline void pair_f32(const void *in, int64_t b, __m512 *ev, __m512 *od) {
    const __m512 x0 = _mm512_loadu_ps((const float *)in + b * 16), x1 = _mm512_loadu_ps((const float *)in + b * 16 + 16);
    const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    *ev = _mm512_permutex2var_ps(x0, ie, x1);
    *od = _mm512_permutex2var_ps(x0, _mm512_add_epi32(ie, _mm512_set1_epi32(1)), x1);
}
/* E2M1 magnitude code of |q| (round to nearest even, saturating at 6), plus 298. Adding
   2^(22+E), E = max(exponent of |q|, 0), leaves |q| rounded to E2M1's spacing in that binade
   (0.5, 1, 2) as the integer k in the sum's low bits, by the FPU's own round-to-nearest-even;
   the sum's exponent field is E + 149, so code = k + 2E = (bits & 7) + (bits >> 22) - 298.
   Ties go to the even code, as with the portable loop's thresholds (0.25 -> 0, 0.75 -> 1.0). */
static inline __m512i e2m1_code16_298(__m512 q) {
    const __m512 a = _mm512_min_ps(_mm512_abs_ps(q), _mm512_set1_ps(6.0f));
    const __m512i magic = _mm512_add_epi32(
        _mm512_and_si512(_mm512_max_epi32(_mm512_castps_si512(a), _mm512_set1_epi32(0x3f800000)),
                         _mm512_set1_epi32(0x7f800000)), _mm512_set1_epi32(22 << 23));
    const __m512i s = _mm512_castps_si512(_mm512_add_ps(a, _mm512_castsi512_ps(magic)));
    return _mm512_add_epi32(_mm512_and_si512(s, _mm512_set1_epi32(7)), _mm512_srli_epi32(s, 22));
}
/* x / d, rounded as IEEE division, from r = 1/d (correctly rounded): q = x * r is within an ulp
   of x / d, the residual x - q * d is exact in one fma, and q + residual * r rounded once is the
   correctly rounded quotient (Markstein's theorem), barring underflow and overflow. 3 fma-unit
   instructions where vdivps is 3 plus a divider busy for ~10 cycles. `fast` is set for global
   scales g in [2^-80, 64]: then d is in [2^-89, 2^15], every residual near an E2M1 threshold is
   a normal number and no nonzero x / d underflows to zero; outside, the division itself. */
static inline __m512 quot16(__m512 x, __m512 d, __m512 r, int fast) {
    if (!fast) return _mm512_div_ps(x, d);
    const __m512 q = _mm512_mul_ps(x, r);
    return _mm512_fmadd_ps(_mm512_fnmadd_ps(q, d, x), r, q);
}
/* The 16 block maxima of |x| (as fp32 bits) of the tile at block b0. Each pair's lanes hold
   partial maxima of its two blocks (for bf16: the high half of each 32-bit word, the max of its
   two elements, the low half garbage, cleared at the end); a butterfly across the 8 registers
   reduces them: ~2 instructions per block, where a horizontal max per block took ~10. */
static inline __m512i pairmax_bf16(const void *in, int64_t b) {
    const __m512i r = _mm512_and_si512(_mm512_loadu_si512((const uint16_t *)in + b * 16), _mm512_set1_epi32(0x7fff7fff));
    return _mm512_max_epu16(r, _mm512_slli_epi32(r, 16));
}
static inline __m512i pairmax_f32(const void *in, int64_t b) {
    const __m512i nosign = _mm512_set1_epi32(0x7fffffff);
    const __m512i x0 = _mm512_and_si512(_mm512_loadu_si512((const float *)in + b * 16), nosign);
    const __m512i x1 = _mm512_and_si512(_mm512_loadu_si512((const float *)in + b * 16 + 16), nosign);
    return _mm512_max_epu32(_mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(3, 2, 3, 2)));
}
#define LOWMASK_bf16 0xffff0000u
#define LOWMASK_f32 0xffffffffu
#define TILE_MAX(NAME)                                                                            \
static inline __m512i tile_max_##NAME(const void *in, int64_t b0) {                               \
    __m512i m[8], q[4];                                                                           \
    for (int p = 0; p < 8; p++) m[p] = pairmax_##NAME(in, b0 + 2 * p);                            \
    /* q[k]: 128-bit chunk c holds 4 partial maxima of block 4k + c */                            \
    for (int k = 0; k < 4; k++)                                                                   \
        q[k] = _mm512_max_epu32(_mm512_shuffle_i32x4(m[2 * k], m[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)), \
                                _mm512_shuffle_i32x4(m[2 * k], m[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1))); \
    const __m512i r0 = _mm512_max_epu32(_mm512_unpacklo_epi32(q[0], q[1]), _mm512_unpackhi_epi32(q[0], q[1])); \
    const __m512i r1 = _mm512_max_epu32(_mm512_unpacklo_epi32(q[2], q[3]), _mm512_unpackhi_epi32(q[2], q[3])); \
    /* lane 4c + k: block 4k + c; back to block order */                                          \
    const __m512i mx = _mm512_permutexvar_epi32(                                                  \
        _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0),                   \
        _mm512_max_epu32(_mm512_unpacklo_epi64(r0, r1), _mm512_unpackhi_epi64(r0, r1)));          \
    return _mm512_and_si512(mx, _mm512_set1_epi32((int)LOWMASK_##NAME));                          \
}
TILE_MAX(f32)
TILE_MAX(bf16)
/* Per tile of 16 blocks: (1) the block maxima (given, from the amax pass, or tile_max); (2) the
   block scales for all 16 at once; (3) each pair's codes: ~20 instructions per block in all,
   where a block at a time took ~38. */
#define FUSED(NAME)                                                                               \
void nvfp4_quantize_##NAME(const void *in, int64_t nblocks, float g, const uint32_t *bmax,      \
                           uint8_t *scales, uint8_t *out) {                                       \
    const __m512 d6 = _mm512_set1_ps(6.0f * g);                                                   \
    const int64_t ntiles = nblocks / 16;                                                          \
    const int fast = g >= 0x1p-80f && g <= 64.0f;                                                 \
    _Pragma("omp parallel for schedule(static)")                                                  \
    for (int64_t t = 0; t < ntiles; t++) {                                                        \
        const int64_t b0 = t * 16;                                                                \
        const __m512i mx = bmax ? _mm512_loadu_si512(bmax + b0) : tile_max_##NAME(in, b0);        \
        __m512 sv = _mm512_div_ps(_mm512_castsi512_ps(mx), d6);                                   \
        sv = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(sv, _mm512_setzero_ps(), _CMP_EQ_OQ), sv, _mm512_set1_ps(1.0f)); \
        sv = _mm512_min_ps(_mm512_max_ps(sv, _mm512_set1_ps(0.001953125f)), _mm512_set1_ps(448.0f)); \
        const __m512i c = e4m3_code16(sv);                                                        \
        const __m512 den = _mm512_mul_ps(e4m3_value16(c), _mm512_set1_ps(g));                     \
        const __m512 rcp = _mm512_div_ps(_mm512_set1_ps(1.0f), den);                              \
        _mm_storeu_si128((__m128i *)(scales + b0), _mm512_cvtepi32_epi8(c));                      \
        __m512i sel = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);           \
        for (int p = 0; p < 8; p++, sel = _mm512_add_epi32(sel, _mm512_set1_epi32(2))) {          \
            __m512 ev, od;                                                                        \
            pair_##NAME(in, b0 + 2 * p, &ev, &od);                                                \
            const __m512 d = _mm512_permutexvar_ps(sel, den);                                     \
            const __m512 qe = quot16(ev, d, _mm512_permutexvar_ps(sel, rcp), fast),                \
                         qo = quot16(od, d, _mm512_permutexvar_ps(sel, rcp), fast);                \
            __m512i v = _mm512_add_epi32(e2m1_code16_298(qe), _mm512_slli_epi32(e2m1_code16_298(qo), 4)); \
            v = _mm512_sub_epi32(v, _mm512_set1_epi32(298 * 17));                                 \
            v = _mm512_mask_or_epi32(v, _mm512_cmp_ps_mask(qe, _mm512_setzero_ps(), _CMP_LT_OQ), v, _mm512_set1_epi32(0x08)); \
            v = _mm512_mask_or_epi32(v, _mm512_cmp_ps_mask(qo, _mm512_setzero_ps(), _CMP_LT_OQ), v, _mm512_set1_epi32(0x80)); \
            _mm_storeu_si128((__m128i *)(out + (b0 + 2 * p) * 8), _mm512_cvtepi32_epi8(v));       \
        }                                                                                         \
    }                                                                                             \
    for (int64_t b = ntiles * 16; b < nblocks; b++) fused1_##NAME(in, b, g, bmax, scales, out);   \
}                                                                                                 \
/* The amax pass of a tensor NVFP4 will encode: max |x|, "any NaN/Inf", and each block's max   \
   (kept for nvfp4_quantize, so the encode pass need not find them again). */                   \
void block_abs_max_##NAME(const void *in, int64_t nblocks, uint32_t *bmax, float *out, int32_t *bad) { \
    const int64_t ntiles = nblocks / 16;                                                          \
    uint32_t m = 0;                                                                               \
    _Pragma("omp parallel reduction(max:m)")                                                      \
    {                                                                                             \
        __m512i acc = _mm512_setzero_si512();                                                     \
        _Pragma("omp for schedule(static)")                                                       \
        for (int64_t t = 0; t < ntiles; t++) {                                                    \
            const __m512i mx = tile_max_##NAME(in, t * 16);                                       \
            _mm512_storeu_si512(bmax + t * 16, mx);                                               \
            acc = _mm512_max_epu32(acc, mx);                                                      \
        }                                                                                         \
        const uint32_t a = _mm512_reduce_max_epu32(acc);                                          \
        m = a > m ? a : m;                                                                        \
    }                                                                                             \
    for (int64_t b = ntiles * 16; b < nblocks; b++) {                                             \
        bmax[b] = block_max1_##NAME(in, b);                                                       \
        m = bmax[b] > m ? bmax[b] : m;                                                            \
    }                                                                                             \
    *bad = m >= 0x7f800000u;                                                                      \
    *out = f32_of_bits(m);                                                                        \
}
#else
#define FUSED(NAME)                                                                               \
void nvfp4_quantize_##NAME(const void *in, int64_t nblocks, float g, const uint32_t *bmax,      \
                           uint8_t *scales, uint8_t *out) {                                       \
    _Pragma("omp parallel for schedule(static)")                                                  \
    for (int64_t b = 0; b < nblocks; b++) fused1_##NAME(in, b, g, bmax, scales, out);            \
}                                                                                                 \
void block_abs_max_##NAME(const void *in, int64_t nblocks, uint32_t *bmax, float *out, int32_t *bad) { \
    uint32_t m = 0;                                                                               \
    _Pragma("omp parallel for schedule(static) reduction(max:m)")                                 \
    for (int64_t b = 0; b < nblocks; b++) { bmax[b] = block_max1_##NAME(in, b); m = bmax[b] > m ? bmax[b] : m; } \
    *bad = m >= 0x7f800000u;                                                                      \
    *out = f32_of_bits(m);                                                                        \
}
#endif
FUSED(f32)
void e4m3_codes(const float *x, int64_t n, uint8_t *out) {
    int64_t i = 0;
#ifdef DFLASH_AVX512
    for (; i + 16 <= n; i += 16)
        _mm_storeu_si128((__m128i *)(out + i), _mm512_cvtepi32_epi8(e4m3_code16(_mm512_loadu_ps(x + i))));
#endif
    for (; i < n; i++) out[i] = e4m3_code(x[i]);
}
FUSED(bf16)
