/* RMSNorm of a bfloat16 decoder on the CPU in one pass, optionally after the residual add.
   torch runs it as six bf16 ops with float32 round trips between them (x.float(), pow, mean,
   rsqrt, mul, .to(bf16), weight * ...): at a 2,048-row prefill chunk of hidden 576 on one
   core 5.1 ms a norm, more than the layer's qkv and o projections together; here 0.6 ms. A row
   is read once into float32, normalised, and written once. (SiLU-mul in C measured no faster
   than torch's two vectorised ops: its exp and division set the pace in both.)

   Rounding follows HF's bf16 formulas (batchjob/backends/native/models/llama.py):
     residual add   x = bf16(x + d)
     RMSNorm        y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))   (mean in float32)
   so results equal torch's within the float32 summation order of the mean (below bf16's
   rounding almost always). Compiled into the attention kernel's
   library (kernels/cpu/build.py), sharing its ISA flags and torch's OpenMP pool. */

#pragma GCC optimize("fp-contract=off")

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define GLUE_PAR_MIN 32768 /* elements: below this one thread does the rows (decode steps) */

static inline float g_bf16_to_f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t g_f_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : r); /* a blend */
}

static void norm_row(uint16_t *restrict x, const uint16_t *restrict d, const void *restrict wp,
                     uint16_t *restrict y, int64_t D, float eps, int scale_in_float,
                     float *restrict buf) {
    const uint16_t *w = (const uint16_t *)wp;
    float acc[16] = {0};
    int64_t j = 0;
    if (d) {
        for (j = 0; j < D; j++) {
            const uint16_t s = g_f_to_bf16(g_bf16_to_f(x[j]) + g_bf16_to_f(d[j]));
            x[j] = s;
            buf[j] = g_bf16_to_f(s);
        }
    } else {
        for (j = 0; j < D; j++) buf[j] = g_bf16_to_f(x[j]);
    }
    for (j = 0; j + 16 <= D; j += 16)
        for (int i = 0; i < 16; i++) acc[i] += buf[j + i] * buf[j + i];
    float ss = 0.0f;
    for (; j < D; j++) ss += buf[j] * buf[j];
    for (int i = 0; i < 16; i++) ss += acc[i];
    const float inv = 1.0f / sqrtf(ss / (float)D + eps);
    if (scale_in_float == 2) { /* Gemma's: a float32 weight (1 + w), one rounding */
        const float *wf = (const float *)wp;
        for (j = 0; j < D; j++) y[j] = g_f_to_bf16(wf[j] * (buf[j] * inv));
        return;
    }
    if (scale_in_float) { /* OLMo2's order: y = bf16(w * x * inv), one rounding */
        for (j = 0; j < D; j++) y[j] = g_f_to_bf16(g_bf16_to_f(w[j]) * (buf[j] * inv));
        return;
    }
    for (j = 0; j < D; j++) {
        const float n = g_bf16_to_f(g_f_to_bf16(buf[j] * inv));
        y[j] = g_f_to_bf16(g_bf16_to_f(w[j]) * n);
    }
}

#define GLUE_MAX_D 16384 /* widest row (a float32 copy on the stack); wider: torch's ops */

/* y[t] = RMSNorm(x[t]) * w for T rows of D bf16 (row strides xs, ys in elements); with d
   (stride ds) first x[t] += d[t] in place: the residual stream updated, then normalised.
   scale_in_float: w scales the float32 normalised row before its one rounding (1: OLMo2's
   order, w bf16; 2: Gemma's, w float32) instead of after it is rounded (0: HF Llama's).
   Returns 0, or -1 (nothing written) when D > GLUE_MAX_D. */
int batchjob_rms_norm_bf16(uint16_t *x, int64_t xs, const uint16_t *d, int64_t ds,
                           const void *w, uint16_t *y, int64_t ys, int64_t T, int64_t D,
                           float eps, int scale_in_float, int threads) {
    if (D > GLUE_MAX_D) return -1;
    const int nt = (T * D >= GLUE_PAR_MIN && threads > 1) ? threads : 1;
#pragma omp parallel num_threads(nt)
    {
        float row[GLUE_MAX_D];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            norm_row(x + t * xs, d ? d + t * ds : 0, w, y + t * ys, D, eps, scale_in_float, row);
    }
    return 0;
}
