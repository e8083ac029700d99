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

/* Element i of a float32 or bf16 array as a float; a result rounded to the array's dtype
   (bf16: to nearest even, as torch rounds each bf16 op; float32: as computed). */
static inline float get(const void *p, int64_t i, const int bf) {
    return bf ? bf16_to_f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline float rnd(float f, const int bf) { return bf ? bf16_to_f(f_to_bf16(f)) : f; }
static inline void put(void *p, int64_t i, float f, const int bf) {
    if (bf)
        ((uint16_t *)p)[i] = f_to_bf16(f);
    else
        ((float *)p)[i] = f;
}

/* One body for both dtypes: bf is a constant in each call below, so each is its own loop. */
static inline __attribute__((always_inline)) void rope(void *x, int64_t T, int64_t H,
                                                       int64_t half, int64_t st, int64_t sh,
                                                       const void *cos, const void *sin,
                                                       int n_threads, const int bf) {
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t x1 = t * st + h * sh, x2 = x1 + half, cs = t * half;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float a = get(x, x1 + d, bf), b = get(x, x2 + d, bf);
                const float c = get(cos, cs + d, bf), s = get(sin, cs + d, bf);
                put(x, x1 + d, rnd(a * c, bf) - rnd(b * s, bf), bf);
                put(x, x2 + d, rnd(b * c, bf) + rnd(a * s, bf), bf);
            }
        }
}

/* Returns 0, or -1 for an odd head dim. bf16: 0 float32, 1 bfloat16. */
int batchjob_rope(void *x, int64_t T, int64_t H, int64_t D, int64_t st, int64_t sh,
                  const void *cos, const void *sin, int bf16, int n_threads) {
    if (D % 2) return -1;
    if (bf16)
        rope(x, T, H, D / 2, st, sh, cos, sin, n_threads, 1);
    else
        rope(x, T, H, D / 2, st, sh, cos, sin, n_threads, 0);
    return 0;
}
