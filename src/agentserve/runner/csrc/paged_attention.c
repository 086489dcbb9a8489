/* Attention that reads the paged KV cache where it lies.
 *
 * The cache is [kv_heads, blocks, block_size, head_dim] per layer (K and V
 * apart). A step's query rows come in segments: a decode row (one query) or a
 * prefill chunk (consecutive queries of one sequence); every query at position
 * p attends to positions 0..p of its sequence, found through the segment's
 * block table, or with a sliding window W > 0 to the W positions p-W+1..p
 * (transformers' rule: key j is seen when p - W < j <= p). An item reads only
 * the positions its rows' windows cover, so a decode row on a window layer
 * costs W keys at any context; a chunk's rows mask each its own lower edge.
 * Work is split into items (segment, kv head, row tile, context
 * partition); each item walks its blocks once, computing the scores of every
 * query head of the KV group and every row of the tile against a block, then
 * an online-softmax update (running max, sum and weighted V). Long contexts
 * with few items are split into partitions whose partial results are merged
 * afterwards, so a single sequence still keeps every core busy.
 *
 * Long bfloat16 prefill chunks on CPUs with AVX512-BF16 take a separate path
 * (run_item_big): row tiles of up to 48 query vectors, one query per vector
 * lane, scores with bfloat16 dot products, weighted V in float32 (see there).
 *
 * C with OpenMP: it is compiled at first use by runner/native.py with the
 * machine's C compiler (-march=native) and loaded with ctypes. The portable
 * loops are written so that the compiler vectorizes them (omp simd); AVX-512
 * paths are used where the build targets them. Accumulation is in float32 for
 * both dtypes. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp_neg.h"

#define MAX_HEAD_DIM 256
#define MAX_TILE_Q 16 /* query vectors (rows x heads of a group) per item */
#define MAX_BLOCK 128


typedef struct {
    int seg, kvh, row0, nrows, part, nparts;
    int tok0, tok1; /* context positions [tok0, tok1) this item reads */
    int big;        /* run by run_item_big (a long bfloat16 chunk's row tile) */
    long scratch;   /* offset of its partial results (nparts > 1), else -1 */
} item_t;

typedef struct {
    int dtype; /* 0 float32, 1 bfloat16 */
    const void *q; void *out;
    const void *k; const void *v;
    long nblocks; int bs, kvh, group, d;
    const int32_t *row_start, *nrows, *start, *table_off, *table;
    float scale;
    int window; /* sliding window (0: none) */
} args_t;

/* The first position a query at position p sees. */
static inline int window_lo(const args_t *a, int p) {
    return a->window > 0 && p - a->window + 1 > 0 ? p - a->window + 1 : 0;
}

static inline float load(const args_t *a, const void *base, long i) {
    return a->dtype ? bf16_to_f32(((const bf16_t *)base)[i]) : ((const float *)base)[i];
}

/* one block's rows -> float32 (contiguous bs x d) */
static void load_block(const args_t *a, const void *cache, long off, int n, float *dst) {
    long len = (long)n * a->d;
    if (a->dtype) {
        const bf16_t *s = (const bf16_t *)cache + off;
        #pragma omp simd
        for (long i = 0; i < len; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, (const float *)cache + off, sizeof(float) * len);
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 cache elements from base + off, as float32 */
static inline __m512 load16(int dtype, const void *base, long off) {
    if (dtype) return bf16x16_load((const bf16_t *)base + off);
    return _mm512_loadu_ps((const float *)base + off);
}

/* lane t of the result = the sum of v[t]'s 16 lanes (a transpose-and-add tree:
 * 46 shuffles and adds for 16 sums instead of 16 horizontal reductions). */
static inline __m512 reduce16(const __m512 *v) {
    __m512 w[8], u[4];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int j = 0; j < 4; j++)
        u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
    __m512 s0 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
    __m512 s1 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
    __m512 t = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s0), _mm512_castps_pd(s1))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s0), _mm512_castps_pd(s1))));
    /* lane 4L + k holds the sum of v[4k + L] */
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, t);
}

/* Scores of query vector qi against n (<= 16) consecutive cache rows at `off`,
 * scaled, into s[0..n). */
static inline void scores16(int dtype, const void *kc, long off, int n, int d, const float *qf,
                            const bf16_t *qb, float scale, float *s) {
    __m512 part[16];
    const int c = d / 16;
#if defined(__AVX512BF16__)
    if (dtype && d % 32 == 0) {
        /* bfloat16 pairs multiplied and summed in float32, straight from the cache */
        for (int t = 0; t < n; t++) {
            const bf16_t *kr = (const bf16_t *)kc + off + (long)t * d;
            __m512 a = _mm512_setzero_ps();
            for (int j = 0; j < d; j += 32)
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qb + j), (__m512bh)_mm512_loadu_si512(kr + j));
            part[t] = a;
        }
        for (int t = n; t < 16; t++) part[t] = _mm512_setzero_ps();
        __mmask16 mk = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
        _mm512_mask_storeu_ps(s, mk, _mm512_mul_ps(reduce16(part), _mm512_set1_ps(scale)));
        return;
    }
#endif
    (void)qb;
    (void)scale; /* qf is already scaled */
    for (int t = 0; t < n; t++) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qf), load16(dtype, kc, off + (long)t * d));
        for (int j = 1; j < c; j++)
            a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + 16 * j), load16(dtype, kc, off + (long)t * d + 16 * j), a);
        part[t] = a;
    }
    for (int t = n; t < 16; t++) part[t] = _mm512_setzero_ps();
    __mmask16 mk = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    _mm512_mask_storeu_ps(s, mk, reduce16(part));
}

#if defined(__AVX512BF16__)
/* scores16 for up to 4 bfloat16 query vectors q0.. at once: each key row is
 * loaded once for all of them, and their sums are independent chains (one
 * query's chain of d / 32 products waited on itself at every key) */
static inline void scores16_bf16_g(const void *kc, long off, int n, int d, bf16_t qb[][MAX_HEAD_DIM], int q0,
                                   int g, float scale, float s[][MAX_BLOCK], int t0) {
    __m512 part[4][16];
    for (int t = 0; t < n; t++) {
        const bf16_t *kr = (const bf16_t *)kc + off + (long)t * d;
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int j = 0; j < d; j += 32) {
            const __m512bh k = (__m512bh)_mm512_loadu_si512(kr + j);
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
                if (i < g) a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(qb[q0 + i] + j), k);
        }
        for (int i = 0; i < g; i++) part[i][t] = a[i];
    }
    __mmask16 mk = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    for (int i = 0; i < g; i++) {
        for (int t = n; t < 16; t++) part[i][t] = _mm512_setzero_ps();
        _mm512_mask_storeu_ps(s[q0 + i] + t0, mk, _mm512_mul_ps(reduce16(part[i]), _mm512_set1_ps(scale)));
    }
}
#endif

/* One block of n tokens (cache offset `off`) for nq query vectors: scores,
 * online-softmax update, weighted V. Query qi sees the block's tokens
 * [first[qi], visible[qi]) (first >= 0). Returns 1 (0: d not a multiple of 16). */
static int block_avx512(int dtype, const void *kc, const void *vc, long off, int n, int d, int nq,
                        float qf[][MAX_HEAD_DIM], bf16_t qb[][MAX_HEAD_DIM], float scale,
                        const int *first, const int *visible, float *m, float *l, float *acc) {
    if (d % 16) return 0;
    const int c = d / 16;
    float s[MAX_TILE_Q][MAX_BLOCK];
#if defined(__AVX512BF16__)
    if (dtype && d % 32 == 0) {
        for (int q0 = 0; q0 < nq; q0 += 4) {
            const int g = nq - q0 < 4 ? nq - q0 : 4;
            int any = 0;
            for (int i = 0; i < g; i++) any |= visible[q0 + i] > first[q0 + i] && first[q0 + i] < n;
            if (!any) continue;
            for (int t = 0; t < n; t += 16)
                scores16_bf16_g(kc, off + (long)t * d, n - t < 16 ? n - t : 16, d, qb, q0, g, scale, s, t);
        }
    } else
#endif
    for (int qi = 0; qi < nq; qi++) {
        if (visible[qi] <= first[qi] || first[qi] >= n) continue;
        for (int t = 0; t < n; t += 16)
            scores16(dtype, kc, off + (long)t * d, n - t < 16 ? n - t : 16, d, qf[qi], qb[qi], scale, s[qi] + t);
    }
    float p[MAX_TILE_Q][MAX_BLOCK];
    for (int qi = 0; qi < nq; qi++) {
        int vis = visible[qi] < n ? visible[qi] : n;
        const int f0 = first[qi];
        if (vis <= f0) {
            for (int t = 0; t < n; t++) p[qi][t] = 0.0f;
            continue;
        }
        float bmax = -INFINITY;
        for (int t = f0; t < vis; t++) bmax = s[qi][t] > bmax ? s[qi][t] : bmax;
        float mnew = m[qi] > bmax ? m[qi] : bmax;
        __m512 mv = _mm512_set1_ps(mnew), sum = _mm512_setzero_ps();
        for (int t = 0; t < f0; t++) p[qi][t] = 0.0f;
        for (int t = f0 & ~15; t < vis; t += 16) {
            __mmask16 mk = vis - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (vis - t)) - 1);
            if (f0 > t) mk &= (__mmask16)~((1u << (f0 - t)) - 1); /* f0 - t < 16 here */
            __m512 e = exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s[qi] + t), mv));
            e = _mm512_maskz_mov_ps(mk, e);
            _mm512_mask_storeu_ps(p[qi] + t, mk, e);
            sum = _mm512_add_ps(sum, e);
        }
        for (int t = vis; t < n; t++) p[qi][t] = 0.0f;
        float alpha = exp_neg(m[qi] - mnew);
        l[qi] = l[qi] * alpha + _mm512_reduce_add_ps(sum);
        m[qi] = mnew;
        if (alpha != 1.0f) {
            __m512 av = _mm512_set1_ps(alpha);
            for (int j = 0; j < c; j++)
                _mm512_storeu_ps(acc + (long)qi * d + 16 * j, _mm512_mul_ps(av, _mm512_loadu_ps(acc + (long)qi * d + 16 * j)));
        }
    }
    /* the tokens some query sees; a query's masked ones inside carry p = 0 */
    int tlo = n, thi = 0;
    for (int qi = 0; qi < nq; qi++) {
        const int vis = visible[qi] < n ? visible[qi] : n;
        if (vis <= first[qi]) continue;
        tlo = first[qi] < tlo ? first[qi] : tlo;
        thi = vis > thi ? vis : thi;
    }
    /* weighted V: up to 4 query vectors x 4 vectors of the head dimension at a
     * time, their accumulators in registers across the block's tokens (a wide
     * head takes its dimension in runs of 64) */
    for (int j0 = 0; j0 < c; j0 += 4) {
        const int cj = c - j0 < 4 ? c - j0 : 4;
        for (int q0 = 0; q0 < nq; q0 += 4) {
            const int g = nq - q0 < 4 ? nq - q0 : 4;
            __m512 ac[4][4];
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                #pragma GCC unroll 4
                for (int j = 0; j < 4; j++)
                    ac[i][j] = (i < g && j < cj) ? _mm512_loadu_ps(acc + (long)(q0 + i) * d + 16 * (j0 + j))
                                                 : _mm512_setzero_ps();
            }
            for (int t = tlo; t < thi; t++) {
                __m512 vr[4];
                #pragma GCC unroll 4
                for (int j = 0; j < 4; j++)
                    vr[j] = j < cj ? load16(dtype, vc, off + (long)t * d + 16 * (j0 + j)) : _mm512_setzero_ps();
                #pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    if (i >= g) break;
                    __m512 pv = _mm512_set1_ps(p[q0 + i][t]);
                    #pragma GCC unroll 4
                    for (int j = 0; j < 4; j++)
                        if (j < cj) ac[i][j] = _mm512_fmadd_ps(pv, vr[j], ac[i][j]);
                }
            }
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                #pragma GCC unroll 4
                for (int j = 0; j < 4; j++)
                    if (i < g && j < cj) _mm512_storeu_ps(acc + (long)(q0 + i) * d + 16 * (j0 + j), ac[i][j]);
            }
        }
    }
    return 1;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* ---- Long prefill chunks, bfloat16 (AVX512-BF16): the "big tile" path ----
 *
 * An item holds up to BIG_Q query vectors (rows x the group's heads) in
 * vectors of 16 lanes, one query per lane. The context is walked in panels of
 * 16 positions (gathered through the block table, any block size):
 * - scores: the queries are stored once per item as bfloat16 pairs
 *   (head-dim 2j, 2j+1) per lane, [pair][16 queries]; a key row's pair is
 *   broadcast and `dpbf16` multiplies it into 16 queries' scores at once, so
 *   a panel's scores are (tokens x query vectors) accumulators, no horizontal
 *   reduction and no transposition of K;
 * - softmax: the running max, sum and rescale factor are per lane, so the
 *   panel's max is an elementwise max over its 16 token vectors;
 * - weighted V in float32: the panel's V rows are converted once per panel,
 *   each query's probability is broadcast into FMAs with the accumulators of
 *   a few queries kept in registers. (Probabilities rounded to bfloat16 pairs
 *   with `dpbf16` here ran about 1.3x faster, but their rounding, about half
 *   the output's own bfloat16 rounding, was enough to flip the default
 *   model's greedy answer at a near tie; float32 keeps the old path's
 *   accuracy.)
 * Masked positions (after the query, or before its sliding window) get
 * probability 0; the softmax is in float32. */

#define BIG_Q 48 /* query vectors per item (rows = BIG_Q / group) */
#define BIG_NV ((BIG_Q + 15) / 16)
#define PANEL 16

static const bf16_t zero_row[MAX_HEAD_DIM];

/* scores of TT tokens (row pointers kr) for NV query vectors: s[t * BIG_NV + v] */
static inline __attribute__((always_inline)) void qk_kernel(const __m512i *qt, int np, const bf16_t *const *kr,
                                                            __m512 *s, const int NV, const int TT) {
    __m512 c[16][BIG_NV];
    #pragma GCC unroll 16
    for (int t = 0; t < TT; t++) {
        #pragma GCC unroll 4
        for (int v = 0; v < NV; v++) c[t][v] = _mm512_setzero_ps();
    }
    const int32_t *k32[16];
    #pragma GCC unroll 16
    for (int t = 0; t < TT; t++) k32[t] = (const int32_t *)kr[t];
    for (int j = 0; j < np; j++) {
        __m512i qv[BIG_NV];
        #pragma GCC unroll 4
        for (int v = 0; v < NV; v++) qv[v] = _mm512_load_si512(qt + (long)j * BIG_NV + v);
        #pragma GCC unroll 16
        for (int t = 0; t < TT; t++) {
            __m512i kb = _mm512_set1_epi32(k32[t][j]);
            #pragma GCC unroll 4
            for (int v = 0; v < NV; v++) c[t][v] = _mm512_dpbf16_ps(c[t][v], (__m512bh)qv[v], (__m512bh)kb);
        }
    }
    #pragma GCC unroll 16
    for (int t = 0; t < TT; t++) {
        #pragma GCC unroll 4
        for (int v = 0; v < NV; v++) s[t * BIG_NV + v] = c[t][v];
    }
}

/* acc[q][chunks c0 .. c0+CC) for queries q0 .. q0+g (g <= QG) += the panel's
 * n probabilities (pf[t * BIG_Q16 + q]) times its V rows in float32
 * (vf[t * C + c]), after scaling by alpha[q] when `rescale`. */
#define BIG_Q16 (BIG_NV * 16)
static inline __attribute__((always_inline)) void pv_kernel(float *acc, int d, int q0, int g, int c0, int C,
                                                            int n, const __m512 *vf, const float *pf,
                                                            const float *alpha, int rescale, const int QG,
                                                            const int CC) {
    __m512 a[24][4];
    #pragma GCC unroll 24
    for (int i = 0; i < QG; i++) {
        #pragma GCC unroll 4
        for (int c = 0; c < CC; c++) a[i][c] = _mm512_setzero_ps();
        if (i >= g) continue;
        float *ar = acc + (long)(q0 + i) * d + 16 * c0;
        __m512 al = _mm512_set1_ps(alpha[q0 + i]);
        #pragma GCC unroll 4
        for (int c = 0; c < CC; c++) {
            a[i][c] = _mm512_loadu_ps(ar + 16 * c);
            if (rescale) a[i][c] = _mm512_mul_ps(a[i][c], al);
        }
    }
    for (int t = 0; t < n; t++) {
        __m512 vv[4];
        #pragma GCC unroll 4
        for (int c = 0; c < CC; c++) vv[c] = _mm512_load_ps((const float *)(vf + (long)t * C + c0 + c));
        const float *pr = pf + (long)t * BIG_Q16 + q0;
        #pragma GCC unroll 24
        for (int i = 0; i < QG; i++) {
            if (i >= g) break;
            __m512 pb = _mm512_set1_ps(pr[i]);
            #pragma GCC unroll 4
            for (int c = 0; c < CC; c++) a[i][c] = _mm512_fmadd_ps(pb, vv[c], a[i][c]);
        }
    }
    #pragma GCC unroll 24
    for (int i = 0; i < QG; i++) {
        if (i >= g) break;
        float *ar = acc + (long)(q0 + i) * d + 16 * c0;
        #pragma GCC unroll 4
        for (int c = 0; c < CC; c++) _mm512_storeu_ps(ar + 16 * c, a[i][c]);
    }
}

static void pv_panel(float *acc, int d, int qfirst, int nq, int n, const __m512 *vf, const float *pf,
                     const float *alpha, int rescale) {
    const int C = d / 16;
/* full groups of QG queries with a constant count (no per-query tests), then the rest */
#define PV_GROUPS(QG, CC)                                                                       \
    {                                                                                           \
        int q0 = qfirst;                                                                        \
        for (; q0 + (QG) <= nq; q0 += (QG))                                                     \
            pv_kernel(acc, d, q0, (QG), c0, C, n, vf, pf, alpha, rescale, (QG), (CC));          \
        if (q0 < nq) pv_kernel(acc, d, q0, nq - q0, c0, C, n, vf, pf, alpha, rescale, (QG), (CC)); \
    }
    for (int c0 = 0; c0 < C; c0 += 4) {
        const int cc = C - c0 < 4 ? C - c0 : 4;
        switch (cc) {
        case 4: PV_GROUPS(6, 4) break;
        case 3: PV_GROUPS(8, 3) break;
        case 2: PV_GROUPS(12, 2) break;
        default: PV_GROUPS(24, 1) break;
        }
    }
#undef PV_GROUPS
}

/* One big-tile item (bfloat16, d % 16 == 0): fills m, l and acc like run_item. */
static void run_item_big(const args_t *a, const item_t *it, float *m_out, float *l_out, float *acc) {
    const int d = a->d, G = a->group, bs = a->bs;
    const int nq = it->nrows * G, nv = (nq + 15) / 16, np = d / 2, C = d / 16;
    __m512i qt[MAX_HEAD_DIM / 2 * BIG_NV];       /* [pair][vector] */
    __m512 vf[PANEL * MAX_HEAD_DIM / 16];        /* [token][chunk] */
    float pf[PANEL * BIG_Q16] __attribute__((aligned(64))); /* [token][query] */
    float alpha[BIG_Q16] __attribute__((aligned(64)));
    int32_t posl[BIG_Q16] __attribute__((aligned(64)));
    __m512 s[PANEL * BIG_NV];
    __m512 mv[BIG_NV], lv[BIG_NV];
    int vmin[BIG_NV], vmax[BIG_NV];
    const int seg_start = a->start[it->seg];
    const int32_t *table = a->table + a->table_off[it->seg];
    memset(qt, 0, sizeof(__m512i) * np * BIG_NV);
    for (int qi = 0; qi < BIG_Q16; qi++) posl[qi] = -1;
    for (int r = 0; r < it->nrows; r++) {
        long row = a->row_start[it->seg] + it->row0 + r;
        for (int g = 0; g < G; g++) {
            int qi = r * G + g;
            const int32_t *src = (const int32_t *)((const bf16_t *)a->q + (row * a->kvh * G + (long)it->kvh * G + g) * d);
            int32_t *dst = (int32_t *)qt + (qi >> 4) * 16 + (qi & 15);
            for (int j = 0; j < np; j++) dst[(long)j * BIG_NV * 16] = src[j];
            posl[qi] = seg_start + it->row0 + r;
        }
    }
    for (int v = 0; v < nv; v++) {
        mv[v] = _mm512_set1_ps(-1e30f);
        lv[v] = _mm512_setzero_ps();
        vmin[v] = posl[16 * v];
        int hi = 16 * v + 15 < nq ? 16 * v + 15 : nq - 1;
        vmax[v] = posl[hi];
    }
    memset(acc, 0, sizeof(float) * nq * d);
    const __m512 scale = _mm512_set1_ps(a->scale), big_neg = _mm512_set1_ps(-1e30f);
    const int W = a->window;
    const long head_off = (long)it->kvh * a->nblocks * bs * d;
    const bf16_t *kc = (const bf16_t *)a->k + head_off, *vc = (const bf16_t *)a->v + head_off;
    for (int p0 = it->tok0; p0 < it->tok1; p0 += PANEL) {
        const int n = it->tok1 - p0 < PANEL ? it->tok1 - p0 : PANEL;
        /* query vectors that see something of this panel: a suffix (with a window, its last
         * vectors may see nothing yet; their lanes are masked below) */
        int v0 = 0;
        while (v0 < nv && vmax[v0] < p0) v0++;
        if (v0 == nv) continue;
        const bf16_t *kr[PANEL], *vr[PANEL];
        {
            int bi = p0 / bs, w = p0 % bs;
            for (int t = 0; t < PANEL; t++) {
                if (t < n) {
                    long o = ((long)table[bi] * bs + w) * d;
                    kr[t] = kc + o;
                    vr[t] = vc + o;
                    if (++w == bs) { w = 0; bi++; }
                } else {
                    kr[t] = vr[t] = zero_row;
                }
            }
        }
        /* scores */
        switch (nv - v0) {
        case 1:
            qk_kernel(qt + v0, np, kr, s + v0, 1, 16);
            break;
        case 2:
            qk_kernel(qt + v0, np, kr, s + v0, 2, 8);
            qk_kernel(qt + v0, np, kr + 8, s + 8 * BIG_NV + v0, 2, 8);
            break;
        default:
            for (int v = v0; v < nv; v += 3) {
                if (nv - v >= 3) {
                    qk_kernel(qt + v, np, kr, s + v, 3, 8);
                    qk_kernel(qt + v, np, kr + 8, s + 8 * BIG_NV + v, 3, 8);
                } else if (nv - v == 2) {
                    qk_kernel(qt + v, np, kr, s + v, 2, 8);
                    qk_kernel(qt + v, np, kr + 8, s + 8 * BIG_NV + v, 2, 8);
                } else {
                    qk_kernel(qt + v, np, kr, s + v, 1, 16);
                }
            }
            break;
        }
        /* online softmax per lane; the probabilities to pf */
        int rescale = 0;
        for (int v = v0; v < nv; v++) {
            __m512 x[PANEL];
            __m512 bmax = big_neg;
            /* every lane sees the whole panel: none after it, none whose window starts inside it */
            const int full = n == PANEL && vmin[v] >= p0 + PANEL - 1 && (W == 0 || vmax[v] < p0 + W);
            __mmask16 mk[PANEL];
            if (full) {
                for (int t = 0; t < PANEL; t++) {
                    x[t] = _mm512_mul_ps(s[t * BIG_NV + v], scale);
                    bmax = _mm512_max_ps(bmax, x[t]);
                }
            } else {
                const __m512i pv = _mm512_load_si512(posl + 16 * v);
                for (int t = 0; t < PANEL; t++) {
                    mk[t] = t < n ? _mm512_cmpge_epi32_mask(pv, _mm512_set1_epi32(p0 + t)) : 0;
                    if (W > 0) /* p - W < p0 + t */
                        mk[t] = _mm512_mask_cmplt_epi32_mask(mk[t], pv, _mm512_set1_epi32(p0 + t + W));
                    x[t] = _mm512_mask_mul_ps(big_neg, mk[t], s[t * BIG_NV + v], scale);
                    bmax = _mm512_max_ps(bmax, x[t]);
                }
            }
            const __m512 mnew = _mm512_max_ps(mv[v], bmax);
            const __m512 al = exp_neg16(_mm512_sub_ps(mv[v], mnew));
            if (_mm512_cmpneq_ps_mask(al, _mm512_set1_ps(1.0f))) rescale = 1;
            _mm512_store_ps(alpha + 16 * v, al);
            mv[v] = mnew;
            __m512 sum = _mm512_setzero_ps();
            for (int t = 0; t < PANEL; t++) {
                x[t] = exp_neg16(_mm512_sub_ps(x[t], mnew));
                if (!full) x[t] = _mm512_maskz_mov_ps(mk[t], x[t]);
                sum = _mm512_add_ps(sum, x[t]);
            }
            lv[v] = _mm512_fmadd_ps(lv[v], al, sum);
            for (int t = 0; t < n; t++) _mm512_store_ps(pf + t * BIG_Q16 + 16 * v, x[t]);
        }
        /* the panel's V rows in float32 */
        for (int t = 0; t < n; t++)
            for (int c = 0; c < C; c++) vf[t * C + c] = load16(1, vr[t], 16 * c);
        int qfirst = 16 * v0;
        while (qfirst < nq && posl[qfirst] < p0) qfirst++;
        pv_panel(acc, d, qfirst, nq, n, vf, pf, alpha, rescale);
    }
    float mtmp[BIG_Q16], ltmp[BIG_Q16];
    for (int v = 0; v < nv; v++) {
        _mm512_storeu_ps(mtmp + 16 * v, mv[v]);
        _mm512_storeu_ps(ltmp + 16 * v, lv[v]);
    }
    for (int qi = 0; qi < nq; qi++) {
        l_out[qi] = ltmp[qi];
        m_out[qi] = ltmp[qi] > 0.0f ? mtmp[qi] : -INFINITY;
    }
}
#define HAVE_BIG_TILES 1
#endif
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* ---- Decode rows, bfloat16, head dim 64 (AVX512-BF16): the decode path ----
 *
 * One query row, the G <= 4 query heads of a KV group. The whole item runs
 * with its accumulators, running maxima and sums in registers (G x 4 vectors
 * of the head dimension), block after block: scores by bfloat16 pair products
 * straight from the cache and one transpose-and-add reduction per 16 tokens
 * (reduce16), the softmax on the 16 scores as one vector, V converted once per
 * token for all G heads. The general block path (block_avx512) stores and
 * reloads every accumulator per block and finds each block's maximum in
 * scalar code; at decode that was most of its time besides the products. */
static inline __attribute__((always_inline)) void decode64_g(const args_t *a, const item_t *it, float *m_out,
                                                             float *l_out, float *acc_out, const int G) {
    const int d = 64, bs = a->bs;
    const long row = a->row_start[it->seg] + it->row0;
    const bf16_t *qs = (const bf16_t *)a->q + (row * a->kvh * G + (long)it->kvh * G) * d;
    __m512i q[4][2];
    __m512 acc[4][4], sc = _mm512_set1_ps(a->scale), ninf = _mm512_set1_ps(-INFINITY);
    float m[4], l[4];
    #pragma GCC unroll 4
    for (int g = 0; g < G; g++) {
        q[g][0] = _mm512_loadu_si512(qs + g * d);
        q[g][1] = _mm512_loadu_si512(qs + g * d + 32);
        m[g] = -INFINITY;
        l[g] = 0.0f;
        #pragma GCC unroll 4
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
    }
    const long head_off = (long)it->kvh * a->nblocks * bs * d;
    const bf16_t *kc = (const bf16_t *)a->k + head_off, *vc = (const bf16_t *)a->v + head_off;
    const int32_t *table = a->table + a->table_off[it->seg];
    float p[4][16] __attribute__((aligned(64)));
    for (int t0 = it->tok0; t0 < it->tok1;) {
        const int lo = t0 % bs;
        const int n = bs - lo < it->tok1 - t0 ? bs - lo : it->tok1 - t0;
        const long off = ((long)table[t0 / bs] * bs + lo) * d;
        for (int s0 = 0; s0 < n; s0 += 16) {
            const int nn = n - s0 < 16 ? n - s0 : 16;
            const __mmask16 mk = nn == 16 ? (__mmask16)0xffff : (__mmask16)((1u << nn) - 1);
            const bf16_t *kr = kc + off + (long)s0 * d, *vr = vc + off + (long)s0 * d;
            #pragma GCC unroll 4
            for (int g = 0; g < G; g++) {
                __m512 part[16];
                for (int t = 0; t < 16; t++) {
                    if (t < nn) {
                        __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q[g][0],
                                                    (__m512bh)_mm512_loadu_si512(kr + (long)t * d));
                        part[t] = _mm512_dpbf16_ps(x, (__m512bh)q[g][1], (__m512bh)_mm512_loadu_si512(kr + (long)t * d + 32));
                    } else {
                        part[t] = _mm512_setzero_ps();
                    }
                }
                __m512 sv = _mm512_mask_mov_ps(ninf, mk, _mm512_mul_ps(reduce16(part), sc));
                const float bmax = _mm512_reduce_max_ps(sv);
                const float mnew = m[g] > bmax ? m[g] : bmax;
                __m512 e = _mm512_maskz_mov_ps(mk, exp_neg16(_mm512_sub_ps(sv, _mm512_set1_ps(mnew))));
                _mm512_store_ps(p[g], e);
                const float alpha = exp_neg(m[g] - mnew); /* m = -inf the first time: ~0, and acc is 0 */
                l[g] = l[g] * alpha + _mm512_reduce_add_ps(e);
                m[g] = mnew;
                if (alpha != 1.0f) {
                    const __m512 av = _mm512_set1_ps(alpha);
                    #pragma GCC unroll 4
                    for (int c = 0; c < 4; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], av);
                }
            }
            for (int t = 0; t < nn; t++) {
                __m512 v[4];
                #pragma GCC unroll 4
                for (int c = 0; c < 4; c++) v[c] = bf16x16_load(vr + (long)t * d + 16 * c);
                #pragma GCC unroll 4
                for (int g = 0; g < G; g++) {
                    const __m512 pb = _mm512_set1_ps(p[g][t]);
                    #pragma GCC unroll 4
                    for (int c = 0; c < 4; c++) acc[g][c] = _mm512_fmadd_ps(pb, v[c], acc[g][c]);
                }
            }
        }
        t0 += n;
    }
    #pragma GCC unroll 4
    for (int g = 0; g < G; g++) {
        m_out[g] = l[g] > 0.0f ? m[g] : -INFINITY;
        l_out[g] = l[g];
        #pragma GCC unroll 4
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc_out + (long)g * d + 16 * c, acc[g][c]);
    }
}

static void run_decode64(const args_t *a, const item_t *it, float *m, float *l, float *acc) {
    switch (a->group) {
    case 1: decode64_g(a, it, m, l, acc, 1); break;
    case 2: decode64_g(a, it, m, l, acc, 2); break;
    case 3: decode64_g(a, it, m, l, acc, 3); break;
    default: decode64_g(a, it, m, l, acc, 4); break;
    }
}
#define HAVE_DECODE64 1
#endif

/* Runs one item: fills m, l and acc (unnormalized) for its nq query vectors. */
static void run_item(const args_t *a, const item_t *it, float *m, float *l, float *acc) {
    const int d = a->d, G = a->group, bs = a->bs;
    const int nq = it->nrows * G;
#if defined(HAVE_BIG_TILES)
    if (it->big) {
        run_item_big(a, it, m, l, acc);
        return;
    }
#endif
#if defined(HAVE_DECODE64)
    /* one row that sees all of [tok0, tok1): a decode row, or a chunk's row past the context */
    if (it->nrows == 1 && a->dtype == 1 && d == 64 && G <= 4 && a->start[it->seg] + it->row0 >= it->tok1 - 1
        && window_lo(a, a->start[it->seg] + it->row0) <= it->tok0) {
        run_decode64(a, it, m, l, acc);
        return;
    }
#endif
    float qf[MAX_TILE_Q][MAX_HEAD_DIM];
    bf16_t qb[MAX_TILE_Q][MAX_HEAD_DIM]; /* the raw bfloat16 query (bfloat16 caches) */
    float kb[MAX_BLOCK * MAX_HEAD_DIM], vb[MAX_BLOCK * MAX_HEAD_DIM];
    float s[MAX_TILE_Q][MAX_BLOCK];
    int pos[MAX_TILE_Q], qlo[MAX_TILE_Q]; /* the positions each query sees: qlo..pos */
    const int seg_start = a->start[it->seg];
    const int32_t *table = a->table + a->table_off[it->seg];
    for (int r = 0; r < it->nrows; r++) {
        long row = a->row_start[it->seg] + it->row0 + r;
        for (int g = 0; g < G; g++) {
            int qi = r * G + g;
            long base = (row * a->kvh * G + (long)it->kvh * G + g) * d;
            for (int j = 0; j < d; j++) qf[qi][j] = load(a, a->q, base + j) * a->scale;
            if (a->dtype) memcpy(qb[qi], (const bf16_t *)a->q + base, sizeof(bf16_t) * d);
            pos[qi] = seg_start + it->row0 + r;
            qlo[qi] = window_lo(a, pos[qi]);
        }
    }
    for (int qi = 0; qi < nq; qi++) {
        m[qi] = -INFINITY;
        l[qi] = 0.0f;
        memset(acc + (long)qi * d, 0, sizeof(float) * d);
    }
    const long head_off = (long)it->kvh * a->nblocks * bs * d;
    for (int t0 = it->tok0; t0 < it->tok1; t0 += bs - (t0 % bs)) {
        int blk = table[t0 / bs];
        int lo = t0 % bs;
        int hi = bs;
        if ((t0 / bs) * bs + hi > it->tok1) hi = it->tok1 - (t0 / bs) * bs;
        int n = hi - lo;
        long off = head_off + ((long)blk * bs + lo) * d;
#if defined(__AVX512F__)
        {
            int first[MAX_TILE_Q], visible[MAX_TILE_Q];
            for (int qi = 0; qi < nq; qi++) {
                visible[qi] = pos[qi] - t0 + 1;
                first[qi] = qlo[qi] > t0 ? qlo[qi] - t0 : 0;
            }
            if (block_avx512(a->dtype, a->k, a->v, off, n, d, nq, qf, qb, a->scale, first, visible, m, l, acc))
                continue;
        }
#endif
        load_block(a, a->k, off, n, kb);
        load_block(a, a->v, off, n, vb);
        for (int qi = 0; qi < nq; qi++) {
            /* tokens this query may see in the block: [first, visible) */
            int visible = pos[qi] - t0 + 1;
            const int first = qlo[qi] > t0 ? qlo[qi] - t0 : 0;
            if (visible > n) visible = n;
            if (visible <= first) continue;
            const float *qv = qf[qi];
            float bmax = -INFINITY;
            int t = first;
            /* four keys at a time: four independent sums, where one would wait on its own
             * adds (a latency chain of d / 8 steps per key, most of a decode row's time) */
            for (; t + 4 <= visible; t += 4) {
                const float *k0 = kb + (long)t * d, *k1 = k0 + d, *k2 = k1 + d, *k3 = k2 + d;
                float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
                #pragma omp simd reduction(+:d0, d1, d2, d3)
                for (int j = 0; j < d; j++) {
                    d0 += qv[j] * k0[j];
                    d1 += qv[j] * k1[j];
                    d2 += qv[j] * k2[j];
                    d3 += qv[j] * k3[j];
                }
                s[qi][t] = d0;
                s[qi][t + 1] = d1;
                s[qi][t + 2] = d2;
                s[qi][t + 3] = d3;
            }
            for (; t < visible; t++) {
                const float *kr = kb + (long)t * d;
                float dot = 0.0f;
                #pragma omp simd reduction(+:dot)
                for (int j = 0; j < d; j++) dot += qv[j] * kr[j];
                s[qi][t] = dot;
            }
            for (t = first; t < visible; t++) bmax = s[qi][t] > bmax ? s[qi][t] : bmax;
            float mnew = m[qi] > bmax ? m[qi] : bmax;
            float alpha = exp_neg(m[qi] - mnew); /* m = -inf the first time: 0 */
            float *ac = acc + (long)qi * d;
            float sum = 0.0f;
            float *sq = s[qi];
            #pragma omp simd reduction(+:sum)
            for (int t = first; t < visible; t++) {
                float p = exp_neg(sq[t] - mnew);
                sq[t] = p;
                sum += p;
            }
            l[qi] = l[qi] * alpha + sum;
            m[qi] = mnew;
            if (alpha != 1.0f) {
                #pragma omp simd
                for (int j = 0; j < d; j++) ac[j] *= alpha;
            }
            /* four values per pass over the accumulator, added in the same order as one by one */
            for (t = first; t + 4 <= visible; t += 4) {
                const float p0 = sq[t], p1 = sq[t + 1], p2 = sq[t + 2], p3 = sq[t + 3];
                const float *v0 = vb + (long)t * d, *v1 = v0 + d, *v2 = v1 + d, *v3 = v2 + d;
                #pragma omp simd
                for (int j = 0; j < d; j++) ac[j] = (((ac[j] + p0 * v0[j]) + p1 * v1[j]) + p2 * v2[j]) + p3 * v3[j];
            }
            for (; t < visible; t++) {
                const float p = sq[t];
                const float *vr = vb + (long)t * d;
                #pragma omp simd
                for (int j = 0; j < d; j++) ac[j] += p * vr[j];
            }
        }
    }
}

static void store(const args_t *a, long idx, float x) {
    if (a->dtype) ((bf16_t *)a->out)[idx] = f32_to_bf16(x);
    else ((float *)a->out)[idx] = x;
}

static void write_rows(const args_t *a, const item_t *it, const float *l, const float *acc) {
    const int d = a->d, G = a->group;
    for (int r = 0; r < it->nrows; r++) {
        long row = a->row_start[it->seg] + it->row0 + r;
        for (int g = 0; g < G; g++) {
            int qi = r * G + g;
            long base = (row * a->kvh * G + (long)it->kvh * G + g) * d;
            float inv = l[qi] > 0.0f ? 1.0f / l[qi] : 0.0f;
            for (int j = 0; j < d; j++) store(a, base + j, acc[(long)qi * d + j] * inv);
        }
    }
}

#if defined(HAVE_BIG_TILES)
#define MAX_ITEM_Q (BIG_Q > MAX_TILE_Q ? BIG_Q : MAX_TILE_Q)
#else
#define MAX_ITEM_Q MAX_TILE_Q
#endif
/* A prefill segment (2 rows or more; decode rows keep run_item's path) with at
 * least this many query vectors (rows x group) goes to big tiles: measured
 * faster from 3 rows of 3 heads on (SmolLM2 shapes, 2 threads). */
#define BIG_MIN_Q 8

/* Rows per item for a segment of nrows rows; *big: whether run_item_big runs them. */
static int seg_tile(int dtype, int d, int group, int nrows, int *big) {
    int b = 0;
#if defined(HAVE_BIG_TILES)
    b = dtype == 1 && d % 16 == 0 && nrows > 1 && (long)nrows * group >= BIG_MIN_Q;
#else
    (void)dtype; (void)d;
#endif
    if (big) *big = b;
#if defined(HAVE_BIG_TILES)
    if (b) return BIG_Q / group;
#endif
    (void)nrows;
    return MAX_TILE_Q / group;
}

/* 1 when this build has the big-tile path for long bfloat16 chunks (AVX512-BF16). */
int agentserve_paged_attention_big_tiles(void) {
#if defined(HAVE_BIG_TILES)
    return 1;
#else
    return 0;
#endif
}

/* Returns 0, or a negative code for arguments the kernel does not handle. */
int agentserve_paged_attention(int dtype, const void *q, void *out, const void *k, const void *v,
                               long nblocks, int bs, int kvh, int group, int d,
                               int nsegs, const int32_t *row_start, const int32_t *nrows,
                               const int32_t *start, const int32_t *table_off, const int32_t *table,
                               float scale, int nthreads, int min_part_tokens, int window) {
    if (d > MAX_HEAD_DIM || bs > MAX_BLOCK || group > MAX_TILE_Q || group < 1 || bs < 1 || window < 0) return -1;
    args_t a = {dtype, q, out, k, v, nblocks, bs, kvh, group, d, row_start, nrows, start, table_off, table, scale,
                window};
    /* count items without partitions; split contexts only when that leaves cores idle */
    long base_items = 0, longest = 0;
    for (int s = 0; s < nsegs; s++) {
        const int tile = seg_tile(dtype, d, group, nrows[s], NULL);
        base_items += (long)kvh * ((nrows[s] + tile - 1) / tile);
        long span = start[s] + nrows[s] - window_lo(&a, start[s]); /* positions its rows read */
        if (span > longest) longest = span;
    }
    int parts = 1;
    const long want = 8L * (nthreads > 0 ? nthreads : 1);
    if (base_items < want && min_part_tokens > 0) {
        parts = (int)((want + base_items - 1) / base_items);
        long cap = (longest + min_part_tokens - 1) / min_part_tokens;
        if (parts > cap) parts = (int)cap;
        if (parts < 1) parts = 1;
    }
    long cap_items = base_items * parts;
    item_t *items = (item_t *)malloc(sizeof(item_t) * (cap_items > 0 ? cap_items : 1));
    if (!items) return -2;
    long n = 0, scratch = 0;
    const long qstride = (long)d + 2; /* per query vector: m, l, acc[d] */
    for (int s = 0; s < nsegs; s++) {
        int big;
        const int tile = seg_tile(dtype, d, group, nrows[s], &big);
        for (int r0 = 0; r0 < nrows[s]; r0 += tile) {
            int nr = nrows[s] - r0 < tile ? nrows[s] - r0 : tile;
            int ctx = start[s] + r0 + nr; /* the tile's last row sees up to ctx - 1 */
            int lo = window_lo(&a, start[s] + r0); /* and its first row from lo */
            int np = parts;
            if (np > 1) {
                int cap2 = (ctx - lo + min_part_tokens - 1) / min_part_tokens;
                if (np > cap2) np = cap2;
            }
            /* [lo, ctx) split on block edges (the first part may start inside a block) */
            int b0 = lo / bs, nb = (ctx + bs - 1) / bs - b0;
            for (int h = 0; h < kvh; h++) {
                for (int p = 0; p < np; p++) {
                    item_t *it = &items[n++];
                    it->seg = s; it->kvh = h; it->row0 = r0; it->nrows = nr;
                    it->part = p; it->nparts = np; it->big = big;
                    int e0 = (b0 + (int)((long)nb * p / np)) * bs;
                    it->tok0 = e0 > lo ? e0 : lo;
                    int e = (b0 + (int)((long)nb * (p + 1) / np)) * bs;
                    it->tok1 = e < ctx ? e : ctx;
                    if (np > 1) { it->scratch = scratch; scratch += (long)nr * group * qstride; }
                    else it->scratch = -1;
                }
            }
        }
    }
    float *part_buf = scratch ? (float *)malloc(sizeof(float) * scratch) : NULL;
    if (scratch && !part_buf) { free(items); return -2; }
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads > 0 ? nthreads : 1)
    for (long i = 0; i < n; i++) {
        const item_t *it = &items[i];
        float m[MAX_ITEM_Q], l[MAX_ITEM_Q];
        float acc[MAX_ITEM_Q * MAX_HEAD_DIM];
        run_item(&a, it, m, l, acc);
        if (it->scratch < 0) {
            write_rows(&a, it, l, acc);
        } else {
            float *dst = part_buf + it->scratch;
            int nq = it->nrows * group;
            for (int qi = 0; qi < nq; qi++) {
                dst[qi * qstride] = m[qi];
                dst[qi * qstride + 1] = l[qi];
                memcpy(dst + qi * qstride + 2, acc + (long)qi * d, sizeof(float) * d);
            }
        }
    }
    if (scratch) {
        /* merge: the first partition of each (tile, head) gathers the others */
        #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads > 0 ? nthreads : 1)
        for (long i = 0; i < n; i++) {
            const item_t *it = &items[i];
            if (it->scratch < 0 || it->part != 0) continue;
            int nq = it->nrows * group;
            float l[MAX_ITEM_Q];
            float acc[MAX_ITEM_Q * MAX_HEAD_DIM];
            for (int qi = 0; qi < nq; qi++) {
                float mx = -INFINITY;
                for (int p = 0; p < it->nparts; p++) {
                    float mp = part_buf[items[i + p].scratch + qi * qstride];
                    if (mp > mx) mx = mp;
                }
                float lsum = 0.0f;
                float *ac = acc + (long)qi * d;
                memset(ac, 0, sizeof(float) * d);
                for (int p = 0; p < it->nparts; p++) {
                    const float *src = part_buf + items[i + p].scratch + qi * qstride;
                    if (src[0] == -INFINITY) continue; /* saw no token */
                    float w = exp_neg(src[0] - mx);
                    lsum += src[1] * w;
                    #pragma omp simd
                    for (int j = 0; j < d; j++) ac[j] += w * src[2 + j];
                }
                l[qi] = lsum;
            }
            write_rows(&a, it, l, acc);
        }
    }
    free(part_buf);
    free(items);
    return 0;
}
