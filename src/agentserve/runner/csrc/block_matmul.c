/* y = x W^T for a GGUF weight read straight from the file's blocks (Q4_0,
 * Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), for the few rows of a decode
 * step, on AVX2 (with FMA and F16C): the CPUs without the AVX512-VNNI kernel
 * of gguf_matmul.c, and the types that kernel does not take. Where the build
 * targets AVX512-VNNI, a one-row step of Q4_0, Q4_1, Q5_0 or Q5_1 takes
 * bw16_pair below.
 *
 * Every type is, per run of 32 weights j of a row, w = f_j * c + mn_j with c
 * a small signed integer code (Q6_K: times its int8 scale per 16 weights),
 * f_j the block's fp16 scale (Q4_K, Q5_K: times the run's 6-bit scale, exact
 * in float32) and mn_j its minimum (Q4_1, Q5_1: m; Q4_K, Q5_K: -dmin * min;
 * else 0). Activations
 * are quantized per 32 elements to int16 codes in -16383..16383,
 * x ~ dx_j * x16 (abs error <= max|x| / 32766 per element: finer than the
 * bfloat16 activations' own rounding except far below their block's
 * maximum), and the block sums of x are kept exact in float32. Then
 *
 *     sum w x = sum_j f_j dx_j (sum c x16) + sum_j mn_j (sum x)
 *
 * where the inner sum is vpmaddwd (int16 pairs into int32 lanes) over the
 * weights widened to int16 once and shared by up to BW_ROWS activation
 * rows. Bounds: |c| <= 32 * 128 = 4096 (Q6_K), |x16| <= 16383, 4 products per
 * int32 lane and block: < 2^28, never overflows. One int-to-float conversion
 * and one FMA per block and row; a horizontal sum per output and row.
 *
 * The weight rows stay as the file stores them (no repacking); each output
 * row is one contiguous run of blocks, the unit the threads split. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { BW_Q4_0, BW_Q4_1, BW_Q8_0, BW_Q5_0, BW_Q5_1, BW_Q4_K, BW_Q5_K, BW_Q6_K, BW_NTYPES };
#define BW_ROWS 4  /* activation rows sharing one decode of a weight row */
#define BW_XMAX 16383.0f

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define BW_FAST 1
static const int bw_block[BW_NTYPES] = {32, 32, 32, 32, 32, 256, 256, 256};
static const int bw_bytes[BW_NTYPES] = {18, 20, 34, 22, 24, 144, 176, 210};

static inline float bw_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline __m256i bw_widen_u8(__m128i v) { return _mm256_cvtepu8_epi16(v); }

/* byte i = 0xff where bit i of `bits` is set, else 0 (llama.cpp's bytes_from_bits_32) */
static inline __m256i bw_bits32(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
    return _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
}

/* Q4_K/Q5_K: the 6-bit scales and mins of 8 sub-blocks from the 12 bytes */
static inline void bw_k_scales(const uint8_t *s, int *sc, int *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* Q6_K: the 6-bit codes (0..63) of half h of the super-block at b, as 4 runs of 32 consecutive weights */
static inline __attribute__((always_inline)) void bw_q6k_codes(const uint8_t *b, int h, __m256i *q) {
    const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
    const __m256i hv = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, m15), _mm256_slli_epi16(_mm256_and_si256(hv, m3), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, m15),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 2), m3), 4));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m15),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 4), m3), 4));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 6), m3), 4));
}

/* the same 8 scales and 8 mins as 32-bit lanes, without a trip through memory: the 12 bytes
 * are s0..s3 (scales 0-3, top bits of 4-7), m0..m3 (mins 0-3, top bits of mins 4-7), l0..l3
 * (low nibble: scale 4-7's low bits, high nibble: min 4-7's) */
static inline void bw_k_scales8(const uint8_t *s, __m256i *sc, __m256i *mn) {
    uint32_t a, m, l;
    memcpy(&a, s, 4);
    memcpy(&m, s + 4, 4);
    memcpy(&l, s + 8, 4);
    const uint32_t lo6 = 0x3f3f3f3fu, lo4 = 0x0f0f0f0fu, lo2 = 0x03030303u;
    const uint32_t sc_hi = (l & lo4) | (((a >> 6) & lo2) << 4), mn_hi = ((l >> 4) & lo4) | (((m >> 6) & lo2) << 4);
    *sc = _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)sc_hi, (int)(a & lo6)));
    *mn = _mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, (int)mn_hi, (int)(m & lo6)));
}

static inline float bw_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One block j of 32 weights (codes w0: weights 0..15, w1: 16..31) against R rows,
 * into one of the row's two accumulator sets (alternate blocks use alternate
 * sets, so consecutive FMAs do not wait on each other); the minimum's term only
 * for the types that have one. */
static inline __attribute__((always_inline)) void bw_step(int R, int with_min, __m256i w0, __m256i w1, float f,
                                                          float mn, long j, const int16_t *x, long k,
                                                          const float *dx, const float *xs, long nb, __m256 *acc,
                                                          float *macc) {
    for (int r = 0; r < R; r++) {
        const int16_t *xr = x + r * k + 32 * j;
        __m256i s = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xr)),
                                     _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xr + 16))));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(f * dx[r * nb + j]), acc[r]);
        if (with_min) macc[r] += mn * xs[r * nb + j];
    }
}

/* Q4_0, Q4_1, Q8_0, Q5_0, Q5_1: block b's codes widened to int16, its scale and minimum */
static inline __attribute__((always_inline)) void bw_small_block(int qt, const uint8_t *b, __m256i *w0,
                                                                 __m256i *w1, float *f, float *mn) {
    *f = bw_half(b);
    *mn = 0.0f;
    if (qt == BW_Q8_0) {
        *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 2)));
        *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 18)));
        return;
    }
    int with_min = qt == BW_Q4_1 || qt == BW_Q5_1;
    int five = qt == BW_Q5_0 || qt == BW_Q5_1;
    const uint8_t *qs = b + 2 + 2 * with_min + 4 * five;
    __m128i v = _mm_loadu_si128((const __m128i *)qs);
    /* the 32 codes as bytes (low nibbles: weights 0..15, high: 16..31), widened once at the end */
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
    if (five) {
        uint32_t qh;
        memcpy(&qh, b + 2 + 2 * with_min, 4);
        q = _mm256_or_si256(q, _mm256_and_si256(bw_bits32(qh), _mm256_set1_epi8(16)));
    }
    if (with_min) {
        *mn = bw_half(b + 2);
        *w0 = bw_widen_u8(_mm256_castsi256_si128(q));
        *w1 = bw_widen_u8(_mm256_extracti128_si256(q, 1));
    } else {
        q = _mm256_sub_epi8(q, _mm256_set1_epi8(five ? 16 : 8));
        *w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
        *w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
    }
}

/* how far ahead of the block being read the weight stream is prefetched: the
 * hardware prefetcher alone leaves a one-row product at about 65% of the rate
 * it reaches on cached weights */
#ifndef BW_PREFETCH
#define BW_PREFETCH 1024
#endif
#ifndef BW_HINT
#define BW_HINT _MM_HINT_T0
#endif

/* the cache lines BW_PREFETCH ahead of a K-quant super-block (up to 210 bytes) */
static inline void bw_prefetch_super(const uint8_t *b) {
    _mm_prefetch((const char *)(b + BW_PREFETCH), BW_HINT);
    _mm_prefetch((const char *)(b + BW_PREFETCH + 64), BW_HINT);
    _mm_prefetch((const char *)(b + BW_PREFETCH + 128), BW_HINT);
}

/* out[r] = row `w` (k weights of type qt) . activation row r, r < R */
static inline __attribute__((always_inline)) void bw_row(int qt, int R, const uint8_t *w, long k, const int16_t *x,
                                                         const float *dx, const float *xs, float *out) {
    const long nb = k / 32;
    const int mins = qt == BW_Q4_1 || qt == BW_Q5_1 || qt == BW_Q4_K || qt == BW_Q5_K;
    __m256 acc[2 * BW_ROWS];
    float macc[BW_ROWS];
    for (int r = 0; r < R; r++) {
        acc[r] = acc[BW_ROWS + r] = _mm256_setzero_ps();
        macc[r] = 0.0f;
    }
    const __m256i m15 = _mm256_set1_epi8(15);
    if (qt <= BW_Q5_1) {
        const int size = bw_bytes[qt];
        long j = 0;
        for (; j + 2 <= nb; j += 2) {
            const uint8_t *b = w + j * size;
            _mm_prefetch((const char *)(b + BW_PREFETCH), BW_HINT);
            __m256i w0, w1, v0, v1;
            float f, mn, g, mm;
            bw_small_block(qt, b, &w0, &w1, &f, &mn);
            bw_small_block(qt, b + size, &v0, &v1, &g, &mm);
            bw_step(R, mins, w0, w1, f, mn, j, x, k, dx, xs, nb, acc, macc);
            bw_step(R, mins, v0, v1, g, mm, j + 1, x, k, dx, xs, nb, acc + BW_ROWS, macc);
        }
        for (; j < nb; j++) {
            __m256i w0, w1;
            float f, mn;
            bw_small_block(qt, w + j * size, &w0, &w1, &f, &mn);
            bw_step(R, mins, w0, w1, f, mn, j, x, k, dx, xs, nb, acc, macc);
        }
    } else {
        const int size = bw_bytes[qt];
        for (long sb = 0; sb < k / 256; sb++) {
            const uint8_t *b = w + sb * size;
            bw_prefetch_super(b);
            if (qt == BW_Q6_K) {
                const int8_t *sc = (const int8_t *)(b + 192);
                float d = bw_half(b + 208);
                const __m256i b32 = _mm256_set1_epi16(32);
                for (int h = 0; h < 2; h++) {
                    __m256i q[4];
                    bw_q6k_codes(b, h, q);
                    for (int t = 0; t < 4; t++) {
                        const int s = 8 * h + 2 * t;
                        __m256i w0 = _mm256_sub_epi16(bw_widen_u8(_mm256_castsi256_si128(q[t])), b32);
                        __m256i w1 = _mm256_sub_epi16(bw_widen_u8(_mm256_extracti128_si256(q[t], 1)), b32);
                        w0 = _mm256_mullo_epi16(w0, _mm256_set1_epi16(sc[s]));
                        w1 = _mm256_mullo_epi16(w1, _mm256_set1_epi16(sc[s + 1]));
                        bw_step(R, mins, w0, w1, d, 0.0f, 8 * sb + 4 * h + t, x, k, dx, xs, nb,
                                acc + BW_ROWS * (t & 1), macc);
                    }
                }
            } else {
                const int five = qt == BW_Q5_K;
                float d = bw_half(b), dmin = bw_half(b + 2);
                int sc[8], mn[8];
                bw_k_scales(b + 4, sc, mn);
                const uint8_t *qs = b + 16 + 32 * five;
                __m256i hv = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
                for (int i = 0; i < 4; i++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
                    for (int half = 0; half < 2; half++) {
                        const int s = 2 * i + half;
                        __m256i q = _mm256_and_si256(half ? _mm256_srli_epi16(v, 4) : v, m15);
                        if (five) {
                            __m256i bit = _mm256_set1_epi8((char)(1 << s));
                            __m256i on = _mm256_cmpeq_epi8(_mm256_and_si256(hv, bit), bit);
                            q = _mm256_or_si256(q, _mm256_and_si256(on, _mm256_set1_epi8(16)));
                        }
                        __m256i w0 = bw_widen_u8(_mm256_castsi256_si128(q));
                        __m256i w1 = bw_widen_u8(_mm256_extracti128_si256(q, 1));
                        bw_step(R, mins, w0, w1, d * (float)sc[s], -dmin * (float)mn[s], 8 * sb + s, x, k, dx, xs,
                                nb, acc + BW_ROWS * half, macc);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = bw_hsum(_mm256_add_ps(acc[r], acc[BW_ROWS + r])) + macc[r];
}

/* One activation row against two consecutive weight rows of a 32-weight-block
 * type (a decode row's product): the activation codes loaded once for both,
 * each row's sum its own chain, one call and one store per two outputs. */
static inline __attribute__((always_inline)) void bw_pair(int qt, const uint8_t *w, long row_bytes, long k,
                                                          const int16_t *x, const float *dx, const float *xs,
                                                          float *out) {
    const long nb = k / 32;
    const int size = bw_bytes[qt], mins = qt == BW_Q4_1 || qt == BW_Q5_1;
    const uint8_t *v = w + row_bytes;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    float m0 = 0.0f, m1 = 0.0f;
    for (long j = 0; j < nb; j++) {
        /* the pair's rows are one contiguous run, read at twice the pace of j */
        _mm_prefetch((const char *)(w + 2 * j * size + BW_PREFETCH), BW_HINT);
        __m256i p0, p1, q0, q1;
        float f, g, mn, mm;
        bw_small_block(qt, w + j * size, &p0, &p1, &f, &mn);
        bw_small_block(qt, v + j * size, &q0, &q1, &g, &mm);
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(x + 32 * j));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + 32 * j + 16));
        __m256i s = _mm256_add_epi32(_mm256_madd_epi16(p0, x0), _mm256_madd_epi16(p1, x1));
        __m256i t = _mm256_add_epi32(_mm256_madd_epi16(q0, x0), _mm256_madd_epi16(q1, x1));
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(f * dx[j]), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(g * dx[j]), a1);
        if (mins) {
            m0 += mn * xs[j];
            m1 += mm * xs[j];
        }
    }
    out[0] = bw_hsum(a0) + m0;
    out[1] = bw_hsum(a1) + m1;
}

typedef void (*bw_pair_fn)(const uint8_t *, long, long, const int16_t *, const float *, const float *, float *);
#define BW_PAIR(T)                                                                                         \
    static void bw_pair_##T(const uint8_t *w, long rb, long k, const int16_t *x, const float *dx,           \
                            const float *xs, float *out) {                                                  \
        bw_pair(T, w, rb, k, x, dx, xs, out);                                                              \
    }
BW_PAIR(BW_Q4_0) BW_PAIR(BW_Q4_1) BW_PAIR(BW_Q8_0) BW_PAIR(BW_Q5_0) BW_PAIR(BW_Q5_1)
static const bw_pair_fn bw_pairs[BW_Q5_1 + 1] = {bw_pair_BW_Q4_0, bw_pair_BW_Q4_1, bw_pair_BW_Q8_0,
                                                 bw_pair_BW_Q5_0, bw_pair_BW_Q5_1};

typedef void (*bw_row_fn)(const uint8_t *, long, const int16_t *, const float *, const float *, float *);
#define BW_FN(T, R)                                                                                        \
    static void bw_row_##T##_##R(const uint8_t *w, long k, const int16_t *x, const float *dx, const float *xs, \
                                 float *out) {                                                             \
        bw_row(T, R, w, k, x, dx, xs, out);                                                                \
    }
#define BW_TYPE(T) BW_FN(T, 1) BW_FN(T, 2) BW_FN(T, 3) BW_FN(T, 4)
BW_TYPE(BW_Q4_0) BW_TYPE(BW_Q4_1) BW_TYPE(BW_Q8_0) BW_TYPE(BW_Q5_0)
BW_TYPE(BW_Q5_1) BW_TYPE(BW_Q4_K) BW_TYPE(BW_Q5_K) BW_TYPE(BW_Q6_K)
#define BW_ENTRY(T) {0, bw_row_##T##_1, bw_row_##T##_2, bw_row_##T##_3, bw_row_##T##_4}
static const bw_row_fn bw_rows[BW_NTYPES][BW_ROWS + 1] = {
    BW_ENTRY(BW_Q4_0), BW_ENTRY(BW_Q4_1), BW_ENTRY(BW_Q8_0), BW_ENTRY(BW_Q5_0),
    BW_ENTRY(BW_Q5_1), BW_ENTRY(BW_Q4_K), BW_ENTRY(BW_Q5_K), BW_ENTRY(BW_Q6_K)};

static inline void bw_store_y(int dtype, void *y, long i, float v) {
    if (dtype) {
        uint32_t u;
        memcpy(&u, &v, 4);
        /* round to nearest even, NaN kept quiet */
        u = (v != v) ? (u | 0x00400000u) : u + 0x7fffu + ((u >> 16) & 1u);
        ((uint16_t *)y)[i] = (uint16_t)(u >> 16);
    } else {
        ((float *)y)[i] = v;
    }
}

/* 8 activations at element i of x (bfloat16 or float32) */
static inline __m256 bw_load8(int dtype, const void *x, long i) {
    if (dtype)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
    return _mm256_loadu_ps((const float *)x + i);
}

/* |v|, NaN as 0: a maximum over these is fmaxf's, which passes NaN over */
static inline __m256 bw_abs_ordered(__m256 v) {
    const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
    return _mm256_and_ps(a, _mm256_cmp_ps(a, a, _CMP_ORD_Q));
}

static inline float bw_hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* fminf(fmaxf(nearbyintf(v * inv), -m), m) as int32, NaN to -m (max_ps returns
 * its second operand on NaN, as fmaxf returns the number) */
static inline __m256i bw_codes(__m256 v, __m256 inv, float m) {
    __m256 q = _mm256_round_ps(_mm256_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(-m)), _mm256_set1_ps(m)));
}

/* row r of x [rows, k] as int16 codes, per-32 scales dx and exact sums xs */
static void bw_quantize_row(int dtype, const void *x, long off, long nb, int16_t *x16, float *dx, float *xs) {
    for (long j = 0; j < nb; j++) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int g = 0; g < 4; g++) {
            v[g] = bw_load8(dtype, x, off + 32 * j + 8 * g);
            amax = _mm256_max_ps(amax, bw_abs_ordered(v[g]));
        }
        const float a = bw_hmax(amax);
        const __m256 inv = _mm256_set1_ps(a > 0.0f ? BW_XMAX / a : 0.0f);
        dx[j] = a / BW_XMAX;
        xs[j] = bw_hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
        for (int g = 0; g < 4; g += 2) {
            /* packs interleaves the two vectors' 128-bit halves: 0xD8 puts them back in order */
            const __m256i p = _mm256_packs_epi32(bw_codes(v[g], inv, BW_XMAX), bw_codes(v[g + 1], inv, BW_XMAX));
            _mm256_storeu_si256((__m256i *)(x16 + 32 * j + 8 * g), _mm256_permute4x64_epi64(p, 0xD8));
        }
    }
}

/* ---- int8 activation codes: the path for decode rows ----
 *
 * Activations as int8 codes in -127..127 on one scale per 4 values, x ~ dx *
 * x8 (abs error <= max|x| of its 4 / 254: llama.cpp's q8_0 has one per 32,
 * which an outlier coarsens for its 31 neighbours; each int32 lane of the
 * vpmaddwd below holds 4 weights' products, so a vector of 8 scales costs
 * what one broadcast did), the block sums of x kept exact in float32 as above. One vpmaddubsw (unsigned bytes times signed
 * bytes, pairs summed into int16) takes 32 products where vpmaddwd takes 16,
 * and the weight codes need no widening. The codes are signed (|c| times
 * sign(c) x8: the sign moved onto the activation); the unsigned ones of Q4_1,
 * Q5_1, Q4_K and Q5_K are centred first (c - 8 or c - 16, the offset times f
 * added to the minimum's term on the exact sums), because the activations'
 * rounding error is multiplied by the code: centred, by |w| as it is with a
 * signed type, not by a code near 8 or 16 on weights near 0 (measured on the
 * Gemma 3 file's Q4_K tensors: 4.4x the bf16 weights' error uncentred). Bounds:
 * |c| <= 128 (Q8_0's -128), |x8| <= 127: a pair <= 32512, no int16
 * saturation; vpmaddwd then sums pairs into int32 by ones, or by Q6_K's int8
 * scales per 16 weights (<= 128 * 2 * 8128 per lane). */

#define BW_X8MAX 127.0f

static void bw_quantize_row8(int dtype, const void *x, long off, long nb, int8_t *x8, float *dx, float *xs) {
    const __m256 xmax = _mm256_set1_ps(BW_X8MAX);
    /* packs_epi32 then packs_epi16 leave 4-byte runs in this order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (long j = 0; j < nb; j++) {
        __m256 sum = _mm256_setzero_ps();
        __m256i c[4];
        for (int g = 0; g < 4; g++) {  /* vector g: the 4-value groups 2g and 2g + 1 */
            const __m256 v = bw_load8(dtype, x, off + 32 * j + 8 * g);
            sum = _mm256_add_ps(sum, v);
            __m256 a = bw_abs_ordered(v);
            a = _mm256_max_ps(a, _mm256_permute_ps(a, 0xB1));
            a = _mm256_max_ps(a, _mm256_permute_ps(a, 0x4E));  /* each group's maximum in its 4 lanes */
            const __m256 inv = _mm256_and_ps(_mm256_div_ps(xmax, a), _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_GT_OQ));
            const __m256 d = _mm256_div_ps(a, xmax);
            dx[8 * j + 2 * g] = _mm256_cvtss_f32(d);
            dx[8 * j + 2 * g + 1] = _mm_cvtss_f32(_mm256_extractf128_ps(d, 1));
            c[g] = bw_codes(v, inv, BW_X8MAX);
        }
        xs[j] = bw_hsum(sum);
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
        _mm256_storeu_si256((__m256i *)(x8 + 32 * j), _mm256_permutevar8x32_epi32(b, order));
    }
}

/* Q4_0, Q4_1, Q8_0, Q5_0, Q5_1: block b's 32 codes as bytes (signed, or unsigned
 * for the types with a minimum), its scale and minimum */
static inline __attribute__((always_inline)) __m256i bw8_small_block(int qt, const uint8_t *b, float *f, float *mn) {
    *f = bw_half(b);
    *mn = 0.0f;
    if (qt == BW_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    int with_min = qt == BW_Q4_1 || qt == BW_Q5_1;
    int five = qt == BW_Q5_0 || qt == BW_Q5_1;
    __m128i v = _mm_loadu_si128((const __m128i *)(b + 2 + 2 * with_min + 4 * five));
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
    if (five) {
        uint32_t qh;
        memcpy(&qh, b + 2 + 2 * with_min, 4);
        q = _mm256_or_si256(q, _mm256_and_si256(bw_bits32(qh), _mm256_set1_epi8(16)));
    }
    if (with_min) {
        *mn = bw_half(b + 2) + (five ? 16.0f : 8.0f) * *f;  /* centred, see above */
        return q;
    }
    return _mm256_sub_epi8(q, _mm256_set1_epi8(five ? 16 : 8));
}

/* the centre each unsigned type's codes are taken about (0: signed codes) */
static inline int bw8_centre(int qt) {
    return qt == BW_Q4_1 || qt == BW_Q4_K ? 8 : qt == BW_Q5_1 || qt == BW_Q5_K ? 16 : 0;
}

/* the 16 pair sums of codes q times activation codes xv: signed codes (|q| given
 * as aq) by moving the sign, unsigned ones less the centre's pair sums oc */
static inline __attribute__((always_inline)) __m256i bw8_pairs(int centred, __m256i q, __m256i aq, __m256i xv,
                                                               const int16_t *oc) {
    if (centred) return _mm256_sub_epi16(_mm256_maddubs_epi16(q, xv), _mm256_loadu_si256((const __m256i *)oc));
    return _mm256_maddubs_epi16(aq, _mm256_sign_epi8(xv, q));
}

/* One run j of 32 codes q (pair sums weighted by wt into int32) against R rows */
static inline __attribute__((always_inline)) void bw8_step(int R, int with_min, __m256i q, __m256i wt,
                                                           float f, float mn, long j, const int8_t *x, long k,
                                                           const float *dx, const float *xs, const int16_t *oc,
                                                           long nb, __m256 *acc, float *macc) {
    const __m256i aq = with_min ? q : _mm256_sign_epi8(q, q);
    for (int r = 0; r < R; r++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + r * k + 32 * j));
        __m256i s = _mm256_madd_epi16(bw8_pairs(with_min, q, aq, xv, oc + 16 * (r * nb + j)), wt);
        const __m256 d = _mm256_mul_ps(_mm256_set1_ps(f), _mm256_loadu_ps(dx + 8 * (r * nb + j)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, acc[r]);
        if (with_min) macc[r] += mn * xs[r * nb + j];
    }
}

/* out[r] = row `w` (k weights of type qt) . activation row r (int8 codes), r < R */
static inline __attribute__((always_inline)) void bw8_row(int qt, int R, const uint8_t *w, long k, const int8_t *x,
                                                          const float *dx, const float *xs, const int16_t *oc,
                                                          float *out) {
    const long nb = k / 32;
    const int mins = qt == BW_Q4_1 || qt == BW_Q5_1 || qt == BW_Q4_K || qt == BW_Q5_K;
    const __m256i ones = _mm256_set1_epi16(1), m15 = _mm256_set1_epi8(15);
    __m256 acc[2 * BW_ROWS];
    float macc[BW_ROWS];
    for (int r = 0; r < R; r++) {
        acc[r] = acc[BW_ROWS + r] = _mm256_setzero_ps();
        macc[r] = 0.0f;
    }
    if (qt <= BW_Q5_1) {
        const int size = bw_bytes[qt];
        long j = 0;
        for (; j + 2 <= nb; j += 2) {
            const uint8_t *b = w + j * size;
            _mm_prefetch((const char *)(b + BW_PREFETCH), BW_HINT);
            float f, mn, g, mm;
            __m256i q = bw8_small_block(qt, b, &f, &mn), p = bw8_small_block(qt, b + size, &g, &mm);
            bw8_step(R, mins, q, ones, f, mn, j, x, k, dx, xs, oc, nb, acc, macc);
            bw8_step(R, mins, p, ones, g, mm, j + 1, x, k, dx, xs, oc, nb, acc + BW_ROWS, macc);
        }
        for (; j < nb; j++) {
            float f, mn;
            __m256i q = bw8_small_block(qt, w + j * size, &f, &mn);
            bw8_step(R, mins, q, ones, f, mn, j, x, k, dx, xs, oc, nb, acc, macc);
        }
    } else {
        const int size = bw_bytes[qt];
        for (long sb = 0; sb < k / 256; sb++) {
            const uint8_t *b = w + sb * size;
            bw_prefetch_super(b);
            if (qt == BW_Q6_K) {
                const int8_t *sc = (const int8_t *)(b + 192);
                float d = bw_half(b + 208);
                const __m256i b32 = _mm256_set1_epi8(32);
                for (int h = 0; h < 2; h++) {
                    __m256i q[4];
                    bw_q6k_codes(b, h, q);
                    for (int t = 0; t < 4; t++) {
                        const int s = 8 * h + 2 * t;
                        /* pair sums 0..7 are weights 0..15 (scale sc[s]), 8..15 weights 16..31 */
                        const __m256i wt = _mm256_set_m128i(_mm_set1_epi16(sc[s + 1]), _mm_set1_epi16(sc[s]));
                        bw8_step(R, 0, _mm256_sub_epi8(q[t], b32), wt, d, 0.0f, 8 * sb + 4 * h + t, x, k, dx, xs,
                                 oc, nb, acc + BW_ROWS * (t & 1), macc);
                    }
                }
            } else {
                const int five = qt == BW_Q5_K;
                float d = bw_half(b), dmin = bw_half(b + 2);
                int sc[8], mn[8];
                bw_k_scales(b + 4, sc, mn);
                const uint8_t *qs = b + 16 + 32 * five;
                __m256i hv = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
                for (int i = 0; i < 4; i++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
                    for (int half = 0; half < 2; half++) {
                        const int s = 2 * i + half;
                        __m256i q = _mm256_and_si256(half ? _mm256_srli_epi16(v, 4) : v, m15);
                        if (five) {
                            __m256i bit = _mm256_set1_epi8((char)(1 << s));
                            __m256i on = _mm256_cmpeq_epi8(_mm256_and_si256(hv, bit), bit);
                            q = _mm256_or_si256(q, _mm256_and_si256(on, _mm256_set1_epi8(16)));
                        }
                        const float f = d * (float)sc[s], centre = five ? 16.0f : 8.0f;
                        bw8_step(R, 1, q, ones, f,
                                 centre * f - dmin * (float)mn[s], 8 * sb + s, x, k, dx, xs, oc, nb,
                                 acc + BW_ROWS * half, macc);
                    }
                }
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = bw_hsum(_mm256_add_ps(acc[r], acc[BW_ROWS + r])) + macc[r];
}

/* One activation row against two consecutive weight rows of a 32-weight-block type */
static inline __attribute__((always_inline)) void bw8_pair(int qt, const uint8_t *w, long row_bytes, long k,
                                                           const int8_t *x, const float *dx, const float *xs,
                                                           const int16_t *oc, float *out) {
    const long nb = k / 32;
    const int size = bw_bytes[qt], mins = qt == BW_Q4_1 || qt == BW_Q5_1;
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t *v = w + row_bytes;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    float m0 = 0.0f, m1 = 0.0f;
    for (long j = 0; j < nb; j++) {
        _mm_prefetch((const char *)(w + 2 * j * size + BW_PREFETCH), BW_HINT);
        float f, g, mn, mm;
        __m256i p = bw8_small_block(qt, w + j * size, &f, &mn), q = bw8_small_block(qt, v + j * size, &g, &mm);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * j));
        __m256i s = _mm256_madd_epi16(bw8_pairs(mins, p, _mm256_sign_epi8(p, p), xv, oc + 16 * j), ones);
        __m256i t = _mm256_madd_epi16(bw8_pairs(mins, q, _mm256_sign_epi8(q, q), xv, oc + 16 * j), ones);
        const __m256 d = _mm256_loadu_ps(dx + 8 * j);
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(_mm256_set1_ps(f), d), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(_mm256_set1_ps(g), d), a1);
        if (mins) {
            m0 += mn * xs[j];
            m1 += mm * xs[j];
        }
    }
    out[0] = bw_hsum(a0) + m0;
    out[1] = bw_hsum(a1) + m1;
}

typedef void (*bw8_pair_fn)(const uint8_t *, long, long, const int8_t *, const float *, const float *,
                            const int16_t *, float *);
#define BW8_PAIR(T)                                                                                        \
    static void bw8_pair_##T(const uint8_t *w, long rb, long k, const int8_t *x, const float *dx,          \
                             const float *xs, const int16_t *oc, float *out) {                             \
        bw8_pair(T, w, rb, k, x, dx, xs, oc, out);                                                         \
    }
BW8_PAIR(BW_Q4_0) BW8_PAIR(BW_Q4_1) BW8_PAIR(BW_Q8_0) BW8_PAIR(BW_Q5_0) BW8_PAIR(BW_Q5_1)
static const bw8_pair_fn bw8_pairs_of[BW_Q5_1 + 1] = {bw8_pair_BW_Q4_0, bw8_pair_BW_Q4_1, bw8_pair_BW_Q8_0,
                                                      bw8_pair_BW_Q5_0, bw8_pair_BW_Q5_1};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* ---- One decode row on AVX512-VNNI: Q4_0, Q4_1, Q5_0, Q5_1 by pairs of weight rows ----
 *
 * The same products as bw8_pair, two 32-weight blocks per 512-bit vector: the
 * codes stay unsigned (0..15, 0..31) and one vpdpbusd takes 64 of them against
 * the int8 activation codes, its accumulator started at the centre's lane sums
 * (-centre * the sum of each lane's 4 activation codes, per row once: oc32), so
 * each lane holds sum (c - centre) x8 exactly as the AVX2 step has it; the
 * float part (f times the lane's scale, the minimum's term on the exact sums)
 * is the AVX2 path's too. Where AVX2 spends a sign move, two multiply-adds and
 * the widening per 32 weights, this spends one instruction per 64. */
#define BW_VNNI 1

/* 32 unsigned codes of the block at b (fifth bits from qh where the type has them) */
static inline __m256i bw16_codes1(int qt, const uint8_t *b) {
    const int with_min = qt == BW_Q4_1 || qt == BW_Q5_1, five = qt == BW_Q5_0 || qt == BW_Q5_1;
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + 2 + 2 * with_min + 4 * five));
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
    if (five) {
        uint32_t qh;
        memcpy(&qh, b + 2 + 2 * with_min, 4);
        q = _mm256_or_si256(q, _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(16)));
    }
    return q;
}

/* the 64 codes of the blocks at b and b + size */
static inline __m512i bw16_codes2(int qt, const uint8_t *b, int size) {
    const int with_min = qt == BW_Q4_1 || qt == BW_Q5_1, five = qt == BW_Q5_0 || qt == BW_Q5_1;
    const int at = 2 + 2 * with_min + 4 * five;
    const __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(b + size + at)),
                                       _mm_loadu_si128((const __m128i *)(b + at)));
    /* [v0, v1, v0 >> 4, v1 >> 4] to [v0, v0 >> 4, v1, v1 >> 4]: each block's low then high nibbles */
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    z = _mm512_and_si512(_mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)), _mm512_set1_epi8(15));
    if (five) {
        uint32_t h0, h1;
        memcpy(&h0, b + 2 + 2 * with_min, 4);
        memcpy(&h1, b + size + 2 + 2 * with_min, 4);
        z = _mm512_or_si512(z, _mm512_maskz_mov_epi8(((__mmask64)h1 << 32) | h0, _mm512_set1_epi8(16)));
    }
    return z;
}

/* the block's scale f and its minimum's term per unit of sum x (0 without a minimum) */
static inline float bw16_scale(int qt, const uint8_t *b, float *mn) {
    const float f = bw_half(b);
    const int with_min = qt == BW_Q4_1 || qt == BW_Q5_1;
    *mn = with_min ? bw_half(b + 2) + (qt == BW_Q5_1 ? 16.0f : 8.0f) * f : 0.0f;
    return f;
}

static inline __attribute__((always_inline)) void bw16_pair(int qt, const uint8_t *w, long row_bytes, long k,
                                                            const int8_t *x, const float *dx, const float *xs,
                                                            const int32_t *oc32, float *out) {
    const long nb = k / 32;
    const int size = bw_bytes[qt];
    const uint8_t *v = w + row_bytes;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    float m0 = 0.0f, m1 = 0.0f;
    long j = 0;
    for (; j + 2 <= nb; j += 2) {
        _mm_prefetch((const char *)(w + j * size + BW_PREFETCH), BW_HINT);
        _mm_prefetch((const char *)(v + j * size + BW_PREFETCH), BW_HINT);
        const __m512i xv = _mm512_loadu_si512(x + 32 * j), c = _mm512_loadu_si512(oc32 + 8 * j);
        const __m512i s = _mm512_dpbusd_epi32(c, bw16_codes2(qt, w + j * size, size), xv);
        const __m512i t = _mm512_dpbusd_epi32(c, bw16_codes2(qt, v + j * size, size), xv);
        float n0, n1, n2, n3;
        const float f0 = bw16_scale(qt, w + j * size, &n0), f1 = bw16_scale(qt, w + (j + 1) * size, &n1);
        const float g0 = bw16_scale(qt, v + j * size, &n2), g1 = bw16_scale(qt, v + (j + 1) * size, &n3);
        const __m512 d = _mm512_loadu_ps(dx + 8 * j);
        const __m512 fs = _mm512_insertf32x8(_mm512_set1_ps(f0), _mm256_set1_ps(f1), 1);
        const __m512 gs = _mm512_insertf32x8(_mm512_set1_ps(g0), _mm256_set1_ps(g1), 1);
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(fs, d), a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(gs, d), a1);
        m0 += n0 * xs[j] + n1 * xs[j + 1];
        m1 += n2 * xs[j] + n3 * xs[j + 1];
    }
    float r0 = 0.0f, r1 = 0.0f;
    if (j < nb) { /* an odd last block */
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * j));
        const __m256i c = _mm256_loadu_si256((const __m256i *)(oc32 + 8 * j));
        const __m256i s = _mm256_dpbusd_epi32(c, bw16_codes1(qt, w + j * size), xv);
        const __m256i t = _mm256_dpbusd_epi32(c, bw16_codes1(qt, v + j * size), xv);
        float n0, n2;
        const float f0 = bw16_scale(qt, w + j * size, &n0), g0 = bw16_scale(qt, v + j * size, &n2);
        const __m256 d = _mm256_loadu_ps(dx + 8 * j);
        r0 = bw_hsum(_mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(_mm256_set1_ps(f0), d)));
        r1 = bw_hsum(_mm256_mul_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(_mm256_set1_ps(g0), d)));
        m0 += n0 * xs[j];
        m1 += n2 * xs[j];
    }
    out[0] = _mm512_reduce_add_ps(a0) + r0 + m0;
    out[1] = _mm512_reduce_add_ps(a1) + r1 + m1;
}

typedef void (*bw16_pair_fn)(const uint8_t *, long, long, const int8_t *, const float *, const float *,
                             const int32_t *, float *);
#define BW16_PAIR(T)                                                                                       \
    static void bw16_pair_##T(const uint8_t *w, long rb, long k, const int8_t *x, const float *dx,         \
                              const float *xs, const int32_t *oc, float *out) {                            \
        bw16_pair(T, w, rb, k, x, dx, xs, oc, out);                                                        \
    }
BW16_PAIR(BW_Q4_0) BW16_PAIR(BW_Q4_1) BW16_PAIR(BW_Q5_0) BW16_PAIR(BW_Q5_1)
static const bw16_pair_fn bw16_pairs_of[BW_Q5_1 + 1] = {bw16_pair_BW_Q4_0, bw16_pair_BW_Q4_1, 0,
                                                        bw16_pair_BW_Q5_0, bw16_pair_BW_Q5_1};

/* oc32[i] = -centre * (x8[4i] + .. + x8[4i + 3]) for i < k / 4 */
static void bw16_centre_sums(int centre, const int8_t *x8, long k, int32_t *oc32) {
    const __m256i cv = _mm256_set1_epi8((char)centre);
    for (long i = 0; i < k; i += 32)
        _mm256_storeu_si256((__m256i *)(oc32 + i / 4),
                            _mm256_sub_epi32(_mm256_setzero_si256(),
                                             _mm256_dpbusd_epi32(_mm256_setzero_si256(), cv,
                                                                 _mm256_loadu_si256((const __m256i *)(x8 + i)))));
}

/* ---- One decode row of Q4_K, Q5_K, Q6_K on AVX512-VNNI, with the int16 activation codes ----
 *
 * The codes split as x16 = 128 * xh + xl (xh = x16 >> 7 in -128..127, xl its low 7 bits), so the
 * unsigned weight codes c (0..15, 0..31, 0..63) take two vpdpbusd per 64 weights and no widening:
 * sum c x16 = 128 sum c xh + sum c xl, exact in each int32 lane of 4 consecutive weights (|lane| <
 * 2^23). Q6_K's codes are taken about 32 by starting xl's accumulator at -32 times the lane's sum
 * of x16 (oc32, per row once), and its int8 scale per 16 weights multiplies the lane in int32. Then
 * per lane the float part of the AVX2 path: the block's scale times the run's activation scale;
 * Q4_K/Q5_K's minimum on the exact run sums. The lanes group 4 consecutive weights where the AVX2
 * path's group 2 + 2 of 16 apart: the same integers, summed in float in another order. */

/* xh, xl (k each) of a row's int16 codes; with oc32, -32 x the sums of each 4 of them */
static void bwk_split(const int16_t *x16, long k, int8_t *xh, int8_t *xl, int32_t *oc32) {
    for (long i = 0; i < k; i += 32) {
        const __m512i v = _mm512_loadu_si512(x16 + i);
        _mm256_storeu_si256((__m256i *)(xh + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 7)));
        _mm256_storeu_si256((__m256i *)(xl + i), _mm512_cvtepi16_epi8(_mm512_and_si512(v, _mm512_set1_epi16(127))));
    }
    if (!oc32) return;
    const __m256i ones = _mm256_set1_epi8(1);
    for (long i = 0; i < k; i += 32) {
        const __m256i h = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, _mm256_loadu_si256((const __m256i *)(xh + i)));
        const __m256i l = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, _mm256_loadu_si256((const __m256i *)(xl + i)));
        const __m256i sum4 = _mm256_add_epi32(_mm256_slli_epi32(h, 7), l);
        _mm256_storeu_si256((__m256i *)(oc32 + i / 4), _mm256_mullo_epi32(sum4, _mm256_set1_epi32(-32)));
    }
}

/* the 64 codes z against activations at offset o: exact lane sums of c x16 (+ c0, the lanes' start) */
static inline __m512i bwk_dot(__m512i z, const int8_t *xh, const int8_t *xl, long o, __m512i c0) {
    const __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, _mm512_loadu_si512(xh + o));
    const __m512i lo = _mm512_dpbusd_epi32(c0, z, _mm512_loadu_si512(xl + o));
    return _mm512_add_epi32(_mm512_slli_epi32(hi, 7), lo);
}

static inline __attribute__((always_inline)) float bwk_row(int qt, const uint8_t *w, long k, const int8_t *xh,
                                                           const int8_t *xl, const int32_t *oc32, const float *dx,
                                                           const float *xs) {
    const int size = bw_bytes[qt];
    const __m256i m15 = _mm256_set1_epi8(15);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m256 macc = _mm256_setzero_ps();
    for (long sb = 0; sb < k / 256; sb++) {
        const uint8_t *b = w + sb * size;
        bw_prefetch_super(b);
        if (qt == BW_Q6_K) {
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = bw_half(b + 208);
            const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
            for (int h = 0; h < 2; h++) {
                __m256i q[4];
                bw_q6k_codes(b, h, q);
                for (int p = 0; p < 2; p++) {
                    const long o = 256 * sb + 128 * h + 64 * p, j = o / 32;
                    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(q[2 * p]), q[2 * p + 1], 1);
                    __m512i s = bwk_dot(z, xh, xl, o, _mm512_loadu_si512(oc32 + o / 4));
                    int32_t four;
                    memcpy(&four, sc + 8 * h + 4 * p, 4);
                    const __m512i scl = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(four), spread));
                    s = _mm512_mullo_epi32(s, scl);
                    const __m512 dv = _mm512_insertf32x8(_mm512_set1_ps(d * dx[j]), _mm256_set1_ps(d * dx[j + 1]), 1);
                    acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dv, acc[p]);
                }
            }
        } else {
            const int five = qt == BW_Q5_K;
            __m256i sc, mn;
            bw_k_scales8(b + 4, &sc, &mn);
            /* the 8 runs' factors d * sc * dx and their minimums' terms, 8 lanes at once (a scalar sum
             * of the minimums was one dependent add per 32 weights) */
            const __m256 f8 = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(bw_half(b)),
                                                          _mm256_cvtepi32_ps(sc)),
                                            _mm256_loadu_ps(dx + 8 * sb));
            macc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(-bw_half(b + 2)),
                                                 _mm256_cvtepi32_ps(mn)),
                                   _mm256_loadu_ps(xs + 8 * sb), macc);
            const __m512 f16 = _mm512_castps256_ps512(f8);
            const uint8_t *qs = b + 16 + 32 * five;
            const __m256i hv = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                const long o = 256 * sb + 64 * i;
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
                __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m15)),
                                               _mm256_and_si256(_mm256_srli_epi16(v, 4), m15), 1);
                if (five) {
                    const __mmask64 on = (__mmask64)_mm256_test_epi8_mask(hv, _mm256_set1_epi8((char)(1 << (2 * i)))) |
                        (__mmask64)_mm256_test_epi8_mask(hv, _mm256_set1_epi8((char)(1 << (2 * i + 1)))) << 32;
                    z = _mm512_or_si512(z, _mm512_maskz_mov_epi8(on, _mm512_set1_epi8(16)));
                }
                const __m512i s = bwk_dot(z, xh, xl, o, _mm512_setzero_si512());
                /* runs 2i and 2i + 1: lanes 0..7 and 8..15 */
                const __m512 f = _mm512_permutexvar_ps(_mm512_inserti64x4(_mm512_set1_epi32(2 * i),
                                                                          _mm256_set1_epi32(2 * i + 1), 1), f16);
                acc[i & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), f, acc[i & 1]);
            }
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) + bw_hsum(macc);
}

typedef float (*bwk_row_fn)(const uint8_t *, long, const int8_t *, const int8_t *, const int32_t *, const float *,
                            const float *);
#define BWK_ROW(T)                                                                                          \
    static float bwk_row_##T(const uint8_t *w, long k, const int8_t *xh, const int8_t *xl, const int32_t *oc, \
                             const float *dx, const float *xs) {                                           \
        return bwk_row(T, w, k, xh, xl, oc, dx, xs);                                                        \
    }
BWK_ROW(BW_Q4_K) BWK_ROW(BW_Q5_K) BWK_ROW(BW_Q6_K)
static const bwk_row_fn bwk_rows_of[3] = {bwk_row_BW_Q4_K, bwk_row_BW_Q5_K, bwk_row_BW_Q6_K};
#else
#define BW_VNNI 0
#endif

typedef void (*bw8_row_fn)(const uint8_t *, long, const int8_t *, const float *, const float *, const int16_t *,
                           float *);
#define BW8_FN(T, R)                                                                                       \
    static void bw8_row_##T##_##R(const uint8_t *w, long k, const int8_t *x, const float *dx, const float *xs, \
                                  const int16_t *oc, float *out) {                                         \
        bw8_row(T, R, w, k, x, dx, xs, oc, out);                                                           \
    }
#define BW8_TYPE(T) BW8_FN(T, 1) BW8_FN(T, 2) BW8_FN(T, 3) BW8_FN(T, 4)
BW8_TYPE(BW_Q4_0) BW8_TYPE(BW_Q4_1) BW8_TYPE(BW_Q8_0) BW8_TYPE(BW_Q5_0)
BW8_TYPE(BW_Q5_1) BW8_TYPE(BW_Q4_K) BW8_TYPE(BW_Q5_K) BW8_TYPE(BW_Q6_K)
#define BW8_ENTRY(T) {0, bw8_row_##T##_1, bw8_row_##T##_2, bw8_row_##T##_3, bw8_row_##T##_4}
static const bw8_row_fn bw8_rows[BW_NTYPES][BW_ROWS + 1] = {
    BW8_ENTRY(BW_Q4_0), BW8_ENTRY(BW_Q4_1), BW8_ENTRY(BW_Q8_0), BW8_ENTRY(BW_Q5_0),
    BW8_ENTRY(BW_Q5_1), BW8_ENTRY(BW_Q4_K), BW8_ENTRY(BW_Q5_K), BW8_ENTRY(BW_Q6_K)};

/* BW_PAIRS8: a bit per type whose one-row product goes by pairs of weight rows */
#ifndef BW_PAIRS8
#define BW_PAIRS8 ((1 << BW_Q4_0) | (1 << BW_Q4_1) | (1 << BW_Q5_0) | (1 << BW_Q5_1))
#endif
#else
#define BW_FAST 0
#endif

/* Whether this build has the kernel (a CPU with AVX2, FMA and F16C). */
int agentserve_block_fast(void) { return BW_FAST; }

/* y[r * ldy + o] = x[r] . W[o] (+ bias[o], float32) for r < rows, o < n: W
 * [n, k] of type qt (the BW_ enum) as the file's rows of blocks. dtype 0: x
 * and y float32, 1: bfloat16. Returns 0, or -1 when this build has no kernel,
 * -2 on a bad type or shape, -3 when out of memory. */
int agentserve_block_matmul(int qt, int dtype, const void *x, long rows, long k, const uint8_t *w, long n,
                            const float *bias, void *y, long ldy, int nthreads) {
#if BW_FAST
    if (qt < 0 || qt >= BW_NTYPES || rows < 0 || n < 0 || k <= 0 || k % bw_block[qt] || ldy < n) return -2;
    if (rows == 0 || n == 0) return 0;
    const long nb = k / 32, row_bytes = k / bw_block[qt] * bw_bytes[qt];
    int16_t *x16 = malloc(sizeof(int16_t) * (size_t)(rows * k));
    float *dx = malloc(sizeof(float) * (size_t)(2 * rows * nb));
    if (!x16 || !dx) {
        free(x16);
        free(dx);
        return -3;
    }
    float *xs = dx + rows * nb;
    float carry[rows];  /* 0, or NaN where a row has a non-finite activation, which its int16 codes cannot carry */
    for (long r = 0; r < rows; r++) {
        bw_quantize_row(dtype, x, r * k, nb, x16 + r * k, dx + r * nb, xs + r * nb);
        float sum = 0.0f;
        for (long j = 0; j < nb; j++) sum += xs[r * nb + j];
        carry[r] = 0.0f * sum;
    }
    /* outputs 0 .. 2 pairs - 1 by twos (Q8_0 decodes its codes in one step: its single rows measured faster) */
    const long pairs = rows == 1 && qt <= BW_Q5_1 && qt != BW_Q8_0 ? n / 2 : 0;
    if (pairs) {
        #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
        for (long p = 0; p < pairs; p++) {
            float out[2];
            bw_pairs[qt](w + 2 * p * row_bytes, row_bytes, k, x16, dx, xs, out);
            for (int i = 0; i < 2; i++)
                bw_store_y(dtype, y, 2 * p + i, out[i] + (bias ? bias[2 * p + i] : 0.0f) + carry[0]);
        }
    }
#if BW_VNNI
    /* one row of a K-quant: its codes split for vpdpbusd (above); AGENTSERVE_BLOCK_AVX2_K=1 keeps the
     * AVX2 path (tests/timing_block_kernel.py --kquant times the two side by side) */
    int8_t *xsplit = rows == 1 && qt >= BW_Q4_K && !getenv("AGENTSERVE_BLOCK_AVX2_K") ? malloc((size_t)(3 * k)) : NULL;
    if (xsplit) {
        int32_t *oc32 = qt == BW_Q6_K ? (int32_t *)(xsplit + 2 * k) : NULL;
        bwk_split(x16, k, xsplit, xsplit + k, oc32);
        const bwk_row_fn fn = bwk_rows_of[qt - BW_Q4_K];
        #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
        for (long o = 0; o < n; o++)
            bw_store_y(dtype, y, o, fn(w + o * row_bytes, k, xsplit, xsplit + k, oc32, dx, xs) +
                                        (bias ? bias[o] : 0.0f) + carry[0]);
        free(xsplit);
        free(x16);
        free(dx);
        return 0;
    }
#endif
    /* every other product, and an odd last output after the pairs (one row: no thread team) */
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1) if (!pairs)
    for (long o = 2 * pairs; o < n; o++) {
        const uint8_t *wr = w + o * row_bytes;
        float b = bias ? bias[o] : 0.0f;
        for (long r0 = 0; r0 < rows; r0 += BW_ROWS) {
            int R = rows - r0 < BW_ROWS ? (int)(rows - r0) : BW_ROWS;
            float out[BW_ROWS];
            bw_rows[qt][R](wr, k, x16 + r0 * k, dx + r0 * nb, xs + r0 * nb, out);
            for (int r = 0; r < R; r++) bw_store_y(dtype, y, (r0 + r) * ldy + o, out[r] + b + carry[r0 + r]);
        }
    }
    free(x16);
    free(dx);
    return 0;
#else
    (void)qt; (void)dtype; (void)x; (void)rows; (void)k; (void)w; (void)n; (void)bias; (void)y; (void)ldy;
    (void)nthreads;
    return -1;
#endif
}

/* agentserve_block_matmul with the activations as int8 codes (the coarser,
 * faster path: see above); same arguments and return codes. */
int agentserve_block_matmul8(int qt, int dtype, const void *x, long rows, long k, const uint8_t *w, long n,
                             const float *bias, void *y, long ldy, int nthreads) {
#if BW_FAST
    if (qt < 0 || qt >= BW_NTYPES || rows < 0 || n < 0 || k <= 0 || k % bw_block[qt] || ldy < n) return -2;
    if (rows == 0 || n == 0) return 0;
    const long nb = k / 32, row_bytes = k / bw_block[qt] * bw_bytes[qt];
    const int centre = bw8_centre(qt);
    int8_t *x8 = malloc((size_t)(rows * k));
    float *dx = malloc(sizeof(float) * (size_t)(9 * rows * nb));  /* 8 scales and a sum per 32 */
    int16_t *oc = centre ? malloc(sizeof(int16_t) * (size_t)(rows * k / 2)) : NULL;
    if (!x8 || !dx || (centre && !oc)) {
        free(x8);
        free(dx);
        free(oc);
        return -3;
    }
    float *xs = dx + 8 * rows * nb;
    float carry[rows];  /* 0, or NaN where a row has a non-finite activation, which its codes cannot carry */
    for (long r = 0; r < rows; r++) {
        bw_quantize_row8(dtype, x, r * k, nb, x8 + r * k, dx + 8 * r * nb, xs + r * nb);
        /* the centre's pair sums, which the unsigned codes' products less them are the centred ones' */
        for (long i = 0; centre && i < k; i += 32)
            _mm256_storeu_si256((__m256i *)(oc + (r * k + i) / 2),
                                _mm256_maddubs_epi16(_mm256_set1_epi8((char)centre),
                                                     _mm256_loadu_si256((const __m256i *)(x8 + r * k + i))));
        float sum = 0.0f;
        for (long j = 0; j < nb; j++) sum += xs[r * nb + j];
        carry[r] = 0.0f * sum;
    }
    const long pairs = rows == 1 && qt <= BW_Q5_1 && ((BW_PAIRS8 >> qt) & 1) ? n / 2 : 0;
    int32_t *oc32 = NULL;
#if BW_VNNI
    if (pairs && (oc32 = malloc(sizeof(int32_t) * (size_t)(k / 4))) != NULL)
        bw16_centre_sums(qt == BW_Q5_0 || qt == BW_Q5_1 ? 16 : 8, x8, k, oc32);
#endif
    if (pairs) {
        #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
        for (long p = 0; p < pairs; p++) {
            float out[2];
#if BW_VNNI
            if (oc32)
                bw16_pairs_of[qt](w + 2 * p * row_bytes, row_bytes, k, x8, dx, xs, oc32, out);
            else
#endif
            bw8_pairs_of[qt](w + 2 * p * row_bytes, row_bytes, k, x8, dx, xs, oc, out);
            for (int i = 0; i < 2; i++)
                bw_store_y(dtype, y, 2 * p + i, out[i] + (bias ? bias[2 * p + i] : 0.0f) + carry[0]);
        }
    }
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1) if (!pairs)
    for (long o = 2 * pairs; o < n; o++) {
        const uint8_t *wr = w + o * row_bytes;
        float b = bias ? bias[o] : 0.0f;
        for (long r0 = 0; r0 < rows; r0 += BW_ROWS) {
            int R = rows - r0 < BW_ROWS ? (int)(rows - r0) : BW_ROWS;
            float out[BW_ROWS];
            bw8_rows[qt][R](wr, k, x8 + r0 * k, dx + 8 * r0 * nb, xs + r0 * nb, oc ? oc + r0 * k / 2 : NULL, out);
            for (int r = 0; r < R; r++) bw_store_y(dtype, y, (r0 + r) * ldy + o, out[r] + b + carry[r0 + r]);
        }
    }
    free(x8);
    free(dx);
    free(oc);
    free(oc32);
    return 0;
#else
    (void)qt; (void)dtype; (void)x; (void)rows; (void)k; (void)w; (void)n; (void)bias; (void)y; (void)ldy;
    (void)nthreads;
    return -1;
#endif
}
