/* Linear layers on the CPU: y[M][N] = x[M][K] W^T (+ bias), float32, W packed once at load
   time into panels of NP = 2 vectors of output columns, [N/NP][K][NP] (the last panel
   zero-padded), so a panel is one sequential stream.

   Why: at M <= ~128 rows a decode step's GEMM reads each weight once for few FLOPs, and the
   weights are cold (the attention before it streamed the KV cache through every cache
   level). MKL's sgemm packs B on every call and ran such shapes at 40-80 GFLOP/s on an
   AVX2 EPYC that does ~140 on large ones. Here a thread walks its panels in order; for each,
   tiles of MR rows x NP columns (MR x 2 accumulators): 2 vector loads of the panel and MR
   broadcasts per 2 MR FMAs. Prefill chunks (hundreds to thousands of rows) run the same
   tiles over blocks of rows and of K (MC, KC below); where that beats MKL's large sgemm
   (an AVX-512 EPYC: 1.0-1.25x on most shapes), the calibration gives them to the kernel
   too. Compiled into
   the attention kernel's library (kernels/cpu/build.py), so it has its ISA flags and shares
   torch's OpenMP pool. */

#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LL 16
#define MR 12 /* 24 accumulators of 32 zmm */
#elif defined(__AVX2__) && defined(__FMA__)
#define LL 8
#define MR 6 /* 12 accumulators of 16 ymm */
#else
#define LL 4
#define MR 4 /* 8 accumulators of 16 xmm: no FMA, each product needs a temporary */
#endif
#define NP (2 * LL) /* output columns of a panel */

typedef float lvf __attribute__((vector_size(LL * 4)));
typedef float lvfu __attribute__((vector_size(LL * 4), aligned(4)));
#define LINLINE static inline __attribute__((always_inline))

LINLINE lvf lld(const float *p) { return *(const lvfu *)p; }
LINLINE void lst(float *p, lvf x) { *(lvfu *)p = x; }

int batchjob_linear_panel_cols(void) { return NP; }

/* wp[p][k][j] = w[p * NP + j][k] (zero past N). w: [N][K] row-major; wp: cdiv(N, NP) * K * NP
   floats. */
void batchjob_linear_pack(const float *w, float *wp, int64_t N, int64_t K) {
    const int64_t panels = (N + NP - 1) / NP;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NP; j++) {
                const int64_t n = p * NP + j;
                wp[(p * K + k) * NP + j] = n < N ? w[n * K + k] : 0.0f;
            }
}

/* One tile: rows m0 .. m0 + mr of x against kn rows of panel wp ([kn][NP]), into y's columns
   n0 .. n0 + nc (nc <= NP: the last panel's valid columns). first: the first block of K
   (starts from the bias); later blocks add to what y holds. */
LINLINE void tile(const float *x, int64_t xs, const float *wp, const float *bias, float *y,
                  int64_t ys, int64_t kn, int64_t n0, int nc, int first, const int mr) {
    lvf a0[MR], a1[MR];
    if (first) {
        float b[NP] = {0};
        if (bias)
            for (int j = 0; j < nc; j++) b[j] = bias[n0 + j];
        for (int r = 0; r < mr; r++) a0[r] = lld(b), a1[r] = lld(b + LL);
    } else if (nc == NP) {
        for (int r = 0; r < mr; r++) a0[r] = lld(y + r * ys + n0), a1[r] = lld(y + r * ys + n0 + LL);
    } else {
        for (int r = 0; r < mr; r++) {
            float t[NP] = {0};
            memcpy(t, y + r * ys + n0, sizeof(float) * nc);
            a0[r] = lld(t), a1[r] = lld(t + LL);
        }
    }
    for (int64_t k = 0; k < kn; k++) {
        const lvf w0 = lld(wp + k * NP), w1 = lld(wp + k * NP + LL);
        for (int r = 0; r < mr; r++) {
            const float xr = x[r * xs + k];
            a0[r] += xr * w0;
            a1[r] += xr * w1;
        }
    }
    if (nc == NP)
        for (int r = 0; r < mr; r++) lst(y + r * ys + n0, a0[r]), lst(y + r * ys + n0 + LL, a1[r]);
    else
        for (int r = 0; r < mr; r++) {
            float t[NP];
            lst(t, a0[r]), lst(t + LL, a1[r]);
            memcpy(y + r * ys + n0, t, sizeof(float) * nc);
        }
}

/* Rows m0 .. m1 of x (columns k0 .. k0 + kn) against panel p: MR-row tiles, then the tail
   with its own constant tile height. */
static void panel_rows(const float *x, int64_t xs, const float *wp, const float *bias, float *y,
                       int64_t ys, int64_t m0, int64_t m1, int64_t p, int64_t N, int64_t K,
                       int64_t k0, int64_t kn) {
    const float *w = wp + (p * K + k0) * NP;
    const int64_t n0 = p * NP;
    const int nc = N - n0 < NP ? (int)(N - n0) : NP;
    const int first = k0 == 0;
    x += k0;
    int64_t m = m0;
    for (; m + MR <= m1; m += MR)
        tile(x + m * xs, xs, w, bias, y + m * ys, ys, kn, n0, nc, first, MR);
    switch (m1 - m) {
#define TAIL(i)                                                                                   \
    case i: tile(x + m * xs, xs, w, bias, y + m * ys, ys, kn, n0, nc, first, i); break;
        TAIL(1) TAIL(2) TAIL(3)
#if MR > 4
        TAIL(4) TAIL(5)
#endif
#if MR > 6
        TAIL(6) TAIL(7) TAIL(8) TAIL(9) TAIL(10) TAIL(11)
#endif
#undef TAIL
    default: break;
    }
}

/* Blocking for many rows (prefill chunks): blocks of MC rows x KC of K, so a block of x
   (MC x KC floats, 240 KiB) stays in L2 while a thread's panels pass over it and a panel's
   KC rows (KC x NP floats) stay in L1 across the block's row tiles; y holds the partial sums
   between K blocks. Up to MC rows, one pass over all of K (no partial sums). */
#define MC 240 /* a multiple of every MR */
#define KC 256

/* y = x W^T + bias with W packed by batchjob_linear_pack. x: M rows of K floats, xs apart;
   y: M rows of N floats, ys apart; bias: N floats or NULL. Each thread takes a contiguous
   range of panels (and streams its share of W once per block of rows). Returns 0. */
int batchjob_linear(const float *x, int64_t xs, const float *wp, const float *bias, float *y,
                    int64_t ys, int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t panels = (N + NP - 1) / NP;
    const int64_t kc = M > MC ? KC : K;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        for (int64_t k0 = 0; k0 < K; k0 += kc) {
            const int64_t kn = K - k0 < kc ? K - k0 : kc;
            for (int64_t m0 = 0; m0 < M; m0 += MC) {
                const int64_t m1 = M - m0 < MC ? M : m0 + MC;
                for (int64_t p = p0; p < p1; p++)
                    panel_rows(x, xs, wp, bias, y, ys, m0, m1, p, N, K, k0, kn);
            }
        }
    }
    return 0;
}
