/* RMSNorm of float32 rows for the CPU runtime: out = w * (x * 1/sqrt(mean(x^2) + eps)) per row, as
   models/layers.RMSNorm computes it, in one call where torch takes five ops (some 60 norms a decode step).
   Each row is its own loop, the same whatever the number of rows (batch-invariant). The mean's summation
   order is this loop's, not torch's, so a row may differ from the torch path in the last bit: every float32
   pass of the runtime takes this path alike, and float64 oracles keep torch's. */
#include <math.h>

#include "dflash_kernels.h"

void rmsnorm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim, ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int64_t d = 0; d < dim; d++) ss += xr[d] * xr[d];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t d = 0; d < dim; d++) o[d] = w[d] * (xr[d] * inv);
    }
}
