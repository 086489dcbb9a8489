/* Attention that reads the paged KV cache where it lies.
 *
 * The cache is [kv_heads, blocks, block_size, head_dim] per layer (K and V
 * apart). A step's query rows come in segments: a decode row (one query) or a
 * prefill chunk (consecutive queries of one sequence); every query at position
 * p attends to positions 0..p of its sequence, found through the segment's
 * block table. Work is split into items (segment, kv head, row tile, context
 * partition); each item walks its blocks once, computing the scores of every
 * query head of the KV group and every row of the tile against a block, then
 * an online-softmax update (running max, sum and weighted V). Long contexts
 * with few items are split into partitions whose partial results are merged
 * afterwards, so a single sequence still keeps every core busy.
 *
 * Plain C with OpenMP: it is compiled at first use by runner/native.py with
 * the machine's C compiler and loaded with ctypes; the loop bodies are written
 * so that the compiler vectorizes them (omp simd), no intrinsics, so the same
 * source builds on any CPU. Accumulation is in float32 for both dtypes. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_TILE_Q 16 /* query vectors (rows x heads of a group) per item */
#define MAX_BLOCK 128

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline bf16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((v.u >> 16) | 0x40); /* quiet NaN */
    uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even */
    return (bf16_t)((v.u + rounding) >> 16);
}

/* exp for x <= 0 (scores minus their running max), vectorizable: 2^n * p(r)
 * with x = n ln2 + r, |r| <= ln2/2; relative error below 2e-7. */
#pragma omp declare simd notinbranch
static inline float exp_neg(float x) {
    if (x < -87.0f) x = -87.0f;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
    float p = 1.98756915e-4f;
    p = p * r + 1.39819995e-3f;
    p = p * r + 8.33345205e-3f;
    p = p * r + 4.16657665e-2f;
    p = p * r + 1.66666657e-1f;
    p = p * r + 5.00000000e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } s;
    s.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * s.f;
}

typedef struct {
    int seg, kvh, row0, nrows, part, nparts;
    int tok0, tok1; /* context positions [tok0, tok1) this item reads */
    long scratch;   /* offset of its partial results (nparts > 1), else -1 */
} item_t;

typedef struct {
    int dtype; /* 0 float32, 1 bfloat16 */
    const void *q; void *out;
    const void *k; const void *v;
    long nblocks; int bs, kvh, group, d;
    const int32_t *row_start, *nrows, *start, *table_off, *table;
    float scale;
} args_t;

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
    if (dtype) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const bf16_t *)base + off));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + off);
}

static inline __m512 exp_neg16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
    __m512 p = _mm512_set1_ps(1.98756915e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.39819995e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33345205e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16657665e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666657e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.00000000e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
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

/* One block of n tokens (cache offset `off`) for nq query vectors: scores,
 * online-softmax update, weighted V. Returns 1 (0: d not a multiple of 16). */
static int block_avx512(int dtype, const void *kc, const void *vc, long off, int n, int d, int nq,
                        float qf[][MAX_HEAD_DIM], bf16_t qb[][MAX_HEAD_DIM], float scale,
                        const int *visible, float *m, float *l, float *acc) {
    if (d % 16) return 0;
    const int c = d / 16;
    float s[MAX_TILE_Q][MAX_BLOCK];
    for (int qi = 0; qi < nq; qi++) {
        if (visible[qi] <= 0) continue;
        for (int t = 0; t < n; t += 16)
            scores16(dtype, kc, off + (long)t * d, n - t < 16 ? n - t : 16, d, qf[qi], qb[qi], scale, s[qi] + t);
    }
    float p[MAX_TILE_Q][MAX_BLOCK];
    for (int qi = 0; qi < nq; qi++) {
        int vis = visible[qi] < n ? visible[qi] : n;
        if (vis <= 0) {
            for (int t = 0; t < n; t++) p[qi][t] = 0.0f;
            continue;
        }
        float bmax = -INFINITY;
        for (int t = 0; t < vis; t++) bmax = s[qi][t] > bmax ? s[qi][t] : bmax;
        float mnew = m[qi] > bmax ? m[qi] : bmax;
        __m512 mv = _mm512_set1_ps(mnew), sum = _mm512_setzero_ps();
        for (int t = 0; t < vis; t += 16) {
            __mmask16 mk = vis - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (vis - t)) - 1);
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
    if (c <= 4) {
        /* up to 4 query vectors at a time with their accumulators in registers */
        for (int q0 = 0; q0 < nq; q0 += 4) {
            const int g = nq - q0 < 4 ? nq - q0 : 4;
            __m512 ac[4][4];
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                #pragma GCC unroll 4
                for (int j = 0; j < 4; j++)
                    ac[i][j] = (i < g && j < c) ? _mm512_loadu_ps(acc + (long)(q0 + i) * d + 16 * j) : _mm512_setzero_ps();
            }
            for (int t = 0; t < n; t++) {
                __m512 vr[4];
                #pragma GCC unroll 4
                for (int j = 0; j < 4; j++) vr[j] = j < c ? load16(dtype, vc, off + (long)t * d + 16 * j) : _mm512_setzero_ps();
                #pragma GCC unroll 4
                for (int i = 0; i < 4; i++) {
                    if (i >= g) break;
                    __m512 pv = _mm512_set1_ps(p[q0 + i][t]);
                    #pragma GCC unroll 4
                    for (int j = 0; j < 4; j++)
                        if (j < c) ac[i][j] = _mm512_fmadd_ps(pv, vr[j], ac[i][j]);
                }
            }
            #pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                #pragma GCC unroll 4
                for (int j = 0; j < 4; j++)
                    if (i < g && j < c) _mm512_storeu_ps(acc + (long)(q0 + i) * d + 16 * j, ac[i][j]);
            }
        }
        return 1;
    }
    __m512 kr[MAX_HEAD_DIM / 16];
    for (int t = 0; t < n; t++) {
        for (int j = 0; j < c; j++) kr[j] = load16(dtype, vc, off + (long)t * d + 16 * j);
        for (int qi = 0; qi < nq; qi++) {
            if (t >= visible[qi]) continue;
            __m512 pv = _mm512_set1_ps(p[qi][t]);
            float *ac = acc + (long)qi * d;
            for (int j = 0; j < c; j++)
                _mm512_storeu_ps(ac + 16 * j, _mm512_fmadd_ps(pv, kr[j], _mm512_loadu_ps(ac + 16 * j)));
        }
    }
    return 1;
}
#endif

/* Runs one item: fills m, l and acc (unnormalized) for its nq query vectors. */
static void run_item(const args_t *a, const item_t *it, float *m, float *l, float *acc) {
    const int d = a->d, G = a->group, bs = a->bs;
    const int nq = it->nrows * G;
    float qf[MAX_TILE_Q][MAX_HEAD_DIM];
    bf16_t qb[MAX_TILE_Q][MAX_HEAD_DIM]; /* the raw bfloat16 query (bfloat16 caches) */
    float kb[MAX_BLOCK * MAX_HEAD_DIM], vb[MAX_BLOCK * MAX_HEAD_DIM];
    float s[MAX_TILE_Q][MAX_BLOCK];
    int pos[MAX_TILE_Q];
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
            int visible[MAX_TILE_Q];
            for (int qi = 0; qi < nq; qi++) visible[qi] = pos[qi] - t0 + 1;
            if (block_avx512(a->dtype, a->k, a->v, off, n, d, nq, qf, qb, a->scale, visible, m, l, acc)) continue;
        }
#endif
        load_block(a, a->k, off, n, kb);
        load_block(a, a->v, off, n, vb);
        for (int qi = 0; qi < nq; qi++) {
            /* tokens this query may see in the block: positions <= pos[qi] */
            int visible = pos[qi] - t0 + 1;
            if (visible <= 0) continue;
            if (visible > n) visible = n;
            const float *qv = qf[qi];
            float bmax = -INFINITY;
            for (int t = 0; t < visible; t++) {
                const float *kr = kb + (long)t * d;
                float dot = 0.0f;
                #pragma omp simd reduction(+:dot)
                for (int j = 0; j < d; j++) dot += qv[j] * kr[j];
                s[qi][t] = dot;
                bmax = dot > bmax ? dot : bmax;
            }
            float mnew = m[qi] > bmax ? m[qi] : bmax;
            float alpha = exp_neg(m[qi] - mnew); /* m = -inf the first time: 0 */
            float *ac = acc + (long)qi * d;
            float sum = 0.0f;
            float *sq = s[qi];
            #pragma omp simd reduction(+:sum)
            for (int t = 0; t < visible; t++) {
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
            for (int t = 0; t < visible; t++) {
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

/* Returns 0, or a negative code for arguments the kernel does not handle. */
int agentserve_paged_attention(int dtype, const void *q, void *out, const void *k, const void *v,
                               long nblocks, int bs, int kvh, int group, int d,
                               int nsegs, const int32_t *row_start, const int32_t *nrows,
                               const int32_t *start, const int32_t *table_off, const int32_t *table,
                               float scale, int nthreads, int min_part_tokens) {
    if (d > MAX_HEAD_DIM || bs > MAX_BLOCK || group > MAX_TILE_Q || group < 1 || bs < 1) return -1;
    args_t a = {dtype, q, out, k, v, nblocks, bs, kvh, group, d, row_start, nrows, start, table_off, table, scale};
    const int tile = MAX_TILE_Q / group;
    /* count items without partitions; split contexts only when that leaves cores idle */
    long base_items = 0, longest = 0;
    for (int s = 0; s < nsegs; s++) {
        base_items += (long)kvh * ((nrows[s] + tile - 1) / tile);
        long ctx = start[s] + nrows[s];
        if (ctx > longest) longest = ctx;
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
        for (int r0 = 0; r0 < nrows[s]; r0 += tile) {
            int nr = nrows[s] - r0 < tile ? nrows[s] - r0 : tile;
            int ctx = start[s] + r0 + nr; /* the tile's last row sees [0, ctx) */
            int np = parts;
            if (np > 1) {
                int cap2 = (ctx + min_part_tokens - 1) / min_part_tokens;
                if (np > cap2) np = cap2;
            }
            /* partition boundaries on block edges */
            int nb = (ctx + bs - 1) / bs;
            for (int h = 0; h < kvh; h++) {
                for (int p = 0; p < np; p++) {
                    item_t *it = &items[n++];
                    it->seg = s; it->kvh = h; it->row0 = r0; it->nrows = nr;
                    it->part = p; it->nparts = np;
                    it->tok0 = (int)((long)nb * p / np) * bs;
                    int e = (int)((long)nb * (p + 1) / np) * bs;
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
        float m[MAX_TILE_Q], l[MAX_TILE_Q];
        float acc[MAX_TILE_Q * MAX_HEAD_DIM];
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
            float l[MAX_TILE_Q];
            float acc[MAX_TILE_Q * MAX_HEAD_DIM];
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
