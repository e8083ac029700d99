/* Prefix-shared paged attention for the CPU, reading KV blocks in place (float32).

   One source, compiled once per ISA by kernels/cpu/build.py (never -march=native):
     amx      avx512's flags + -mamx-tile -mamx-bf16 -mavx512bf16: as avx512, and bfloat16
              caches' prefill tiles multiply on AMX (run_unit_amx)
     avx512   -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma: 16 lanes, 32 registers
     avx2     -mavx2 -mfma:                                      8 lanes, 16 registers
     generic  no ISA flags (SSE2 / NEON):                        4 lanes
   The lane count L, the register budget ACC of a tile and MAX_ROWS (64 / 64 / 32) follow
   from the ISA macros the compiler defines; the Python side
   (batchjob/backends/native/attention/cpu.py) reads them back (batchjob_kernel_lanes /
   _max_rows) and turns AttentionMetadata into work units.

   A work unit is `nq` consecutive query tokens x the R query heads of one KV head against
   one key sequence (a block-table row of `nkeys` keys): the own KV of a sequence (causal)
   or a group's shared prefix (no mask, all the group's queries in one matrix-matrix tile).
   Query i of the unit sees key k iff lo + i <= k <= causal + i (lo: a sliding window's first
   visible key for query 0; without one, a negative number past any key count); a query that
   sees no key of a prefix unit gets a zero partial of log-sum-exp -inf. Flash-style online
   softmax in the log2 domain, float32 throughout. Own partials go to `out`, prefix partials to `pout`, and
   a final pass merges them by log-sum-exp into `out`.

   Layout: q [T, H, D] float32; k/v cache [num_blocks, BS, Hkv, D] (or any strides with a
   head's D elements contiguous: batchjob_paged_attention_strided), float32 or bfloat16
   (kv_bf16: widened to float32 chunk by chunk); out/pout [T, H, D];
   lse [2, T, H] (natural log; row 1: prefix, -inf where a token has no prefix).
   Requires D % L == 0, D <= 256, BS % 16 == 0 and rows = nq * R <= MAX_ROWS. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define L 16   /* float lanes of one vector */
#define ACC 16 /* accumulator vectors of a register tile (32 zmm in all) */
#ifdef __AVX512BF16__
#define HAVE_BF16DP 1 /* bfloat16 caches: key-major tiles on vdpbf16ps (run_unit_dp) */
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1 /* bfloat16 caches: prefill tiles on AMX (run_unit_amx) */
#include <sys/syscall.h>
#include <unistd.h>
#define ISA_NAME "amx"
#elif defined(HAVE_BF16DP)
#define ISA_NAME "avx512bf16"
#else
#define ISA_NAME "avx512"
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define L 8
#define ACC 8 /* 16 ymm: 8 accumulators + operands */
#define SACC 12 /* score tiles: 12 accumulators, 3 row vectors, 1 broadcast key */
#define ISA_NAME "avx2"
#else
#define L 4
#define ACC 8
#define ISA_NAME "generic"
#endif
#ifndef SACC
#define SACC ACC /* score tiles' accumulators, where not set above */
#endif

#define CH 16            /* keys per chunk: block sizes are multiples of it */
#if L == 16
#define MAX_NV 4 /* row vectors of a unit: 64 rows */
#else
#define MAX_NV 8 /* 64 rows on AVX2 (32 generic), scored as two halves of 4 vectors */
#endif
#define MAX_ROWS (MAX_NV * L) /* query rows (tokens x heads) of one unit */
/* All-KV-head units (kvh < 0): their rows, each head's tile padded to whole vectors. */
#define MAX_WROWS 256
#define SROWS (MAX_WROWS > MAX_ROWS ? MAX_WROWS : MAX_ROWS) /* scratch rows */
#define MAX_D 256
/* Score tiles sum q . k over at most this many dims at a time: a tile's transposed queries
   ([D][RP]) then stay in L1 while each key group re-reads them (at D = 256 they did not). */
#define DSPLIT 128
/* Units with fewer query rows per head than this take the row-major dot-product path: a
   key-major tile spends D broadcasts per key whatever its rows, a row-major one ~D/L loads per
   row, so small groups (decode over a prefix shared by 4-7 rows, GQA decode) run 5-13% faster
   row-major, at every head dim, on AVX-512 and AVX2 (measured; 4 before). */
#define FEW_ROWS 8
/* float32 caches: where a key-major tile's broadcasts cost more against short heads or narrow
   vectors, row-major wins up to more rows a head (decode over a prefix shared by 8-15
   members; measured per ISA and head dim, AMD EPYC Zen 5): avx512 d64 9-10 rows 1.06-1.09x,
   12-15 rows 0.95-0.98x (d128: 9 rows even, 10 rows 0.97x); avx2 d64 9-15 rows 1.04-1.18x,
   d128 9-11 rows 1.03-1.09x. bfloat16 caches keep FEW_ROWS (their key-major units run on
   vdpbf16ps or AMX). */
#if L == 16
#define FEW_ROWS_F32(D) ((D) <= 64 ? 11 : FEW_ROWS)
#elif L == 8
#define FEW_ROWS_F32(D) ((D) <= 64 ? 16 : 12)
#else
#define FEW_ROWS_F32(D) FEW_ROWS
#endif
#define SC 256 /* keys per softmax span: one rescale of the accumulators per span */

typedef float vf __attribute__((vector_size(4 * L)));
typedef float vfu __attribute__((vector_size(4 * L), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * L)));

enum { U_Q0, U_NQ, U_NKEYS, U_BLK, U_CAUSAL, U_DST, U_KVH, U_LO, U_FIELDS };

typedef struct {
    const void *q; /* float32, or bfloat16 (uint16) when q_bf16 */
    const void *k, *v; /* float32, or bfloat16 (uint16) when kv_bf16 */
    const int32_t *blocks;
    float *out, *pout, *lse;
    int64_t T, H, Hkv, D, BS;
    int64_t bstr, ks, hstr; /* cache strides in elements: a block, a key row, a KV head */
    const int64_t *tok; /* the units' token t is row tok[t] of q, out and lse (NULL: t) */
    int64_t qstr;       /* elements from one token's queries to the next's in q */
    int q_bf16;         /* q holds bfloat16 values (a bf16 model's: widened exactly) */
    float qscale; /* softmax scale * log2(e) */
} args_t;

#define INLINE static inline __attribute__((always_inline))

/* Where the units' query token t lives: its row of q (q_f32), out and lse. */
INLINE int64_t tok_row(const args_t *a, int64_t t) { return a->tok ? a->tok[t] : t; }

INLINE vf ld(const float *p) { return *(const vfu *)p; }
INLINE void st(float *p, vf x) { *(vfu *)p = x; }
INLINE vf splat(float x) { return (vf){0} + x; }
INLINE vi lanes(void) {
    vi x = {0};
    for (int i = 0; i < L; i++) x[i] = i;
    return x;
}

INLINE vf select_v(vi m, vf a, vf b) { /* m ? a : b, m lanes all-ones or zero */
    return (vf)(((vi)a & m) | ((vi)b & ~m));
}

INLINE vf vmax(vf a, vf b) {
#if L == 16
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif L == 8
    return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
    return select_v(a > b, a, b);
#endif
}

/* 2**x for x <= 0 (relative error < 2e-7 measured over [-126, 0], 2.2e-7 before): x is clamped
   to -126 (the result stays normal, ~1e-38 there, callers mask; -inf gives that, not NaN), then
   x = n + f with n = round(x), f in [-0.5, 0.5]; 2**f by a degree-5 minimax polynomial with
   p(0) = 1 (one FMA less than the degree-6 Taylor one it replaced), scaled by 2**n: vscalefps on
   AVX-512 (n from vrndscaleps), else n added to the exponent (n by the 1.5 * 2**23 trick). */
INLINE vf exp2v(vf x) {
    x = vmax(x, splat(-126.0f));
#if L == 16
    const __m512 n = _mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf f = x - (vf)n; /* [-0.5, 0.5] */
#else
    const vf magic = splat(12582912.0f);
    const vf t = x + magic;       /* n in the low mantissa bits */
    const vf f = x - (t - magic); /* [-0.5, 0.5] */
#endif
    vf p = splat(1.32647271e-3f);
    p = p * f + 9.67151265e-3f;
    p = p * f + 5.55073374e-2f;
    p = p * f + 2.40222421e-1f;
    p = p * f + 6.93146978e-1f;
    p = p * f + 1.0f;
#if L == 16
    return (vf)_mm512_scalef_ps((__m512)p, n);
#else
    return (vf)((vi)p + (((vi)t - (vi)magic) << 23));
#endif
}

INLINE float hmax(vf x) {
    float m = x[0];
    for (int i = 1; i < L; i++) m = x[i] > m ? x[i] : m;
    return m;
}

INLINE float hsum(vf x) { /* pairwise tree */
    for (int w = L / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) x[i] += x[i + w];
    return x[0];
}

/* out[i] = sum of the lanes of a[i], i < L: L dot products finished with a shuffle tree
   (about 3 instructions per key instead of a horizontal sum each). */
#if L == 8 || L == 16
INLINE __m256 reduce8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif
INLINE vf reduce_keys(const vf *a) {
#if L == 16
    __m256 h[16];
    for (int i = 0; i < 16; i++) {
        const __m512 x = (__m512)a[i];
        const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
        h[i] = _mm256_add_ps(_mm512_castps512_ps256(x), hi);
    }
    const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(reduce8(h)));
    return (vf)_mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(reduce8(h + 8)), 1));
#elif L == 8
    return (vf)reduce8((const __m256 *)a);
#else
    vf r = splat(0);
    for (int i = 0; i < L; i++) r[i] = hsum(a[i]);
    return r;
#endif
}

/* The largest divisor of n that is <= cap (a compile-time constant once D is). */
INLINE int div_le(int n, int cap) {
    for (int c = cap; c > 1; c--)
        if (n % c == 0) return c;
    return 1;
}

typedef struct {
    float qs[SROWS * MAX_D];  /* scaled queries; rows past the unit's are zero */
    float o[SROWS * MAX_D];   /* unnormalised output accumulators */
    float s[SROWS * SC];      /* scores, then probabilities, of one span of keys */
    float kv[2 * CH * MAX_D]; /* one or two chunks of K or V rows, contiguous: [32][D] */
    float qtk[MAX_D * SROWS]; /* key-major tiles: query rows transposed, [D][RP] per head */
    float m[SROWS], l[SROWS];
#ifdef HAVE_BF16DP
    uint32_t vv[SC / 2 * MAX_D];    /* a span's V of one head as bf16 pairs of keys: [SC/2][D] */
    uint32_t pp[SC / 2 * MAX_ROWS]; /* its P as bf16 pairs of keys: [SC/2][RP] */
#endif
#ifdef HAVE_AMX
    uint32_t qv[MAX_ROWS / 16][MAX_D / 2][16]; /* Q^T as bf16 pairs of dims: B tiles */
    uint16_t pa[MAX_ROWS / 16][SC / 32][16][32]; /* a span's P, bf16, row-major: A tiles */
#endif
} scratch_t;

/* Few rows (decode): s[r * SC + j] = q_r . k_j for the nv <= 16 keys of a chunk, L keys at
   a time (L independent accumulators, reduced together). Keys past nv in the chunk are in
   the same block (BS % 16 == 0): computed, then masked by the softmax. */
INLINE void scores_dot(const float *qs, float *s, int rows, int64_t D, const float *K,
                       int64_t ks, int nv) {
    for (int r = 0; r < rows; r++) {
        const float *qr = qs + r * D;
        for (int j0 = 0; j0 < nv; j0 += L) {
            vf a[L];
            for (int i = 0; i < L; i++) a[i] = splat(0);
            for (int64_t d = 0; d < D; d += L) {
                const vf qd = ld(qr + d);
                for (int i = 0; i < L; i++) a[i] += qd * ld(K + (j0 + i) * ks + d);
            }
            st(s + r * SC + j0, reduce_keys(a));
        }
    }
}

/* Few rows: o_r += sum_j p[r * SC + j] v_j, o_r held in registers (AV vectors of D at a
   time) and the keys split over KS accumulator sets, so KS * AV FMA chains run at once. */
INLINE void accumulate_rows(float *obase, const float *p, int rows, int64_t D, const float *V,
                            int64_t ks, int nv) {
    const int AV = div_le((int)(D / L), ACC / 2), KS = ACC / AV < 4 ? ACC / AV : 4;
    for (int r = 0; r < rows; r++) {
        const float *pr = p + r * SC;
        float *o = obase + r * D;
        for (int64_t d = 0; d < D; d += AV * L) {
            vf a[4][ACC / 2];
            for (int v = 0; v < AV; v++) {
                a[0][v] = ld(o + d + v * L);
                for (int s = 1; s < KS; s++) a[s][v] = splat(0);
            }
            int j = 0;
            for (; j + KS <= nv; j += KS)
                for (int s = 0; s < KS; s++) {
                    const float c = pr[j + s];
                    const float *vj = V + (j + s) * ks + d;
                    for (int v = 0; v < AV; v++) a[s][v] += c * ld(vj + v * L);
                }
            for (; j < nv; j++)
                for (int v = 0; v < AV; v++) a[0][v] += pr[j] * ld(V + j * ks + d + v * L);
            for (int v = 0; v < AV; v++) {
                for (int s = 1; s < KS; s++) a[0][v] += a[s][v];
                st(o + d + v * L, a[0][v]);
            }
        }
    }
}

/* The next chunk's rows (one head's, `rows` of `bytes`, `stride` apart), fetched into L2 line by
   line while a key-major tile computes this chunk, a few rows per step of its loops: the
   hardware prefetcher does not follow rows Hkv * D apart, and its first-line prefetch leaves
   the rest of each row to demand misses. p NULL: nothing. */
typedef struct {
    const char *p;
    int64_t stride, bytes;
    int rows;
} pf_t;

INLINE void pf_rows(pf_t f, int r0, int r1) { /* rows r0 .. r1 - 1 of f */
    if (!f.p) return;
    if (r1 > f.rows) r1 = f.rows;
    for (int r = r0; r < r1; r++)
        for (int64_t l = 0; l < f.bytes; l += 64) __builtin_prefetch(f.p + r * f.stride + l, 0, 2);
}

/* RB rows of accumulate_km (o0, p, p1 at the first of them): RB x AV accumulators, each a
   chain over the keys in order, so a row's sums are the same whichever step takes it. */
INLINE void accumulate_km_rows(float *o0, const float *p, const float *p1, int RP, const int RB,
                               int64_t D, const float *V0, const float *V1, int64_t vs, int nv0,
                               int nv1) {
    const int AV = div_le((int)(D / L), ACC / RB);
    for (int64_t d = 0; d < D; d += AV * L) {
        vf acc[4][ACC];
        for (int i = 0; i < RB; i++)
            for (int v = 0; v < AV; v++) acc[i][v] = ld(o0 + i * D + d + v * L);
        for (int j = 0; j < nv0; j++) {
            const float *vj = V0 + j * vs + d, *pj = p + j * RP;
            for (int v = 0; v < AV; v++) {
                const vf x = ld(vj + v * L);
                for (int i = 0; i < RB; i++) acc[i][v] += pj[i] * x;
            }
        }
        for (int j = 0; j < nv1; j++) {
            const float *vj = V1 + j * vs + d, *pj = p1 + j * RP;
            for (int v = 0; v < AV; v++) {
                const vf x = ld(vj + v * L);
                for (int i = 0; i < RB; i++) acc[i][v] += pj[i] * x;
            }
        }
        for (int i = 0; i < RB; i++)
            for (int v = 0; v < AV; v++) st(o0 + i * D + d + v * L, acc[i][v]);
    }
}

/* Key-major tiles: o[r] += sum_j p[j * RP + r] v_j over two chunks' keys (nv0 from V0, then
   nv1 from V1; rows vs apart), 4 rows x AV vectors of D per step (4 * AV accumulators), the
   last 1-3 rows in one step of their own, as pv_dp (here the chains were shorter, at most two
   chunks' keys: 0.98-1.04x). Two chunks per load and store of the accumulators: their
   traffic halves (f0, f1: the lines of the walk's next two chunks, spread over the steps). */
INLINE void accumulate_km(float *obase, const float *p, int RP, int rows, int64_t D,
                          const float *V0, const float *V1, int64_t vs, int nv0, int nv1,
                          pf_t f0, pf_t f1) {
    const int steps = rows / 4;
    const float *p1 = p + CH * RP;
    if (!steps) {
        pf_rows(f0, 0, CH);
        pf_rows(f1, 0, CH);
    }
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
        pf_rows(f0, r / 4 * CH / steps, (r / 4 + 1) * CH / steps);
        pf_rows(f1, r / 4 * CH / steps, (r / 4 + 1) * CH / steps);
        accumulate_km_rows(obase + r * D, p + r, p1 + r, RP, 4, D, V0, V1, vs, nv0, nv1);
    }
    float *o = obase + r * D;
    switch (rows - r) { /* RB constant in each clone: the accumulators stay in registers */
    case 1: accumulate_km_rows(o, p + r, p1 + r, RP, 1, D, V0, V1, vs, nv0, nv1); break;
    case 2: accumulate_km_rows(o, p + r, p1 + r, RP, 2, D, V0, V1, vs, nv0, nv1); break;
    case 3: accumulate_km_rows(o, p + r, p1 + r, RP, 3, D, V0, V1, vs, nv0, nv1); break;
    default: break;
    }
}

/* Key-major tiles (4..MAX_ROWS rows): rows live in NV vectors of L (w->qtk: [D][NV*L]),
   each K element is broadcast against them (NV x KB <= SACC accumulators), so K needs no
   transpose; scores land key-major, sk[j * RP + r] (RP = NV * L), and stay so for the
   softmax and P.V. */
INLINE void scores_km_nv(const float *qtk, float *sk, const int NV, const int KB, int RP,
                         int v0, int64_t D, const float *K, int64_t ks, int nv, pf_t f) {
    const int steps = (nv + KB - 1) / KB; /* key groups: f's rows spread over them */
    /* KB keys x NV row vectors of accumulators; KB divides CH: keys past nv are scratch */
    const float *qt = qtk + v0 * L; /* row vectors v0 .. v0 + NV of an RP-row tile */
    sk += v0 * L;
    for (int64_t d0 = 0; d0 < D; d0 += DSPLIT) { /* partial sums over DSPLIT dims at a time */
        const int64_t d1 = d0 + DSPLIT < D ? d0 + DSPLIT : D;
        for (int j0 = 0; j0 < nv; j0 += KB) {
            if (!d0) pf_rows(f, j0 / KB * CH / steps, (j0 / KB + 1) * CH / steps);
            const float *k = K + j0 * ks; /* one base pointer: key i at k + i * ks */
            vf a[SACC];
            for (int i = 0; i < KB; i++)
                for (int v = 0; v < NV; v++)
                    a[i * NV + v] = d0 && j0 + i < nv ? ld(sk + (j0 + i) * RP + v * L) : splat(0);
            for (int64_t d = d0; d < d1; d++) {
                vf qv[4];
                for (int v = 0; v < NV; v++) qv[v] = ld(qt + d * RP + v * L);
                for (int i = 0; i < KB; i++) {
                    const float kd = k[i * ks + d];
                    for (int v = 0; v < NV; v++) a[i * NV + v] += kd * qv[v];
                }
            }
            for (int i = 0; i < KB && j0 + i < nv; i++)
                for (int v = 0; v < NV; v++) st(sk + (j0 + i) * RP + v * L, a[i * NV + v]);
        }
    }
}

INLINE void scores_km(const float *w, float *sk, int NV, int64_t D, const float *K, int64_t ks,
                      int nv, pf_t f) {
    const pf_t none = {0}; /* w: the tile's transposed queries, [D][NV * L] */
    const int RP = NV * L;
    switch (NV) { /* NV constant in each clone: the accumulators stay in registers */
    case 1: scores_km_nv(w, sk, 1, ACC, RP, 0, D, K, ks, nv, f); break;
    case 2: scores_km_nv(w, sk, 2, ACC / 2, RP, 0, D, K, ks, nv, f); break;
    case 4: scores_km_nv(w, sk, 4, ACC / 4, RP, 0, D, K, ks, nv, f); break; /* 3 up: qt lanes 0 */
    default: /* 8 (AVX2, generic): parts of the row vectors, each reads the chunk */
#if L == 8 /* 3 + 3 + 2 vectors x 4 keys: 12 accumulators, 7 loads per 12 FMAs (4 x 2: 6 per
              8), 5-19% faster on every prefill shape than two halves (AMD EPYC, Zen 3) */
        scores_km_nv(w, sk, 3, 4, RP, 0, D, K, ks, nv, f);
        scores_km_nv(w, sk, 3, 4, RP, 3, D, K, ks, nv, none);
        scores_km_nv(w, sk, 2, 4, RP, 6, D, K, ks, nv, none);
#else
        scores_km_nv(w, sk, 4, ACC / 4, RP, 0, D, K, ks, nv, f);
        scores_km_nv(w, sk, 4, ACC / 4, RP, 4, D, K, ks, nv, none);
#endif
    }
}

/* Online softmax over a key-major span of n keys from key kb: vectorised over rows. One
   tile's scores s ([n][NV * L]), running max m and sum l, and output rows o ([rows][D]). */
typedef struct {
    float *s, *m, *l, *o;
} tile_t;

/* The lanewise max of n key-major score vectors (s + j * RP), key j counted in lanes with
   first <= j < lim unless `all`; four running maxima (one was a chain of dependent vmaxps: 3% of a bf16
   prefill unit's cycles, AMD Zen 4). Padding lanes hold finite scores of zero queries. */
INLINE vf span_max(const float *s, int RP, int n, vi first, vi lim, int all) {
#define KEY(j)                                                                                \
    (all ? ld(s + (j) * RP)                                                                   \
         : select_v((lim > (j)) & (first <= (j)), ld(s + (j) * RP), splat(-INFINITY)))
    vf m0 = splat(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        m0 = vmax(m0, KEY(j));
        m1 = vmax(m1, KEY(j + 1));
        m2 = vmax(m2, KEY(j + 2));
        m3 = vmax(m3, KEY(j + 3));
    }
    for (; j < n; j++) m0 = vmax(m0, KEY(j));
#undef KEY
    return vmax(vmax(m0, m1), vmax(m2, m3));
}

INLINE void softmax_km(tile_t w, int rows, int NV, int64_t R, int64_t D, int64_t causal,
                       int64_t win_lo, int64_t kb, int n,
                       const float scl) { /* scl: scores' scale, or 1 */
    const int RP = NV * L;
    for (int v = 0; v < NV; v++) {
        vi first, lim; /* row r sees span keys first[r] <= j < lim[r] (none: padding rows) */
        for (int i = 0; i < L; i++) {
            const int r = v * L + i;
            int64_t x = r < rows ? causal + r / R - kb + 1 : 0;
            int64_t f = win_lo + r / R - kb;
            lim[i] = (int32_t)(x < 0 ? 0 : (x > n ? n : x));
            first[i] = (int32_t)(f < 0 ? 0 : (f > n ? n : f));
        }
        int all = 1; /* every real row of this vector sees all n keys: no masks */
        for (int i = 0; i < L && v * L + i < rows; i++) all &= lim[i] == n && first[i] == 0;
        const vf mx = span_max(w.s + v * L, RP, n, first, lim, all);
        const vf mold = ld(w.m + v * L);
        const vf mnew = vmax(mx * scl, mold); /* scl > 0: the max commutes with it */
        const vi none = mnew == splat(-INFINITY); /* no key seen yet: keep zeros */
        const vf alpha = select_v(none, splat(1.0f), exp2v(mold - mnew));
        vf sum = splat(0);
        if (all)
            for (int j = 0; j < n; j++) {
                float *sj = w.s + j * RP + v * L;
                const vf p = exp2v(ld(sj) * scl - mnew);
                st(sj, p);
                sum += p;
            }
        else
            for (int j = 0; j < n; j++) {
                float *sj = w.s + j * RP + v * L;
                const vf p =
                    select_v((lim > j) & (first <= j), exp2v(ld(sj) * scl - mnew), splat(0));
                st(sj, p);
                sum += p;
            }
        st(w.l + v * L, ld(w.l + v * L) * alpha + sum);
        st(w.m + v * L, mnew);
        for (int i = 0; i < L && v * L + i < rows; i++)
            if (alpha[i] != 1.0f) {
                float *o = w.o + (v * L + i) * D;
                for (int64_t d = 0; d < D; d += L) st(o + d, ld(o + d) * alpha[i]);
            }
    }
}

/* Online softmax over one span of n keys (starting at key kb): scores -> probabilities,
   running max/sum updated, accumulators rescaled once per row. */
INLINE void softmax_span(scratch_t *w, int rows, int rh, int64_t R, int64_t D, int64_t causal,
                         int64_t win_lo, int64_t kb, int n) {
    const vi lane = lanes();
    for (int r = 0; r < rows; r++) {
        float *s = w->s + r * SC;
        int64_t lim = causal + (r % rh) / R - kb + 1; /* visible keys of this span: */
        int64_t first = win_lo + (r % rh) / R - kb;   /* first <= j < lim */
        if (lim > n) lim = n;
        if (first < 0) first = 0;
        if (lim <= first) { /* nothing visible here: adds nothing */
            memset(s, 0, sizeof(float) * ((n + CH - 1) / CH) * CH);
            continue;
        }
        vf vm = splat(-INFINITY);
        for (int j = 0; j < lim; j += L)
            vm = vmax(vm, select_v((lane < (int32_t)(lim - j)) & (lane >= (int32_t)(first - j)),
                                   ld(s + j), splat(-INFINITY)));
        const float mx = hmax(vm), mold = w->m[r];
        const float mnew = mx > mold ? mx : mold;
        vf sum = splat(0);
        for (int j = 0; j < n; j += L) {
            const vi vis = (lane < (int32_t)(lim - j)) & (lane >= (int32_t)(first - j));
            const vf pj = select_v(vis, exp2v(ld(s + j) - mnew), splat(0));
            st(s + j, pj);
            sum += pj;
        }
        const float alpha = exp2f(mold - mnew); /* 0 on the first visible span */
        w->l[r] = w->l[r] * alpha + hsum(sum);
        w->m[r] = mnew;
        if (alpha != 1.0f) {
            float *o = w->o + r * D;
            for (int64_t d = 0; d < D; d += L) st(o + d, ld(o + d) * alpha);
        }
    }
}

/* Whether a tile may re-read a float32 cache's rows (ks elements apart) in place: they do not
   all share an L1 set, i.e. are not a multiple of 4 KiB apart (8/2 x 128, 8/8 x 64). */
INLINE int rows_in_place(int64_t ks, const int BF) { return !BF && ks * 4 % 4096; }

/* Cache rows of one head are Hkv * D floats apart (4 KiB for 8 x 128): 16 of them share
   one L1 set and evict each other while a tile re-reads them, so tiles read a packed copy. */
INLINE const float *pack(float *dst, const float *src, int nv, int64_t D, int64_t ks) {
    for (int j = 0; j < nv; j++) /* vector copies: memcpy became rep movs (slow to start) */
        for (int64_t d = 0; d < D; d += L) st(dst + j * D + d, ld(src + j * ks + d));
    return dst;
}

/* The same from a bfloat16 cache: widened to float32 (bf16 is the top half of a float). */
INLINE const float *pack_bf16(float *dst, const uint16_t *src, int nv, int64_t D, int64_t ks) {
    for (int j = 0; j < nv; j++) {
        const uint16_t *x = src + j * ks;
        float *y = dst + j * D;
#if L == 16
        for (int64_t d = 0; d < D; d += 16) {
            const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + d)));
            _mm512_storeu_ps(y + d, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        }
#elif L == 8
        for (int64_t d = 0; d < D; d += 8) {
            const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + d)));
            _mm256_storeu_ps(y + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
#else
        for (int64_t d = 0; d < D; d++) {
            const uint32_t b = (uint32_t)x[d] << 16;
            memcpy(y + d, &b, 4);
        }
#endif
    }
    return dst;
}

INLINE uint32_t bf16_round(float x) { /* round to nearest even (finite x) */
    uint32_t u;
    memcpy(&u, &x, 4);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

/* float32 -> bfloat16 as torch's conversion: bf16_round, a NaN kept a quiet NaN. */
INLINE uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)bf16_round(x);
}

/* Query token t, head h, as float32: in place, or widened from bfloat16 into buf ([D]). */
INLINE const float *q_f32(const args_t *a, int64_t t, int64_t h, int64_t D, float *buf) {
    const int64_t at = tok_row(a, t) * a->qstr + h * D;
    if (!a->q_bf16) return (const float *)a->q + at;
    return pack_bf16(buf, (const uint16_t *)a->q + at, 1, D, D);
}

/* nv key (or value) rows of one head from element `at` of a cache whose rows are ks apart, as
   float32 rows D apart in dst: a tile's packed copy (see pack), widened if bfloat16. */
INLINE const float *packed_rows(float *dst, const void *cache, int64_t at, int nv, int64_t D,
                                int64_t ks, const int BF) {
    return BF ? pack_bf16(dst, (const uint16_t *)cache + at, nv, D, ks)
              : pack(dst, (const float *)cache + at, nv, D, ks);
}

/* The same for row-major dot products (decode), rows *stride apart: a float32 cache is read
   in place (no copy), a bfloat16 one is widened into dst. */
INLINE const float *head_rows(float *dst, const void *cache, int64_t at, int nv, int64_t D,
                              int64_t ks, const int BF, int64_t *stride) {
    *stride = BF ? D : ks;
    return BF ? packed_rows(dst, cache, at, nv, D, ks, BF) : (const float *)cache + at;
}

#ifdef HAVE_BF16DP
/* Few rows (decode) over a bfloat16 cache, read in place: q . k on vdpbf16ps (32 dims of a
   key a load, no widening) against qb, the rows' unscaled queries as bf16 ([rows][D / 2]
   pairs), scores then scaled by scl; keys past nv as scores_dot. */
INLINE void scores_dot_bf16(const uint32_t *qb, float *s, int rows, int64_t D,
                            const uint16_t *K, int64_t ks, int nv, const float scl) {
    for (int r = 0; r < rows; r++) {
        const uint32_t *qr = qb + r * (D / 2);
        for (int j0 = 0; j0 < nv; j0 += L) {
            vf a[L];
            for (int i = 0; i < L; i++) a[i] = splat(0);
            for (int64_t d = 0; d < D; d += 32) {
                const __m512bh qd = (__m512bh)_mm512_loadu_si512(qr + d / 2);
                for (int i = 0; i < L; i++)
                    a[i] = (vf)_mm512_dpbf16_ps(
                        (__m512)a[i], qd,
                        (__m512bh)_mm512_loadu_si512(K + (j0 + i) * ks + d));
            }
            st(s + r * SC + j0, reduce_keys(a) * scl);
        }
    }
}

/* 16-bit lane indices for vpermt2w: lanes (x0[i], x1[i]), i < 16 (PAIR_IDX[0]) or 16 <= i < 32
   (PAIR_IDX[1]): two rows' 32 bf16 as two vectors of 16 pairs. */
static const uint16_t PAIR_IDX[2][32] __attribute__((aligned(64))) = {
    {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47},
    {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63}};

INLINE uint32_t bf16_pair(float lo, float hi) { /* one dword: (bf16(lo), bf16(hi)) */
    return bf16_round(lo) | bf16_round(hi) << 16;
}

/* 32 dims of two V rows (v1 NULL: zeros, a missing odd key) as key pairs: y[0] dims 0-15,
   y[1] dims 16-31, by two vpermt2w. */
INLINE void key_pairs(const uint16_t *v0, const uint16_t *v1, __m512i y[2]) {
    const __m512i x0 = _mm512_loadu_si512(v0);
    const __m512i x1 = v1 ? _mm512_loadu_si512(v1) : _mm512_setzero_si512();
    y[0] = _mm512_permutex2var_epi16(x0, _mm512_load_si512(PAIR_IDX[0]), x1);
    y[1] = _mm512_permutex2var_epi16(x0, _mm512_load_si512(PAIR_IDX[1]), x1);
}

/* A single row's o += sum_j p_j v_j over a bfloat16 V read in place, on vdpbf16ps over pairs
   of keys: two V rows interleaved by two vpermt2w per 32 dims, against (p_j, p_j+1) rounded
   to bf16 and broadcast; 128 dims of o a pass, the key pairs split over two accumulator sets.
   A missing odd key: its V half zero (never read: a cache slot past nv may hold NaN). */
INLINE void accumulate_row_dp(float *o, const float *pr, int64_t D, const uint16_t *V,
                              int64_t ks, int nv) {
    for (int64_t d0 = 0; d0 < D; d0 += 128) {
        const int nd = (int)((D - d0 < 128 ? D - d0 : 128) / 16); /* vectors, even */
        __m512 a[2][8];
        for (int v = 0; v < nd; v++)
            a[0][v] = _mm512_loadu_ps(o + d0 + v * 16), a[1][v] = _mm512_setzero_ps();
        for (int j = 0; j < nv; j += 2) {
            const int s = (j / 2) & 1, two = j + 1 < nv;
            const __m512bh pb =
                (__m512bh)_mm512_set1_epi32((int)bf16_pair(pr[j], two ? pr[j + 1] : 0.0f));
            const uint16_t *v0 = V + j * ks + d0, *v1 = two ? v0 + ks : NULL;
            for (int v = 0; v < nd; v += 2) {
                __m512i y[2];
                key_pairs(v0 + v * 16, v1 ? v1 + v * 16 : NULL, y);
                a[s][v] = _mm512_dpbf16_ps(a[s][v], pb, (__m512bh)y[0]);
                a[s][v + 1] = _mm512_dpbf16_ps(a[s][v + 1], pb, (__m512bh)y[1]);
            }
        }
        for (int v = 0; v < nd; v++)
            _mm512_storeu_ps(o + d0 + v * 16, _mm512_add_ps(a[0][v], a[1][v]));
    }
}

/* accumulate_row_dp for 2..FEW_ROWS-1 rows (grouped-query decode), RB rows x VB vectors of
   D a step: each pair of V rows is interleaved once per step and used by every row of it. */
INLINE void rows_dp_rb(float *obase, const uint32_t *pp, const int RB, int64_t D,
                       const uint16_t *V, int64_t ks, int nv) {
    const int VB = D % 64 == 0 ? 4 : 2; /* vectors of o a step: pairs of them per 32 dims */
    for (int64_t d = 0; d < D; d += VB * 16) {
        __m512 acc[4][4];
        for (int r = 0; r < RB; r++)
            for (int v = 0; v < VB; v++) acc[r][v] = _mm512_loadu_ps(obase + r * D + d + v * 16);
        for (int j = 0; j < nv; j += 2) {
            const uint16_t *v0 = V + j * ks + d, *v1 = j + 1 < nv ? v0 + ks : NULL;
            __m512i y[4];
            for (int v = 0; v < VB; v += 2) key_pairs(v0 + v * 16, v1 ? v1 + v * 16 : NULL, y + v);
            for (int r = 0; r < RB; r++) {
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp[r * (CH / 2) + j / 2]);
                for (int v = 0; v < VB; v++)
                    acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pb, (__m512bh)y[v]);
            }
        }
        for (int r = 0; r < RB; r++)
            for (int v = 0; v < VB; v++) _mm512_storeu_ps(obase + r * D + d + v * 16, acc[r][v]);
    }
}

INLINE void accumulate_rows_dp(float *obase, const float *p, int rows, int64_t D,
                               const uint16_t *V, int64_t ks, int nv) {
    uint32_t pp[FEW_ROWS * CH / 2]; /* each row's p as bf16 pairs of keys; a missing odd 0 */
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < nv; j += 2)
            pp[r * (CH / 2) + j / 2] =
                bf16_pair(p[r * SC + j], j + 1 < nv ? p[r * SC + j + 1] : 0.0f);
    for (int r = 0; r < rows; r += 4) {
        float *o = obase + r * D;
        const uint32_t *pr = pp + r * (CH / 2);
        switch (rows - r < 4 ? rows - r : 4) {
        case 1: rows_dp_rb(o, pr, 1, D, V, ks, nv); break;
        case 2: rows_dp_rb(o, pr, 2, D, V, ks, nv); break;
        case 3: rows_dp_rb(o, pr, 3, D, V, ks, nv); break;
        default: rows_dp_rb(o, pr, 4, D, V, ks, nv);
        }
    }
}
#endif

/* Start the next chunk's row streams (into L2) while this one is computed: chunks come from
   scattered blocks, and a head's rows are Hkv * D apart, a jump the hardware does not follow;
   within a row it does. So one prefetch per row, its first line: prefetching every line of
   every row filled the miss queues and stalled the core (measured 7% slower on a
   prefill-heavy engine run, and slower on every bench_cpu_attention shape). */
INLINE void prefetch_rows(const char *p, int rows, int64_t stride) {
    for (int r = 0; r < rows; r++) __builtin_prefetch(p + r * stride, 0, 2);
}

/* Every line of `rows` rows of `bytes` each, `stride` apart: one head's rows of a chunk, where
   a unit reads all heads' (kvh < 0) head by head, a pattern the hardware does not follow
   (decode rows: one thread read a bf16 cache at ~11 GB/s with PREFETCH alone, ~16 with this). */
INLINE void prefetch_head(const void *p, int rows, int64_t bytes, int64_t stride) {
    for (int r = 0; r < rows; r++)
        for (int64_t l = 0; l < bytes; l += 64)
            __builtin_prefetch((const char *)p + r * stride + l, 0, 2);
}

/* Small key-major tiles (one or two row vectors a head) in all-head units: decode over a
   shared prefix, little compute per chunk against its DRAM traffic. The walk's next chunk is
   one contiguous run of every head's rows; head `part` of `parts` fetches its share of the
   lines into L1, in address order, while its tile computes. With PREFETCH's first line of each
   row alone, the rest of every head's rows were demand misses: 8/8 x 64 decode over groups of
   16 takes 1/1.1-1.26 of that time, 8/8 x 32 1/1.4 (AMD Zen 5, avx512 and avx2 builds; into
   L2 only, 1/1.2 on those prefix units against 1/1.3 into L1). The rest keep PREFETCH: larger
   tiles (prefill, caches hot in L2) ran 2-3% slower with this, d128 rows (8 lines) gained
   nothing, and in the bfloat16 clones the added code slowed row-major decode 8-14%. */
INLINE void prefetch_share(const char *p, int64_t bytes, int part, int parts) {
    const int64_t lines = (bytes + 63) / 64;
    for (int64_t l = lines * part / parts; l < lines * (part + 1) / parts; l++)
        __builtin_prefetch(p + l * 64, 0, 3);
}

/* The first key a unit's walk reads: the chunk holding its window's first visible key (chunks
   start at multiples of CH, so none straddles a block), else 0. */
INLINE int64_t key_start(int64_t win_lo) { return win_lo > 0 ? win_lo / CH * CH : 0; }

/* A unit's normalised rows (nh heads of rh rows from KV head h0; a head's m, l are hs apart)
   and their log-sum-exp, to out (own KV) or pout (a group's prefix). */
INLINE void finish_unit(const args_t *a, const int64_t *u, const scratch_t *w, int rows, int rh,
                        int hs, int64_t h0, const int64_t D) {
    const int64_t H = a->H, R = a->H / a->Hkv, q0 = u[U_Q0];
    float *out = u[U_DST] ? a->pout : a->out;
    float *lse = a->lse + (u[U_DST] ? a->T * H : 0);
    for (int r = 0; r < rows; r++) {
        const int64_t hh = r / rh, rl = r % rh;
        const int64_t row = tok_row(a, q0 + rl / R) * H + (h0 + hh) * R + rl % R;
        const int ml = (int)(hh * hs + rl);
        const float l = w->l[ml], inv = l > 0.0f ? 1.0f / l : 0.0f; /* 0: a window hid all */
        for (int64_t d = 0; d < D; d++) out[row * D + d] = w->o[r * D + d] * inv;
        lse[row] = l > 0.0f ? (w->m[ml] + log2f(l)) * (float)M_LN2 : -INFINITY;
    }
}

/* Row vectors of a key-major tile of `rows` rows (one KV head's). */
INLINE int tile_nv(int rows) { return rows <= L ? 1 : rows <= 2 * L ? 2 : rows <= 4 * L ? 4 : 8; }

/* kvh < 0: all KV heads in this unit, so it streams whole blocks (each chunk's rows of every
   head are contiguous) instead of one head's rows, Hkv * D apart: decode rows (row-major dot
   products) and small key-major tiles (a prefix shared by 8-32 decoding rows), each head with
   its own tile, scores and softmax state in the scratch.
   BF: the cache is bfloat16; every chunk is widened into w->kv first (per head in decode
   units), so the loops below always read float32. */
INLINE void run_unit_d(const args_t *a, const int64_t *u, scratch_t *w, const int64_t D,
                       const int BF) {
    const int64_t H = a->H, R = a->H / a->Hkv, BS = a->BS, ks = a->ks;
    const int64_t q0 = u[U_Q0], nq = u[U_NQ], causal = u[U_CAUSAL], win_lo = u[U_LO];
    const int64_t h0 = u[U_KVH] < 0 ? 0 : u[U_KVH], nh = u[U_KVH] < 0 ? a->Hkv : 1;
    const int rh = (int)(nq * R), rows = (int)(nh * rh); /* rows per head, in all */
    const int few = rh < (BF ? FEW_ROWS : FEW_ROWS_F32(D)); /* row-major; else key-major */
    const int NV = few ? 0 : tile_nv(rh);
    const int RP = NV * L, hs = few ? rh : RP; /* a head's tile rows; its m, l stride */
#ifdef HAVE_BF16DP
    /* bf16 decode rows: q . k on vdpbf16ps (scores_dot_bf16) against unscaled bf16 queries */
    const int dot_bf16 = BF && few && D % 32 == 0;
    uint32_t *qb = (uint32_t *)w->qtk;
#endif
    for (int r = 0; r < rows; r++) {
        const int64_t hh = r / rh, rl = r % rh;
        float qb_[MAX_D];
        const float *src = q_f32(a, q0 + rl / R, (h0 + hh) * R + rl % R, D, qb_);
#ifdef HAVE_BF16DP
        if (dot_bf16) { /* instead of the scaled float32 queries, which they never read */
            for (int64_t d = 0; d < D; d += 32)
                _mm512_storeu_si512(qb + r * (D / 2) + d / 2,
                                    (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + d + 16),
                                                                 _mm512_loadu_ps(src + d)));
            continue;
        }
#endif
        for (int64_t d = 0; d < D; d++) w->qs[r * D + d] = src[d] * a->qscale;
    }
    for (int r = 0; r < nh * hs; r++) w->m[r] = -INFINITY, w->l[r] = 0.0f;
    if (!few)
        for (int64_t hh = 0; hh < nh; hh++) {
            float *qt = w->qtk + hh * D * RP;
            const float *qh = w->qs + hh * rh * D;
            for (int64_t d = 0; d < D; d++)
                for (int r = 0; r < RP; r++) qt[d * RP + r] = r < rh ? qh[r * D + d] : 0.0f;
        }
    memset(w->o, 0, sizeof(float) * rows * D);
    int64_t kend = u[U_NKEYS];
    if (causal + nq < kend) kend = causal + nq; /* keys past the last query's limit */
    const int32_t *blocks = a->blocks + u[U_BLK];
#define KV_AT(key) ((int64_t)blocks[(key) / BS] * a->bstr + ((key) % BS) * ks + h0 * a->hstr)
    const int64_t eb = BF ? 2 : 4; /* bytes per cache element */
/* Key-major tiles of more than 2 * L rows a head (prefill; decode over a prefix shared by 9+
   rows of 4 query heads a KV head) fetch every line of each head's next chunk, a few rows per
   step of that head's tile (pf_t); with the cheaper exp2v, 4-13% less time on the prefill
   shapes at 8/2 and 8/8 x 128 and 8/8 x 64 (one thread, Intel Xeon, avx512 build; avx2 build
   0-3%). In all-head units at D > 32 too, where head 0's first lines alone were fetched:
   decode over groups of 16, caches cold as a model's layers leave them, 8/2 x 128 1/1.11-1.17
   of the time, 8/2 and 16/2 x 64 1/1.38-1.41 (avx2 1/1.14-1.18), small-batch prefill
   1/1.04-1.13 (AMD Zen 5; bf16 caches even; at 8/8 x 32 0.93x, so not at D = 32). The others
   (decode rows, small tiles, whose compute per chunk is short) prefetch each row's first
   line. */
    const int spread = !few && NV >= 4 && (nh == 1 || D > 32);
    /* all-head float32 tiles of one or two row vectors at D <= 64: prefetch_share */
    const int share = !BF && D <= 64 && !few && nh > 1 && NV < 4;
#define PREFETCH(base, key)                                                                   \
    do {                                                                                      \
        if ((key) < kend)                                                                     \
            prefetch_rows((const char *)(base) + KV_AT(key) * eb,                             \
                          kend - (key) < CH ? (int)(kend - (key)) : CH, ks * eb);             \
    } while (0)
/* bf16 decode rows: head hh's lines of the walk's next chunk (prefetch_head). */
#define PREFETCH_HEAD(hh)                                                                     \
    do {                                                                                      \
        const int64_t nk = c + CH < n ? kb + c + CH : pass_v ? kb + SC : kb;                  \
        if (nk < kend) {                                                                      \
            const void *nb = c + CH < n ? cache : pass_v ? a->k : a->v;                       \
            prefetch_head((const char *)nb + (KV_AT(nk) + (hh) * a->hstr) * eb,                    \
                          kend - nk < CH ? (int)(kend - nk) : CH, D * eb, ks * eb);           \
        }                                                                                     \
    } while (0)
/* head hh's key-major tile */
#define TILE(hh) ((tile_t){w->s + (hh) * SC * RP, w->m + (hh) * RP, w->l + (hh) * RP,         \
                           w->o + (hh) * rh * D})
    for (int64_t kb = key_start(win_lo); kb < kend; kb += SC) {
        const int n = kend - kb < SC ? (int)(kend - kb) : SC;
        /* Two walks over the span's chunks: K (scores), then V (weighted sum) after softmax;
           unrolled, so each walk is compiled with its own work. */
#pragma GCC unroll 2
        for (int pass_v = 0; pass_v < 2; pass_v++) {
            const void *cache = pass_v ? a->v : a->k;
            if (pass_v && few)
                softmax_span(w, rows, rh, R, D, causal, win_lo, kb, n);
            else if (pass_v)
                for (int64_t hh = 0; hh < nh; hh++)
                    softmax_km(TILE(hh), rh, NV, R, D, causal, win_lo, kb, n, 1.0f);
            for (int c = 0; c < n; c += CH) {
                const int nv = n - c < CH ? n - c : CH;
                const int64_t at = KV_AT(kb + c);
                /* the walk's next chunk: this walk's, the next span's first K chunk, or the
                   span's first V chunk */
                const int64_t nk = c + CH < n ? kb + c + CH : pass_v ? kb + SC : kb;
                const void *nc = c + CH < n ? cache : pass_v ? a->k : a->v;
                if (!spread && !share)
                    PREFETCH(nc, nk);
#define PF_SHARE(base, key, hh)                                                               \
    do {                                                                                      \
        if (share && (key) < kend)                                                            \
            prefetch_share((const char *)(base) + KV_AT(key) * eb,                            \
                           (kend - (key) < CH ? kend - (key) : CH) * ks * eb, (int)(hh),      \
                           (int)nh);                                                          \
    } while (0)
/* one head's prefill-size tile: every line of its next chunk, spread over the tile's steps */
#define PF_KEY(base, key, hh)                                                                 \
    ((pf_t){spread && (key) < kend ? (const char *)(base) + (KV_AT(key) + (hh) * a->hstr) * eb \
                                   : NULL,                                                     \
            ks * eb, D * eb, kend - (key) < CH ? (int)(kend - (key)) : CH})
#define PF(hh) PF_KEY(nc, nk, hh)
                if (few)
                    for (int64_t hh = 0; hh < nh; hh++) {
                        /* float32 all-head units at D <= 64 too: a head's 2-4 lines a row,
                           1 KiB apart, defeat the hardware prefetcher (d32 decode over shared
                           prefixes 0.50-0.90x the time); and at any D where a head has several
                           rows (GQA decode): their compute no longer hides the misses the
                           hardware leaves (8/2 x 128 decode 0.71-0.89x the time, Zen 4, avx512
                           and avx2 builds); one row a head at d128 streams, no gain */
                        if (BF || (nh > 1 && (D <= 64 || rh > 1)))
                            PREFETCH_HEAD(hh);
#ifdef HAVE_BF16DP
                        if (dot_bf16) { /* the cache in place */
                            const uint16_t *x = (const uint16_t *)cache + at + hh * a->hstr;
                            float *s = w->s + hh * rh * SC + c;
                            if (pass_v && rh == 1)
                                accumulate_row_dp(w->o + hh * D, s, D, x, ks, nv);
                            else if (pass_v)
                                accumulate_rows_dp(w->o + hh * rh * D, s, rh, D, x, ks, nv);
                            else
                                scores_dot_bf16(qb + hh * rh * (D / 2), s, rh, D, x, ks, nv,
                                                a->qscale);
                            continue;
                        }
#endif
                        int64_t st;
                        const float *x = head_rows(w->kv, cache, at + hh * a->hstr, nv, D, ks, BF, &st);
                        float *s = w->s + hh * rh * SC + c;
                        if (pass_v)
                            accumulate_rows(w->o + hh * rh * D, s, rh, D, x, st, nv);
                        else
                            scores_dot(w->qs + hh * rh * D, s, rh, D, x, st, nv);
                    }
                else if (pass_v) { /* chunks in pairs (accumulate_km): at the first */
                    /* avx512 at D > 64: 1-4% less time on 8/2 and 8/8 x 128 prefill and
                       shared-prefix decode; d64 (accumulators stay in L1) and avx2: none */
                    const int pair = L == 16 && D > 64;
                    if (pair && c % (2 * CH)) continue;
                    const int rest = n - c - CH; /* keys after this chunk in the span */
                    const int nv1 = !pair || rest <= 0 ? 0 : rest < CH ? rest : CH;
                    const int64_t at1 = nv1 ? KV_AT(kb + c + CH) : at;
                    /* the walk's two chunks after the pair: this span's V, or the next K */
#define PF_AT(off, hh)                                                                        \
    (c + (off) < n ? PF_KEY(a->v, kb + c + (off), hh) : PF_KEY(a->k, kb + SC + c + (off) - n, hh))
                    for (int64_t hh = 0; hh < nh; hh++) {
                        PF_SHARE(nc, nk, hh); /* share: D <= 64, so never in pairs */
                        /* V rows re-read per 4 query rows: a packed copy where they share an
                           L1 set (pack), else in place (1-2% less time) */
                        const int inplace = rows_in_place(ks, BF);
                        const int64_t ho = hh * a->hstr;
                        const float *x0 = inplace ? (const float *)cache + at + ho
                                                  : packed_rows(w->kv, cache, at + ho, nv, D, ks, BF);
                        const float *x1 = inplace ? (const float *)cache + at1 + ho
                                                  : packed_rows(w->kv + CH * D, cache, at1 + ho,
                                                                nv1, D, ks, BF);
                        accumulate_km(w->o + hh * rh * D, w->s + hh * SC * RP + c * RP, RP, rh,
                                      D, x0, x1, inplace ? ks : D, nv, nv1,
                                      pair ? PF_AT(2 * CH, hh) : PF(hh),
                                      pair ? PF_AT(3 * CH, hh) : (pf_t){0});
                    }
#undef PF_AT
                }
                else if (NV >= 4) /* K read in place: once per 4 row vectors, 4 keys at a */
                    for (int64_t hh = 0; hh < nh; hh++) { /* time (more rows Hkv * D apart */
                        int64_t st;                         /* thrash an L1 set) */
                        const float *x = head_rows(w->kv, cache, at + hh * a->hstr, nv, D, ks, BF, &st);
                        scores_km(w->qtk + hh * D * RP, w->s + hh * SC * RP + c * RP, NV, D, x,
                                  st, nv, PF(hh));
                    }
                else
                    for (int64_t hh = 0; hh < nh; hh++) {
                        /* small tiles: K packed, or in place where rows are not 4 KiB apart
                           at D <= 64 on avx512 (8/8 x 64 decode over prefixes shared by 16-24
                           rows 1.04-1.10x; d128 and avx2 measured none: a compile-time test,
                           as a runtime one slowed the D = 128 clone's code by 5-9%) */
                        PF_SHARE(nc, nk, hh);
                        const int inplace = L == 16 && D <= 64 && rows_in_place(ks, BF);
                        scores_km(w->qtk + hh * D * RP, w->s + hh * SC * RP + c * RP, NV, D,
                                  inplace ? (const float *)cache + at + hh * a->hstr
                                          : packed_rows(w->kv, cache, at + hh * a->hstr, nv, D,
                                                        ks, BF),
                                  inplace ? ks : D, nv, PF(hh));
                    }
            }
        }
    }
#undef KV_AT
#undef PREFETCH
#undef PREFETCH_HEAD
#undef PF
#undef PF_KEY
#undef PF_SHARE
#undef TILE
    finish_unit(a, u, w, rows, rh, hs, h0, D);
}


#ifdef HAVE_BF16DP
/* bfloat16 caches on vdpbf16ps (AVX512-BF16): c[i] += a[2i] b[2i] + a[2i+1] b[2i+1], 16 lanes
   of float32, so one instruction sums a pair of products. Key-major tiles as in
   scores_km/accumulate_km, but over pairs: scores pair the dims (each key's pair broadcast
   from the cache in place, against the rows' pairs packed once per unit), P.V pairs the keys
   (two V rows interleaved per span, against each row's two probabilities broadcast). Half the
   multiply instructions of the float32 tiles and no widening of the cache. Products of bf16
   values summed in float32: queries rounded to bf16 (those of a bf16 model are exact), P
   rounded to bf16 as flash attention does on GPUs (and the AMX path). Needs D % 32 == 0. */
/* Two bf16 vectors' lanes as pairs: dword i = (lo[i], hi[i]). */
INLINE __m512i pair16(__m256i lo, __m256i hi) {
    return _mm512_or_si512(_mm512_cvtepu16_epi32(lo),
                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

/* A chunk's key-major scores for M row vectors: qv [D/2][RP] (the rows' dim pairs), K's
   rows ks apart, KB keys x M vectors of accumulators; partial sums over DSPLIT dims at a
   time, as scores_km_nv. */
INLINE void scores_dp_m(const uint32_t *qv, float *sk, const int M, const int KB, int RP,
                        int64_t D, const uint16_t *K, int64_t ks, int nv) {
    for (int64_t p0 = 0; p0 < D / 2; p0 += DSPLIT / 2) {
        const int64_t p1 = p0 + DSPLIT / 2 < D / 2 ? p0 + DSPLIT / 2 : D / 2;
        for (int j0 = 0; j0 < nv; j0 += KB) {
            const uint16_t *k = K + j0 * ks;
            __m512 a[16];
            for (int i = 0; i < KB; i++)
                for (int v = 0; v < M; v++)
                    a[i * M + v] = p0 && j0 + i < nv ? _mm512_loadu_ps(sk + (j0 + i) * RP + v * 16)
                                                     : _mm512_setzero_ps();
            for (int64_t p = p0; p < p1; p++) {
                __m512bh q[4];
                for (int v = 0; v < M; v++)
                    q[v] = (__m512bh)_mm512_loadu_si512(qv + p * RP + v * 16);
                for (int i = 0; i < KB; i++) {
                    uint32_t kk; /* keys past nv: rows of the same block, masked later */
                    memcpy(&kk, k + i * ks + 2 * p, 4);
                    const __m512bh kp = (__m512bh)_mm512_set1_epi32((int)kk);
                    for (int v = 0; v < M; v++)
                        a[i * M + v] = _mm512_dpbf16_ps(a[i * M + v], kp, q[v]);
                }
            }
            for (int i = 0; i < KB && j0 + i < nv; i++)
                for (int v = 0; v < M; v++)
                    _mm512_storeu_ps(sk + (j0 + i) * RP + v * 16, a[i * M + v]);
        }
    }
}

INLINE void scores_dp(const uint32_t *qv, float *sk, int M, int64_t D, const uint16_t *K,
                      int64_t ks, int nv) {
    switch (M) { /* M constant in each clone: the accumulators stay in registers */
    case 1: scores_dp_m(qv, sk, 1, 16, 16, D, K, ks, nv); break;
    case 2: scores_dp_m(qv, sk, 2, 8, 32, D, K, ks, nv); break;
    case 3: scores_dp_m(qv, sk, 3, 4, 48, D, K, ks, nv); break;
    default: scores_dp_m(qv, sk, 4, 4, 64, D, K, ks, nv); break;
    }
}

/* RB rows of pv_dp (o0, pp at the first of them): RB x AV accumulators, each a chain over
   the key pairs in order (a row's sums the same whichever step takes it). */
INLINE void pv_dp_rows(float *o0, const uint32_t *pp, int RP, const int RB, int64_t D,
                       const uint32_t *vv, int np) {
    const int AV = div_le((int)(D / 16), RB >= 3 ? 4 : 8); /* <= 24 of 32 zmm live */
    for (int64_t d = 0; d < D; d += AV * 16) {
        __m512 acc[4][8];
        for (int i = 0; i < RB; i++)
            for (int v = 0; v < AV; v++) acc[i][v] = _mm512_loadu_ps(o0 + i * D + d + v * 16);
        for (int jp = 0; jp < np; jp++) {
            const uint32_t *vj = vv + jp * D + d, *pj = pp + jp * RP;
            __m512bh x[8];
            for (int v = 0; v < AV; v++) x[v] = (__m512bh)_mm512_loadu_si512(vj + v * 16);
            for (int i = 0; i < RB; i++) {
                const __m512bh pi = (__m512bh)_mm512_set1_epi32((int)pj[i]);
                for (int v = 0; v < AV; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], pi, x[v]);
            }
        }
        for (int i = 0; i < RB; i++)
            for (int v = 0; v < AV; v++) _mm512_storeu_ps(o0 + i * D + d + v * 16, acc[i][v]);
    }
}

/* o[r] += sum over key pairs jp of (P pair pp[jp * RP + r]) . (V pair row vv[jp * D]), for
   `rows` rows of D: 4 rows a step, the last 1-3 in one step (one at a time was a chain of
   dependent vdpbf16ps per vector over the whole span: 63-row tiles, 3 or 7 query heads per KV
   head, spent 7.6% of a prefill unit's cycles on their last 3 rows; perf, AMD Zen 4). */
INLINE void pv_dp(float *obase, const uint32_t *pp, int RP, int rows, int64_t D,
                  const uint32_t *vv, int np) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) pv_dp_rows(obase + r * D, pp + r, RP, 4, D, vv, np);
    float *o = obase + r * D;
    switch (rows - r) { /* RB constant in each clone */
    case 1: pv_dp_rows(o, pp + r, RP, 1, D, vv, np); break;
    case 2: pv_dp_rows(o, pp + r, RP, 2, D, vv, np); break;
    case 3: pv_dp_rows(o, pp + r, RP, 3, D, vv, np); break;
    default: break;
    }
}

/* A span's probabilities (key-major float32 s, n keys, M row vectors) as bf16 key pairs,
   pp[jp * RP + r]; a missing odd key's half zero. */
INLINE void pack_p_pairs(uint32_t *pp, const float *s, int RP, int M, int n) {
    for (int jp = 0; jp < (n + 1) / 2; jp++)
        for (int v = 0; v < M; v++) {
            const __m512 lo = _mm512_loadu_ps(s + 2 * jp * RP + v * 16);
            const __m512 hi = 2 * jp + 1 < n ? _mm512_loadu_ps(s + (2 * jp + 1) * RP + v * 16)
                                             : _mm512_setzero_ps();
            const __m256i l16 = (__m256i)_mm512_cvtneps_pbh(lo);
            _mm512_storeu_si512(pp + jp * RP + v * 16,
                                pair16(l16, (__m256i)_mm512_cvtneps_pbh(hi)));
        }
}

/* A key-major unit (>= FEW_ROWS rows per head) over a bfloat16 cache: one KV head, or all of
   them (kvh < 0: each chunk's rows of every head are one contiguous stream, as run_unit_d).
   Per head, a tile of M = rows / 16 (rounded up) row vectors: its queries' dim pairs in
   w->qtk, its scores in w->s, m and l RP apart; per span, its V and P pairs in w->vv, w->pp. */
INLINE void run_unit_dp(const args_t *a, const int64_t *u, scratch_t *w, const int64_t D) {
    const int64_t H = a->H, R = a->H / a->Hkv, BS = a->BS, ks = a->ks;
    const int64_t q0 = u[U_Q0], nq = u[U_NQ], causal = u[U_CAUSAL], win_lo = u[U_LO];
    const int64_t h0 = u[U_KVH] < 0 ? 0 : u[U_KVH], nh = u[U_KVH] < 0 ? a->Hkv : 1;
    const int rh = (int)(nq * R), M = (rh + 15) / 16, RP = M * 16;
    uint32_t *qv = (uint32_t *)w->qtk; /* head hh's pairs at hh * (D / 2) * RP */
    for (int64_t hh = 0; hh < nh; hh++)
        for (int r = 0; r < RP; r++) {
            float qb_[MAX_D];
            const float *src =
                r < rh ? q_f32(a, q0 + r / R, (h0 + hh) * R + r % R, D, qb_) : NULL;
            for (int64_t p = 0; p < D / 2; p++)
                qv[(hh * (D / 2) + p) * RP + r] =
                    r < rh ? bf16_pair(src[2 * p], src[2 * p + 1]) : 0;
            w->m[hh * RP + r] = -INFINITY, w->l[hh * RP + r] = 0.0f;
        }
    memset(w->o, 0, sizeof(float) * nh * rh * D);
    int64_t kend = u[U_NKEYS];
    if (causal + nq < kend) kend = causal + nq;
    const int32_t *blocks = a->blocks + u[U_BLK];
    const uint16_t *kc = a->k, *vc = a->v;
#define KV_AT(key) ((int64_t)blocks[(key) / BS] * a->bstr + ((key) % BS) * ks + h0 * a->hstr)
#define PREFETCH(base, key)                                                                   \
    do {                                                                                      \
        if ((key) < kend)                                                                     \
            prefetch_rows((const char *)((base) + KV_AT(key)),                                \
                          kend - (key) < CH ? (int)(kend - (key)) : CH, ks * 2);              \
    } while (0)
    for (int64_t kb = key_start(win_lo); kb < kend; kb += SC) {
        const int n = kend - kb < SC ? (int)(kend - kb) : SC, np = (n + 1) / 2;
        for (int c = 0; c < n; c += CH) {
            const int nv = n - c < CH ? n - c : CH;
            PREFETCH(c + CH < n ? kc : vc, c + CH < n ? kb + c + CH : kb);
            const int64_t at = KV_AT(kb + c);
            for (int64_t hh = 0; hh < nh; hh++) {
                if (nh > 1 && c + CH < n) /* all heads: head hh's lines of the next chunk */
                    prefetch_head(kc + KV_AT(kb + c + CH) + hh * a->hstr,
                                  n - c - CH < CH ? n - c - CH : CH, D * 2, ks * 2);
                scores_dp(qv + hh * (D / 2) * RP, w->s + hh * SC * RP + c * RP, M, D,
                          kc + at + hh * a->hstr, ks, nv);
            }
        }
        for (int64_t hh = 0; hh < nh; hh++) {
            float *o = w->o + hh * rh * D;
            softmax_km((tile_t){w->s + hh * SC * RP, w->m + hh * RP, w->l + hh * RP, o}, rh, M,
                       R, D, causal, win_lo, kb, n, a->qscale);
            for (int jp = 0; jp < np; jp++) { /* V in key pairs; a key past n zero */
                if (2 * jp + 17 < n) /* 8 pairs ahead (one pair: one chunk): rows Hkv * D apart */
                    prefetch_head(vc + KV_AT(kb + 2 * jp + 16) + hh * a->hstr, 2, D * 2, ks * 2);
                const uint16_t *v0 = vc + KV_AT(kb + 2 * jp) + hh * a->hstr; /* v1: the same chunk */
                const uint16_t *v1 = 2 * jp + 1 < n ? v0 + ks : NULL;
                for (int64_t d = 0; d < D; d += 32) {
                    __m512i y[2];
                    key_pairs(v0 + d, v1 ? v1 + d : NULL, y);
                    _mm512_storeu_si512(w->vv + jp * D + d, y[0]);
                    _mm512_storeu_si512(w->vv + jp * D + d + 16, y[1]);
                }
            }
            pack_p_pairs(w->pp, w->s + hh * SC * RP, RP, M, n);
            pv_dp(o, w->pp, RP, rh, D, w->vv, np);
        }
        if (kb + SC < kend) PREFETCH(kc, kb + SC);
    }
#undef KV_AT
#undef PREFETCH
    finish_unit(a, u, w, nh * rh, rh, RP, h0, D);
}
#endif

#ifdef HAVE_AMX
/* AMX (bfloat16 caches, key-major tiles, D % 32 == 0). Eight tile registers, all 16 rows x 64
   bytes: a tile multiply C[16][16] += A[16][32 bf16] B[16 pairs][16 x 2 bf16] (B holds K-dim
   pairs side by side, "VNNI"). Scores come out transposed, S^T = K Q^T: A is 16 keys read in
   place from the cache (rows Hkv * D apart, no copy), B the unit's queries packed once, and
   S^T lands key-major, the layout softmax_km reads. P V needs P row-major (A) and V in key
   pairs (B): both are packed per span of SC keys. Products of bf16 values summed in float32;
   queries are those of a bf16 model (exact in bf16), P is rounded to bf16 as flash attention
   does on GPUs. */
static int amx_ok; /* the OS granted this process AMX tile state (batchjob_paged_attention) */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

static void amx_configure(void) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
    _tile_loadconfig(&c);
}

/* r[i] lane j <- r[j] lane i (16 x 16 dwords): two unpack stages within 128-bit lanes, then
   two 128-bit lane shuffles. */
INLINE void transpose16(__m512i *r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i u0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
        const __m512i u1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
        const __m512i v0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        const __m512i v1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
        t[c] = _mm512_shuffle_i32x4(u0, v0, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(u0, v0, 0xDD);
        t[8 + c] = _mm512_shuffle_i32x4(u1, v1, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(u1, v1, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* S^T of one 16-key chunk for M row tiles: tiles 0..M-1 accumulate, 4 holds a K slice of
   32 dims, 5-7 the queries' matching slice. sk: key-major scores, rows RP apart. */
INLINE void amx_scores(const scratch_t *w, float *sk, int RP, int M, int64_t D,
                       const uint16_t *K, int64_t ks) {
    _tile_zero(0);
    if (M > 1) _tile_zero(1);
    if (M > 2) _tile_zero(2);
    if (M > 3) _tile_zero(3);
    for (int64_t kd = 0; kd < D / 32; kd++) {
        _tile_loadd(4, K + kd * 32, ks * 2);
        _tile_loadd(5, w->qv[0][kd * 16], 64);
        _tile_dpbf16ps(0, 4, 5);
        if (M > 1) {
            _tile_loadd(6, w->qv[1][kd * 16], 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (M > 2) {
            _tile_loadd(7, w->qv[2][kd * 16], 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (M > 3) {
            _tile_loadd(5, w->qv[3][kd * 16], 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, sk, RP * 4);
    if (M > 1) _tile_stored(1, sk + 16, RP * 4);
    if (M > 2) _tile_stored(2, sk + 32, RP * 4);
    if (M > 3) _tile_stored(3, sk + 48, RP * 4);
}

/* A span's probabilities (key-major float32, n keys) as row-major bf16 A tiles of 32 keys,
   keys n .. the tile's end zero: pairs of keys side by side, then a 16 x 16 dword transpose. */
INLINE void amx_pack_p(scratch_t *w, int RP, int M, int n) {
    for (int m = 0; m < M; m++)
        for (int kk = 0; kk * 32 < n; kk++) {
            __m512i x[16];
            for (int p = 0; p < 16; p++) {
                const int j = kk * 32 + 2 * p;
                const __m512 lo =
                    j < n ? _mm512_loadu_ps(w->s + j * RP + m * 16) : _mm512_setzero_ps();
                const __m512 hi = j + 1 < n ? _mm512_loadu_ps(w->s + (j + 1) * RP + m * 16)
                                            : _mm512_setzero_ps();
                x[p] = pair16((__m256i)_mm512_cvtneps_pbh(lo), (__m256i)_mm512_cvtneps_pbh(hi));
            }
            transpose16(x);
            for (int r = 0; r < 16; r++) _mm512_storeu_si512(w->pa[m][kk][r], x[r]);
        }
}

/* o[rows][D] += P V over a span: per row tile, up to 4 output tiles of 16 dims (0-3) stay in
   tiles across the span's 32-key steps; 4 holds P, 5-7 V. */
INLINE void amx_pv(scratch_t *w, int M, int64_t D, int n) {
    const int nk = (n + 31) / 32, nd = (int)(D / 16);
    for (int m = 0; m < M; m++)
        for (int d0 = 0; d0 < nd; d0 += 4) {
            const int c = nd - d0 < 4 ? nd - d0 : 4;
            float *o = w->o + m * 16 * D + d0 * 16;
            _tile_loadd(0, o, D * 4);
            if (c > 1) _tile_loadd(1, o + 16, D * 4);
            if (c > 2) _tile_loadd(2, o + 32, D * 4);
            if (c > 3) _tile_loadd(3, o + 48, D * 4);
            for (int kk = 0; kk < nk; kk++) {
                const uint32_t *v = w->vv + kk * 16 * D + d0 * 16;
                _tile_loadd(4, w->pa[m][kk], 64);
                _tile_loadd(5, v, D * 4);
                _tile_dpbf16ps(0, 4, 5);
                if (c > 1) {
                    _tile_loadd(6, v + 16, D * 4);
                    _tile_dpbf16ps(1, 4, 6);
                }
                if (c > 2) {
                    _tile_loadd(7, v + 32, D * 4);
                    _tile_dpbf16ps(2, 4, 7);
                }
                if (c > 3) {
                    _tile_loadd(5, v + 48, D * 4);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            _tile_stored(0, o, D * 4);
            if (c > 1) _tile_stored(1, o + 16, D * 4);
            if (c > 2) _tile_stored(2, o + 32, D * 4);
            if (c > 3) _tile_stored(3, o + 48, D * 4);
        }
}

/* One key-major unit (one KV head, >= FEW_ROWS rows per head) over a bf16 cache on AMX. */
INLINE void run_unit_amx(const args_t *a, const int64_t *u, scratch_t *w, const int64_t D) {
    const int64_t H = a->H, R = a->H / a->Hkv, BS = a->BS, ks = a->ks;
    const int64_t q0 = u[U_Q0], nq = u[U_NQ], causal = u[U_CAUSAL], h0 = u[U_KVH];
    const int64_t win_lo = u[U_LO];
    const int rows = (int)(nq * R), M = (rows + 15) / 16, RP = M * 16;
    for (int r = 0; r < RP; r++) { /* queries as bf16 pairs of dims, transposed; pad rows 0 */
        float qb_[MAX_D];
        const float *src = r < rows ? q_f32(a, q0 + r / R, h0 * R + r % R, D, qb_) : NULL;
        for (int64_t p = 0; p < D / 2; p++)
            w->qv[r / 16][p][r % 16] =
                r < rows ? bf16_pair(src[2 * p], src[2 * p + 1]) : 0;
        w->m[r] = -INFINITY, w->l[r] = 0.0f;
    }
    memset(w->o, 0, sizeof(float) * RP * D);
    int64_t kend = u[U_NKEYS];
    if (causal + nq < kend) kend = causal + nq;
    const int32_t *blocks = a->blocks + u[U_BLK];
    const uint16_t *kc = a->k, *vc = a->v;
#define KV_AT(key) ((int64_t)blocks[(key) / BS] * a->bstr + ((key) % BS) * ks + h0 * a->hstr)
    amx_configure();
    for (int64_t kb = key_start(win_lo); kb < kend; kb += SC) {
        const int n = kend - kb < SC ? (int)(kend - kb) : SC;
        for (int c = 0; c < n; c += CH) {
            if (c + CH < n) /* the next chunk's K rows */
                prefetch_rows((const char *)(kc + KV_AT(kb + c + CH)), CH, ks * 2);
            amx_scores(w, w->s + c * RP, RP, M, D, kc + KV_AT(kb + c), ks);
        }
        softmax_km((tile_t){w->s, w->m, w->l, w->o}, rows, M, R, D, causal, win_lo, kb, n,
                   a->qscale);
        const uint16_t *vrow = vc; /* a 16-key chunk's first V row: chunks never straddle a
                                      block, so one block-table lookup per chunk */
        for (int j = 0; j < (n + 31) / 32 * 16; j++) { /* V in key pairs; keys past n zero */
            const int key = 2 * j;
            if (key % CH == 0 && key < n) vrow = vc + KV_AT(kb + key);
            const uint16_t *v0 = key < n ? vrow + (key % CH) * ks : NULL;
            const uint16_t *v1 = key + 1 < n ? vrow + (key % CH + 1) * ks : NULL;
            for (int64_t d = 0; d < D; d += 16) {
                const __m256i lo = v0 ? _mm256_loadu_si256((const __m256i *)(v0 + d))
                                      : _mm256_setzero_si256();
                const __m256i hi = v1 ? _mm256_loadu_si256((const __m256i *)(v1 + d))
                                      : _mm256_setzero_si256();
                _mm512_storeu_si512(w->vv + j * D + d, pair16(lo, hi));
            }
        }
        if (kb + SC < kend) /* the next span's first K chunk */
            prefetch_rows((const char *)(kc + KV_AT(kb + SC)), CH, ks * 2);
        amx_pack_p(w, RP, M, n);
        amx_pv(w, M, D, n);
    }
#undef KV_AT
    finish_unit(a, u, w, rows, rows, rows, h0, D);
}
#endif

/* One clone per common head dim, so D is a compile-time constant in the inner loops:
   FN(a, u, w, D, extra arguments). */
#define BY_D(FN, ...)                                                                         \
    switch (a->D) {                                                                           \
    case 32: FN(a, u, w, 32, ##__VA_ARGS__); break;                                           \
    case 64: FN(a, u, w, 64, ##__VA_ARGS__); break;                                           \
    case 96: FN(a, u, w, 96, ##__VA_ARGS__); break;                                           \
    case 128: FN(a, u, w, 128, ##__VA_ARGS__); break;                                         \
    case 256: FN(a, u, w, 256, ##__VA_ARGS__); break;                                         \
    default: FN(a, u, w, a->D, ##__VA_ARGS__);                                                \
    }
static void run_unit_f32(const args_t *a, const int64_t *u, scratch_t *w) { BY_D(run_unit_d, 0) }
static void run_unit_bf16(const args_t *a, const int64_t *u, scratch_t *w) {
    const int tile = a->D % 32 == 0 && u[U_NQ] * (a->H / a->Hkv) >= FEW_ROWS; /* key-major */
#ifdef HAVE_AMX
    if (amx_ok && tile && u[U_KVH] >= 0) {
        BY_D(run_unit_amx)
        return;
    }
#endif
#ifdef HAVE_BF16DP
    if (tile) {
        BY_D(run_unit_dp)
        return;
    }
#endif
    (void)tile;
    BY_D(run_unit_d, 1)
}

/* Whether this build's bf16 prefill tiles run on AMX here: the OS must grant the process the
   tile state once (Linux >= 5.16, arch_prctl ARCH_REQ_XCOMP_PERM); else they take the AVX-512
   path. */
int batchjob_kernel_amx(void) {
#ifdef HAVE_AMX
    static int asked;
    if (!asked) {
        amx_ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                         18 /* XFEATURE_XTILEDATA */) == 0;
        asked = 1;
    }
    return amx_ok;
#else
    return 0;
#endif
}

/* What this build is: the Python side sizes its work units by these. */
const char *batchjob_kernel_isa(void) { return ISA_NAME; }
int batchjob_kernel_lanes(void) { return L; }
int batchjob_kernel_max_rows(void) { return MAX_ROWS; }
/* All-KV-head units: Hkv x head_rows(rows per head) <= max_whole_rows. */
int batchjob_kernel_max_whole_rows(void) { return MAX_WROWS; }

/* Scratch rows one KV head takes in an all-head unit of rh rows per head (at most: float32
   units row-major past FEW_ROWS take rh <= these). */
int batchjob_kernel_head_rows(int64_t rh) { return rh < FEW_ROWS ? (int)rh : tile_nv((int)rh) * L; }

/* Per-thread scratch, allocated on a thread's first call and kept (OpenMP threads persist):
   no allocation per call. */
static __thread scratch_t *tls_scratch;

/* As batchjob_paged_attention, for caches of any layout whose key rows hold a head's D
   elements contiguously: element (block b, key row i, KV head h, d) of the K (V) cache at
   k_cache (v_cache) + b * bstr + i * ks + h * hstr + d. vLLM's CPU cache, one tensor
   [blocks, Hkv, 2, BS, D] (K rows then V rows per head), is bstr = Hkv * 2 * BS * D,
   ks = D, hstr = 2 * BS * D, v_cache = k_cache + BS * D.
   tokens: NULL, or int64 [T], a permutation of 0..T-1: the units' token t is row tokens[t] of
   q, out, pout and lse (a caller's batch order, read and written in place: no gather of q or
   scatter of out around the call). q_stride: elements from one token's queries to the next
   (H * D when q is contiguous; a row of a fused QKV projection's output otherwise).
   q_bf16: q holds bfloat16 values (each widened exactly as it is read: a bf16 model's
   queries need no float32 copy). out_bf16: NULL, or bfloat16 [T, H, D] receiving out rounded
   to nearest even after the merge (out still holds the float32 result).
   Returns 0, or a negative code for arguments the kernel does not support. */
int batchjob_paged_attention_strided(const void *q, const void *k_cache, const void *v_cache,
                                     const int32_t *blocks, const int64_t *units,
                                     int64_t n_units, int64_t T, int64_t H, int64_t Hkv,
                                     int64_t D, int64_t BS, int64_t bstr, int64_t ks,
                                     int64_t hstr, const int64_t *tokens, int64_t q_stride,
                                     float scale, float *out, float *pout, float *lse,
                                     int n_threads, int kv_bf16, int q_bf16,
                                     uint16_t *out_bf16) {
    if (D % L || D > MAX_D || BS % CH || Hkv <= 0 || H % Hkv) return -1;
    if (ks < D || hstr < D || bstr < BS * ks || q_stride < H * D) return -1;
    for (int64_t t = 0; tokens && t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= T) return -1;
    for (int64_t i = 0; i < n_units; i++) {
        const int64_t rh = units[i * U_FIELDS + U_NQ] * (H / Hkv);
        const int all = units[i * U_FIELDS + U_KVH] < 0;
        if (rh > MAX_ROWS || (all && Hkv * batchjob_kernel_head_rows(rh) > MAX_WROWS)) return -2;
    }
    const args_t a = {q, k_cache, v_cache, blocks, out, pout, lse, T, H, Hkv, D, BS,
                      bstr, ks, hstr, tokens, q_stride, q_bf16 != 0,
                      scale * (float)M_LOG2E};
    if (kv_bf16) batchjob_kernel_amx(); /* once per process, before the threads start */
    int failed = 0;
#pragma omp parallel num_threads(n_threads)
    {
        if (!tls_scratch && (tls_scratch = aligned_alloc(64, sizeof(scratch_t))))
            memset(tls_scratch, 0, sizeof(scratch_t)); /* padding rows read, never used */
        scratch_t *w = tls_scratch;
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for
        for (int64_t i = 0; i < T * H; i++) lse[T * H + i] = -INFINITY;
        if (w) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < n_units; i++)
                (kv_bf16 ? run_unit_bf16 : run_unit_f32)(&a, units + i * U_FIELDS, w);
#ifdef HAVE_AMX
            if (kv_bf16 && amx_ok) _tile_release(); /* no tile state kept between calls */
#endif
        }
#pragma omp for
        for (int64_t i = 0; i < T * H; i++) { /* merge the prefix partial into out */
            float *o = out + i * D;
            const float lp = lse[T * H + i];
            if (lp != -INFINITY) {
                const float lo = lse[i], mx = lo > lp ? lo : lp;
                const float wo = expf(lo - mx), wp = expf(lp - mx), inv = 1.0f / (wo + wp);
                const float *p = pout + i * D;
                for (int64_t d = 0; d < D; d++) o[d] = (o[d] * wo + p[d] * wp) * inv;
                lse[i] = mx + logf(wo + wp);
            }
            if (out_bf16)
                for (int64_t d = 0; d < D; d++) out_bf16[i * D + d] = to_bf16(o[d]);
        }
    }
    return failed ? -3 : 0;
}

/* The native cache layout: k/v [num_blocks, BS, Hkv, D], one tensor each. Returns 0, or a
   negative code for arguments the kernel does not support. */
int batchjob_paged_attention(const float *q, const void *k_cache, const void *v_cache,
                             const int32_t *blocks, const int64_t *units, int64_t n_units,
                             int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t BS,
                             float scale, float *out, float *pout, float *lse, int n_threads,
                             int kv_bf16) {
    return batchjob_paged_attention_strided(q, k_cache, v_cache, blocks, units, n_units, T, H,
                                            Hkv, D, BS, BS * Hkv * D, Hkv * D, D, NULL,
                                            H * D, scale, out, pout, lse, n_threads, kv_bf16,
                                            0, NULL);
}
