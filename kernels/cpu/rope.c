/* Rotary position embedding in place on the CPU, bit-equal to the torch ops it replaces
   (batchjob/backends/native/models/rope.py apply_rope_): with x1, x2 the two halves of a
   head and c, s the cos / sin of its position,
       x1' = x1 c - x2 s,    x2' = x2 c + x1 s,
   each product rounded to the tensor's dtype before the difference / sum (no fused
   multiply-add: fp-contract is off in this file), and for bfloat16 every result rounded to
   bf16 (nearest even) as torch's bf16 ops do. Compiled into the attention kernel's library
   (kernels/cpu/build.py), so it shares its ISA flags and OpenMP pool.

   x: [T, H, D] with strides (st, sh, 1) in elements (e.g. q and k of the fused qkv output as
   one view); cos, sin: [T, D/2] contiguous, the same dtype as x. */

#pragma GCC optimize("fp-contract=off")

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f_to_bf16(float f) { /* round to nearest even; finite inputs */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float rb(float f) { return bf16_to_f(f_to_bf16(f)); } /* round to bf16 */

static void rope_f32(float *x, int64_t T, int64_t H, int64_t half, int64_t st, int64_t sh,
                     const float *cos, const float *sin, int n_threads) {
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < H; h++) {
            float *x1 = x + t * st + h * sh, *x2 = x1 + half;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float a = x1[d], b = x2[d];
                const float ac = a * c[d], bs = b * s[d], bc = b * c[d], as = a * s[d];
                x1[d] = ac - bs;
                x2[d] = bc + as;
            }
        }
    }
}

static void rope_bf16(uint16_t *x, int64_t T, int64_t H, int64_t half, int64_t st, int64_t sh,
                      const uint16_t *cos, const uint16_t *sin, int n_threads) {
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < H; h++) {
            uint16_t *x1 = x + t * st + h * sh, *x2 = x1 + half;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float a = bf16_to_f(x1[d]), b = bf16_to_f(x2[d]);
                const float cd = bf16_to_f(c[d]), sd = bf16_to_f(s[d]);
                x1[d] = f_to_bf16(rb(a * cd) - rb(b * sd));
                x2[d] = f_to_bf16(rb(b * cd) + rb(a * sd));
            }
        }
    }
}

/* Returns 0, or -1 for an odd head dim. bf16: 0 float32, 1 bfloat16. */
int batchjob_rope(void *x, int64_t T, int64_t H, int64_t D, int64_t st, int64_t sh,
                  const void *cos, const void *sin, int bf16, int n_threads) {
    if (D % 2) return -1;
    if (bf16)
        rope_bf16((uint16_t *)x, T, H, D / 2, st, sh, (const uint16_t *)cos,
                  (const uint16_t *)sin, n_threads);
    else
        rope_f32((float *)x, T, H, D / 2, st, sh, (const float *)cos, (const float *)sin,
                 n_threads);
    return 0;
}
