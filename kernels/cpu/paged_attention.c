/* Prefix-shared paged attention for the CPU, reading KV blocks in place (float32).

   Built and loaded by batchjob/engine/cpu_kernel.py (gcc -O3 -march=native -fopenmp); the
   Python side (batchjob/engine/attention_cpu.py) turns AttentionMetadata into work units.

   A work unit is `nq` consecutive query tokens x the R query heads of one KV head against
   one key sequence (a block-table row of `nkeys` keys): the own KV of a sequence (causal)
   or a group's shared prefix (no mask, all the group's queries in one matrix-matrix tile).
   Query i of the unit sees key k iff k <= causal + i. Flash-style online softmax in the
   log2 domain, float32 throughout. Own partials go to `out`, prefix partials to `pout`, and
   a final pass merges them by log-sum-exp into `out`.

   Layout: q [T, H, D]; k/v cache [num_blocks, BS, Hkv, D]; out/pout [T, H, D];
   lse [2, T, H] (natural log; row 1: prefix, -inf where a token has no prefix).
   Requires D % 16 == 0, BS % 16 == 0 and rows = nq * R <= MAX_ROWS. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define L 16        /* keys per chunk = float lanes of one vector */
#define MAX_ROWS 64 /* query rows (tokens x heads) of one unit */
#define MAX_D 256
#define SC 256 /* keys per softmax span: one rescale of the accumulators per span */

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16 __attribute__((vector_size(64)));

enum { U_Q0, U_NQ, U_NKEYS, U_BLK, U_CAUSAL, U_DST, U_KVH, U_FIELDS };

typedef struct {
    const float *q, *k, *v;
    const int32_t *blocks;
    float *out, *pout, *lse;
    int64_t T, H, Hkv, D, BS;
    float qscale; /* softmax scale * log2(e) */
} args_t;

static inline v16 ld(const float *p) { return *(const v16u *)p; }
static inline void st(float *p, v16 x) { *(v16u *)p = x; }
static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline v16 select16(i16 m, v16 a, v16 b) { /* m ? a : b, m lanes all-ones or zero */
    return (v16)(((i16)a & m) | ((i16)b & ~m));
}

/* 2**x for x <= 0 (relative error ~2e-7); lanes below -126 give ~1e-38, callers mask. */
static inline v16 exp2v(v16 x) {
    const v16 lo = splat(-126.0f);
    x = select16(x < lo, lo, x);
    i16 xi = __builtin_convertvector(x, i16); /* trunc toward zero */
    xi += (i16)(__builtin_convertvector(xi, v16) > x); /* -1 where trunc > x: floor */
    v16 f = x - __builtin_convertvector(xi, v16); /* [0, 1) */
    v16 p = splat(1.5403530e-4f);
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    return (v16)((i16)p + ((xi) << 23));
}

static inline float hmax(v16 x) {
    float m = x[0];
    for (int i = 1; i < L; i++) m = x[i] > m ? x[i] : m;
    return m;
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline float hsum(v16 x) { /* tree reduction: halves, then lanes */
    v8 a, b;
    memcpy(&a, &x, 32);
    memcpy(&b, (char *)&x + 32, 32);
    a += b;
    v4 c, e;
    memcpy(&c, &a, 16);
    memcpy(&e, (char *)&a + 16, 16);
    c += e;
    return (c[0] + c[2]) + (c[1] + c[3]);
}

typedef struct {
    float qs[MAX_ROWS * MAX_D]; /* scaled queries; rows past the unit's are zero */
    float o[MAX_ROWS * MAX_D];  /* unnormalised output accumulators */
    float s[MAX_ROWS * SC];     /* scores, then probabilities, of one span of keys */
    float kv[L * MAX_D];        /* one chunk of K or V rows, contiguous: [16][D] */
    float qtk[MAX_D * MAX_ROWS]; /* key-major tiles: query rows transposed, [D][RP] */
    float m[MAX_ROWS], l[MAX_ROWS];
} scratch_t;

#define INLINE static inline __attribute__((always_inline))

/* Few rows (decode): s[r * SC + j] = q_r . k_j along D, for nv <= 16 keys. */
INLINE void scores_dot(const float *qs, float *s, int rows, int64_t D, const float *K,
                       int64_t ks, int nv) {
    for (int r = 0; r < rows; r++) {
        const float *qr = qs + r * D;
        for (int j = 0; j < L; j++) {
            v16 a = splat(0);
            if (j < nv)
                for (int64_t d = 0; d < D; d += L) a += ld(qr + d) * ld(K + j * ks + d);
            s[r * SC + j] = hsum(a);
        }
    }
}

/* o[r] += sum_j p[r * SC + j] v_j over nv keys: 4 rows x 4 vectors of D per step (16
   accumulators), then single vectors and single rows. */
INLINE void accumulate(float *obase, const float *p, int64_t prs, int64_t pks, int rows,
                       int64_t D, const float *V, int64_t ks, int nv) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
        const float *p0 = p + r * prs, *p1 = p0 + prs, *p2 = p1 + prs, *p3 = p2 + prs;
        float *o0 = obase + r * D, *o1 = o0 + D, *o2 = o1 + D, *o3 = o2 + D;
        int64_t d = 0;
        for (; d + 4 * L <= D; d += 4 * L) {
            v16 acc[4][4];
            for (int i = 0; i < 4; i++) {
                acc[0][i] = ld(o0 + d + i * L), acc[1][i] = ld(o1 + d + i * L);
                acc[2][i] = ld(o2 + d + i * L), acc[3][i] = ld(o3 + d + i * L);
            }
            for (int j = 0; j < nv; j++) {
                const float *vj = V + j * ks + d;
                const float c0 = p0[j * pks], c1 = p1[j * pks], c2 = p2[j * pks];
                const float c3 = p3[j * pks];
                for (int i = 0; i < 4; i++) {
                    const v16 x = ld(vj + i * L);
                    acc[0][i] += c0 * x, acc[1][i] += c1 * x;
                    acc[2][i] += c2 * x, acc[3][i] += c3 * x;
                }
            }
            for (int i = 0; i < 4; i++) {
                st(o0 + d + i * L, acc[0][i]), st(o1 + d + i * L, acc[1][i]);
                st(o2 + d + i * L, acc[2][i]), st(o3 + d + i * L, acc[3][i]);
            }
        }
        for (; d < D; d += L) {
            v16 a0 = ld(o0 + d), a1 = ld(o1 + d), a2 = ld(o2 + d), a3 = ld(o3 + d);
            for (int j = 0; j < nv; j++) {
                const v16 x = ld(V + j * ks + d);
                a0 += p0[j * pks] * x, a1 += p1[j * pks] * x;
                a2 += p2[j * pks] * x, a3 += p3[j * pks] * x;
            }
            st(o0 + d, a0), st(o1 + d, a1), st(o2 + d, a2), st(o3 + d, a3);
        }
    }
    for (; r < rows; r++) { /* decode rows */
        const float *pr = p + r * prs;
        float *o = obase + r * D;
        for (int64_t d = 0; d < D; d += L) {
            v16 acc = ld(o + d);
            for (int j = 0; j < nv; j++) acc += pr[j * pks] * ld(V + j * ks + d);
            st(o + d, acc);
        }
    }
}

/* Key-major tiles (4..64 rows): rows live in NV vectors of 16 (w->qt: [D][NV*16]), each
   K element is broadcast, so K needs no transpose; scores land key-major,
   sk[j * RP + r] (RP = NV * 16), and stay so for the softmax and P.V. */
INLINE void scores_km_nv(scratch_t *w, float *sk, const int NV, int64_t D, const float *K,
                         int nv) {
    const int RP = NV * L, KB = 16 / NV; /* keys per step: NV x KB = 16 accumulators */
    for (int j0 = 0; j0 < nv; j0 += KB) {
        const float *k[16];
        for (int i = 0; i < KB; i++) k[i] = K + (j0 + i < nv ? j0 + i : 0) * D; /* pad: key 0 */
        v16 a[16];
        for (int i = 0; i < 16; i++) a[i] = splat(0);
        for (int64_t d = 0; d < D; d++) {
            v16 qv[4];
            for (int v = 0; v < NV; v++) qv[v] = ld(w->qtk + d * RP + v * L);
            for (int i = 0; i < KB; i++) {
                const float kd = k[i][d];
                for (int v = 0; v < NV; v++) a[i * NV + v] += kd * qv[v];
            }
        }
        for (int i = 0; i < KB && j0 + i < nv; i++)
            for (int v = 0; v < NV; v++) st(sk + (j0 + i) * RP + v * L, a[i * NV + v]);
    }
}

INLINE void scores_km(scratch_t *w, float *sk, int NV, int64_t D, const float *K, int nv) {
    switch (NV) { /* NV constant in each clone: the accumulators stay in registers */
    case 1: scores_km_nv(w, sk, 1, D, K, nv); break;
    case 2: scores_km_nv(w, sk, 2, D, K, nv); break;
    default: scores_km_nv(w, sk, 4, D, K, nv); break; /* 3 rounds up to 4: qt lanes are 0 */
    }
}

/* Online softmax over a key-major span of n keys from key kb: vectorised over rows. */
INLINE void softmax_km(scratch_t *w, int rows, int NV, int64_t R, int64_t D, int64_t causal,
                       int64_t kb, int n) {
    const int RP = NV * L;
    for (int v = 0; v < NV; v++) {
        i16 lim; /* row r sees span keys j < lim[r] (0 for padding rows) */
        for (int i = 0; i < L; i++) {
            const int r = v * L + i;
            int64_t x = r < rows ? causal + r / R - kb + 1 : 0;
            lim[i] = (int32_t)(x < 0 ? 0 : (x > n ? n : x));
        }
        v16 mx = splat(-INFINITY);
        for (int j = 0; j < n; j++) {
            const v16 x = select16(lim > j, ld(w->s + j * RP + v * L), splat(-INFINITY));
            mx = select16(x > mx, x, mx);
        }
        const v16 mold = ld(w->m + v * L);
        const v16 mnew = select16(mx > mold, mx, mold);
        const i16 none = mnew == splat(-INFINITY); /* no key seen yet: keep zeros */
        const v16 alpha = select16(none, splat(1.0f), exp2v(mold - mnew));
        v16 sum = splat(0);
        for (int j = 0; j < n; j++) {
            float *sj = w->s + j * RP + v * L;
            const v16 p = select16(lim > j, exp2v(ld(sj) - mnew), splat(0));
            st(sj, p);
            sum += p;
        }
        st(w->l + v * L, ld(w->l + v * L) * alpha + sum);
        st(w->m + v * L, mnew);
        for (int i = 0; i < L && v * L + i < rows; i++)
            if (alpha[i] != 1.0f) {
                float *o = w->o + (v * L + i) * D;
                for (int64_t d = 0; d < D; d += L) st(o + d, ld(o + d) * alpha[i]);
            }
    }
}

/* Online softmax over one span of n keys (starting at key kb): scores -> probabilities,
   running max/sum updated, accumulators rescaled once per row. */
INLINE void softmax_span(scratch_t *w, int rows, int rh, int64_t R, int64_t D, int64_t causal,
                         int64_t kb, int n) {
    const i16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int r = 0; r < rows; r++) {
        float *s = w->s + r * SC;
        int64_t lim = causal + (r % rh) / R - kb + 1; /* visible keys of this span: j < lim */
        if (lim > n) lim = n;
        if (lim <= 0) { /* nothing visible here (nor later): adds nothing */
            memset(s, 0, sizeof(float) * ((n + L - 1) / L) * L);
            continue;
        }
        v16 vmax = splat(-INFINITY);
        for (int j = 0; j < lim; j += L) {
            const v16 x = select16(lane < (int32_t)(lim - j), ld(s + j), splat(-INFINITY));
            vmax = select16(x > vmax, x, vmax);
        }
        const float mx = hmax(vmax), mold = w->m[r];
        const float mnew = mx > mold ? mx : mold;
        v16 sum = splat(0);
        for (int j = 0; j < n; j += L) {
            const i16 vis = lane < (int32_t)(lim - j);
            const v16 pj = select16(vis, exp2v(ld(s + j) - mnew), splat(0));
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

/* Cache rows of one head are Hkv * D floats apart (4 KiB for 8 x 128): 16 of them share
   one L1 set and evict each other while a tile re-reads them, so tiles read a packed copy. */
INLINE const float *pack(float *dst, const float *src, int nv, int64_t D, int64_t ks) {
    for (int j = 0; j < nv; j++) memcpy(dst + j * D, src + j * ks, sizeof(float) * D);
    return dst;
}

/* kvh < 0: all KV heads in this unit (decode rows only), so it streams whole blocks. */
INLINE void run_unit_d(const args_t *a, const int64_t *u, scratch_t *w, const int64_t D) {
    const int64_t H = a->H, R = a->H / a->Hkv, BS = a->BS, ks = a->Hkv * D;
    const int64_t q0 = u[U_Q0], nq = u[U_NQ], causal = u[U_CAUSAL];
    const int64_t h0 = u[U_KVH] < 0 ? 0 : u[U_KVH], nh = u[U_KVH] < 0 ? a->Hkv : 1;
    const int rh = (int)(nq * R), rows = (int)(nh * rh); /* rows per head, in all */
    const int few = rh < 4; /* decode: row-major dot products; else key-major tiles */
    const int NV = few ? 0 : (rows <= L ? 1 : rows <= 2 * L ? 2 : 4), RP = NV * L;
    for (int r = 0; r < rows; r++) {
        const int64_t hh = r / rh, rl = r % rh;
        const float *src = a->q + ((q0 + rl / R) * H + (h0 + hh) * R + rl % R) * D;
        for (int64_t d = 0; d < D; d++) w->qs[r * D + d] = src[d] * a->qscale;
    }
    for (int r = 0; r < (few ? rows : RP); r++) w->m[r] = -INFINITY, w->l[r] = 0.0f;
    if (!few)
        for (int64_t d = 0; d < D; d++)
            for (int r = 0; r < RP; r++) w->qtk[d * RP + r] = r < rows ? w->qs[r * D + d] : 0.0f;
    memset(w->o, 0, sizeof(float) * rows * D);
    int64_t kend = u[U_NKEYS];
    if (causal + nq < kend) kend = causal + nq; /* keys past the last query's limit */
    const int32_t *blocks = a->blocks + u[U_BLK];
#define KV_AT(key) (((int64_t)blocks[(key) / BS] * BS + (key) % BS) * ks + h0 * D)
    for (int64_t kb = 0; kb < kend; kb += SC) {
        const int n = kend - kb < SC ? (int)(kend - kb) : SC;
        for (int c = 0; c < n; c += L) {
            const int nv = n - c < L ? n - c : L;
            const float *K = a->k + KV_AT(kb + c);
            if (few)
                for (int64_t hh = 0; hh < nh; hh++)
                    scores_dot(w->qs + hh * rh * D, w->s + hh * rh * SC + c, rh, D, K + hh * D,
                               ks, nv);
            else
                scores_km(w, w->s + c * RP, NV, D, pack(w->kv, K, nv, D, ks), nv);
        }
        if (few)
            softmax_span(w, rows, rh, R, D, causal, kb, n);
        else
            softmax_km(w, rows, NV, R, D, causal, kb, n);
        for (int c = 0; c < n; c += L) {
            const float *V = a->v + KV_AT(kb + c);
            const int nv = n - c < L ? n - c : L;
            if (few)
                for (int64_t hh = 0; hh < nh; hh++)
                    accumulate(w->o + hh * rh * D, w->s + hh * rh * SC + c, SC, 1, rh, D,
                               V + hh * D, ks, nv);
            else
                accumulate(w->o, w->s + c * RP, 1, RP, rows, D, pack(w->kv, V, nv, D, ks), D,
                           nv);
        }
    }
#undef KV_AT
    float *out = u[U_DST] ? a->pout : a->out;
    float *lse = a->lse + (u[U_DST] ? a->T * H : 0);
    for (int r = 0; r < rows; r++) {
        const int64_t hh = r / rh, rl = r % rh;
        const int64_t row = (q0 + rl / R) * H + (h0 + hh) * R + rl % R;
        const float inv = 1.0f / w->l[r];
        for (int64_t d = 0; d < D; d++) out[row * D + d] = w->o[r * D + d] * inv;
        lse[row] = (w->m[r] + log2f(w->l[r])) * (float)M_LN2;
    }
}

/* One clone per common head dim, so D is a compile-time constant in the inner loops. */
static void run_unit(const args_t *a, const int64_t *u, scratch_t *w) {
    switch (a->D) {
    case 64: run_unit_d(a, u, w, 64); break;
    case 80: run_unit_d(a, u, w, 80); break;
    case 96: run_unit_d(a, u, w, 96); break;
    case 128: run_unit_d(a, u, w, 128); break;
    default: run_unit_d(a, u, w, a->D);
    }
}

/* Returns 0, or a negative code for arguments the kernel does not support. */
int batchjob_paged_attention(const float *q, const float *k_cache, const float *v_cache,
                             const int32_t *blocks, const int64_t *units, int64_t n_units,
                             int64_t T, int64_t H, int64_t Hkv, int64_t D, int64_t BS,
                             float scale, float *out, float *pout, float *lse,
                             int n_threads) {
    if (D % L || D > MAX_D || BS % L || Hkv <= 0 || H % Hkv) return -1;
    for (int64_t i = 0; i < n_units; i++) {
        const int64_t rh = units[i * U_FIELDS + U_NQ] * (H / Hkv);
        const int all = units[i * U_FIELDS + U_KVH] < 0;
        if (rh * (all ? Hkv : 1) > MAX_ROWS || (all && rh >= 4)) return -2;
    }
    const args_t a = {q, k_cache, v_cache, blocks, out, pout, lse, T, H, Hkv, D, BS,
                      scale * (float)M_LOG2E};
    int failed = 0;
#pragma omp parallel num_threads(n_threads)
    {
        scratch_t *w = aligned_alloc(64, sizeof(scratch_t));
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for
        for (int64_t i = 0; i < T * H; i++) lse[T * H + i] = -INFINITY;
        if (w) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < n_units; i++) run_unit(&a, units + i * U_FIELDS, w);
        }
#pragma omp for
        for (int64_t i = 0; i < T * H; i++) { /* merge the prefix partial into out */
            const float lp = lse[T * H + i];
            if (lp == -INFINITY) continue;
            const float lo = lse[i], mx = lo > lp ? lo : lp;
            const float wo = expf(lo - mx), wp = expf(lp - mx), inv = 1.0f / (wo + wp);
            float *o = out + i * D;
            const float *p = pout + i * D;
            for (int64_t d = 0; d < D; d++) o[d] = (o[d] * wo + p[d] * wp) * inv;
            lse[i] = mx + logf(wo + wp);
        }
        free(w);
    }
    return failed ? -3 : 0;
}
