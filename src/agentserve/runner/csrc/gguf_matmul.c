/* y = x W^T for GGUF Q4_0/Q4_1 and Q8_0 weights kept as stored, for the few
 * rows of a decode step.
 *
 * A Q4 weight is w = d*q + m per block of 32 columns (q in 0..15; Q4_0 is
 * m = -8d). The activations are quantized per block too, as llama.cpp does
 * for the same files: x ~ dx * x8, x8 int8 with dx = max|x| / 127. Then
 *
 *     sum_k w_k x_k = d * dx * sum_k q_k x8_k  +  m * sum_k x_k
 *
 * and the inner sum is an integer dot product (AVX512-VNNI's vpdpbusd takes
 * four u8 x s8 products per 32-bit lane). One level of int8 codes, as
 * llama.cpp has it, costs SmolLM2 4-5% of its greedy choices against the
 * dequantized bfloat16 weights (relative logit error 9%); so the activations
 * get two levels (q4_quantize_row), which makes the product as precise as the
 * bfloat16 activations themselves, for twice the integer work. The minimum
 * term uses the exact float sum of the block's activations.
 *
 * Packed layout (agentserve_q4_pack): tiles of 16 output rows; per tile, per
 * 32-column block, 320 contiguous bytes: 256 bytes of codes, 16 fp16 scales d,
 * 16 fp16 minimums m. Codes are arranged so that one 64-byte load, split into
 * low and high nibbles, gives two vpdpbusd operands whose lane n holds 4
 * consecutive codes of output row n: load c (0..3) holds columns 4c..4c+3 in
 * its low nibbles and 16+4c..16+4c+3 in its high ones. A tile's whole row of
 * blocks streams from memory in order; the 16 outputs of a tile accumulate in
 * one vector per activation row, with no horizontal sums.
 *
 * Q8_0 (w = d*q, q int8, blocks of 32; agentserve_q8_pack, 576 bytes per
 * tile and block: 512 of codes, 16 fp16 scales, 16 int16 code sums) goes
 * the same way with the roles swapped: vpdpbusd wants its unsigned operand,
 * so the activation codes are offset by 128 and the code sums take the offset
 * back out.
 *
 * Built only where the compiler targets AVX512-VNNI (agentserve_q4_fast()
 * says so); elsewhere the caller uses torch's int4 kernel for Q4 and
 * dequantized weights for Q8_0. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define Q4_TILE 16
#define Q4_BLOCK 32
#define Q4_TILE_BLOCK_BYTES 320
#define Q8_TILE_BLOCK_BYTES 576
#define Q4_ROWS 8 /* activation rows sharing one pass over a tile's weights */
/* Bytes ahead of the tile block being read that a batch-1 step asks for: the
 * hardware prefetcher alone left the LM head at ~75% of the read bandwidth
 * (measured on Zen 4; 4 blocks ahead brought it to ~92%) */
#define Q8_PREFETCH (4 * Q8_TILE_BLOCK_BYTES)
#define Q4_PREFETCH (4 * Q4_TILE_BLOCK_BYTES)

static inline float q4_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    v.u = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112u) << 23) | (man << 13));
    return v.f;
}

/* codes uint8 [n, k] (0..15), d and m fp16 bits [n, k/32] -> out [n/16][k/32][320].
 * n a multiple of 16, k of 32. */
void agentserve_q4_pack(const uint8_t *codes, const uint16_t *d, const uint16_t *m, long n, long k,
                        uint8_t *out) {
    long nb = k / Q4_BLOCK;
    for (long t = 0; t < n / Q4_TILE; t++) {
        for (long b = 0; b < nb; b++) {
            uint8_t *dst = out + (t * nb + b) * Q4_TILE_BLOCK_BYTES;
            for (int c = 0; c < 4; c++)
                for (int lane = 0; lane < Q4_TILE; lane++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t *row = codes + (t * Q4_TILE + lane) * k + b * Q4_BLOCK;
                        dst[c * 64 + lane * 4 + j] = (uint8_t)((row[4 * c + j] & 15) | (row[16 + 4 * c + j] << 4));
                    }
            uint16_t *dd = (uint16_t *)(dst + 256), *mm = (uint16_t *)(dst + 288);
            for (int lane = 0; lane < Q4_TILE; lane++) {
                dd[lane] = d[(t * Q4_TILE + lane) * nb + b];
                mm[lane] = m[(t * Q4_TILE + lane) * nb + b];
            }
        }
    }
}

/* codes int8 [n, k], d fp16 bits [n, k/32] -> out [n/16][k/32][576]: group g
 * (0..7) of 64 bytes holds columns 4g..4g+3 of each of the 16 rows. */
void agentserve_q8_pack(const int8_t *codes, const uint16_t *d, long n, long k, uint8_t *out) {
    long nb = k / Q4_BLOCK;
    for (long t = 0; t < n / Q4_TILE; t++) {
        for (long b = 0; b < nb; b++) {
            uint8_t *dst = out + (t * nb + b) * Q8_TILE_BLOCK_BYTES;
            uint16_t *dd = (uint16_t *)(dst + 512);
            int16_t *sums = (int16_t *)(dst + 544);
            for (int lane = 0; lane < Q4_TILE; lane++) {
                const int8_t *row = codes + (t * Q4_TILE + lane) * k + b * Q4_BLOCK;
                int sum = 0;
                for (int g = 0; g < 8; g++)
                    for (int j = 0; j < 4; j++) {
                        dst[g * 64 + lane * 4 + j] = (uint8_t)row[4 * g + j];
                        sum += row[4 * g + j];
                    }
                dd[lane] = d[(t * Q4_TILE + lane) * nb + b];
                sums[lane] = (int16_t)sum;
            }
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define Q4_FAST 1

static inline __m512 q4_load_x16(int dtype, const void *x, long off) {
    if (dtype) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + off));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)x + off);
}

/* One row's blocks as int8 codes in two levels, their scale and the exact
 * block sum: x ~ dx * (hi + lo / 128), hi = round(x / dx), lo the rounded
 * remainder in units of dx/128 (|lo| <= 64): relative error ~1e-5 per
 * element instead of ~4e-3 for one level. */
static void q4_quantize_row(int dtype, const void *x, long off, long nb, int8_t *hi, int8_t *lo, float *dx,
                            float *sx) {
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (long b = 0; b < nb; b++) {
        __m512 v[2] = {q4_load_x16(dtype, x, off + b * Q4_BLOCK), q4_load_x16(dtype, x, off + b * Q4_BLOCK + 16)};
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        sx[b] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
        float scale = amax / 127.0f;
        dx[b] = scale;
        __m512 inv = _mm512_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
        for (int h = 0; h < 2; h++) {
            __m512 u = _mm512_mul_ps(v[h], inv);
            __m512 r = _mm512_roundscale_ps(u, rnd);
            __m512i ih = _mm512_cvt_roundps_epi32(r, rnd);
            __m512i il = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_sub_ps(u, r), _mm512_set1_ps(128.0f)), rnd);
            _mm_storeu_si128((__m128i *)(hi + b * Q4_BLOCK + 16 * h), _mm512_cvtsepi32_epi8(ih));
            _mm_storeu_si128((__m128i *)(lo + b * Q4_BLOCK + 16 * h), _mm512_cvtsepi32_epi8(il));
        }
    }
}

static inline void q4_store16(int dtype, void *y, long off, __m512 v) {
    if (dtype) {
        /* round to nearest even, NaN kept quiet */
        __m512i u = _mm512_castps_si512(v);
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                         _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
        __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + off), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
    } else {
        _mm512_storeu_ps((float *)y + off, v);
    }
}

/* rows (<= Q4_ROWS, a constant after inlining) activation rows against one tile */
static inline __attribute__((always_inline)) void q4_tile(const uint8_t *wt, long nb, int rows, const int8_t *x8,
                                                          const int8_t *x8lo, const float *dx, const float *sx,
                                                          long k, __m512 *acc) {
    const __m512i lo = _mm512_set1_epi8(15);
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = wt + b * Q4_TILE_BLOCK_BYTES;
        for (int c = 0; c < Q4_TILE_BLOCK_BYTES / 64; c++)
            _mm_prefetch((const char *)(p + Q4_PREFETCH + 64 * c), _MM_HINT_T0);
        __m512i w[8];
        for (int c = 0; c < 4; c++) {
            __m512i raw = _mm512_loadu_si512(p + 64 * c);
            w[c] = _mm512_and_si512(raw, lo);
            w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), lo);
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 256)));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 288)));
        for (int r = 0; r < rows; r++) {
            const int32_t *xs = (const int32_t *)(x8 + r * k + b * Q4_BLOCK);
            /* sum q*(128 hi + lo), below 2^23: exact in float32; two chains
             * per level, as in q8_tile */
            const int32_t *xl = (const int32_t *)(x8lo + r * k + b * Q4_BLOCK);
            __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
            for (int g = 0; g < 8; g += 2) {
                h0 = _mm512_dpbusd_epi32(h0, w[g], _mm512_set1_epi32(xs[g]));
                h1 = _mm512_dpbusd_epi32(h1, w[g + 1], _mm512_set1_epi32(xs[g + 1]));
                l0 = _mm512_dpbusd_epi32(l0, w[g], _mm512_set1_epi32(xl[g]));
                l1 = _mm512_dpbusd_epi32(l1, w[g + 1], _mm512_set1_epi32(xl[g + 1]));
            }
            __m512i s = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 7), _mm512_add_epi32(l0, l1));
            long i = r * nb + b;
            __m512 unit = _mm512_mul_ps(d, _mm512_set1_ps(dx[i] * (1.0f / 128.0f)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), unit, acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[i]), acc[r]);
        }
    }
}

#define Q4_TILE_ROWS(R)                                                                       \
    static void q4_tile_##R(const uint8_t *wt, long nb, const int8_t *x8, const int8_t *x8lo,  \
                            const float *dx, const float *sx, long k, __m512 *acc) {          \
        q4_tile(wt, nb, R, x8, x8lo, dx, sx, k, acc);                                         \
    }
Q4_TILE_ROWS(1) Q4_TILE_ROWS(2) Q4_TILE_ROWS(3) Q4_TILE_ROWS(4)
Q4_TILE_ROWS(5) Q4_TILE_ROWS(6) Q4_TILE_ROWS(7) Q4_TILE_ROWS(8)

typedef void (*q4_tile_fn)(const uint8_t *, long, const int8_t *, const int8_t *, const float *, const float *, long,
                           __m512 *);
static const q4_tile_fn q4_tiles[Q4_ROWS + 1] = {0, q4_tile_1, q4_tile_2, q4_tile_3, q4_tile_4,
                                                  q4_tile_5, q4_tile_6, q4_tile_7, q4_tile_8};
/* Q8_0: the activation codes offset to unsigned (hi + 128, lo + 128), so
 * s = 128 sum q(hi+128) + sum q(lo+128) = sum q(128 hi + lo) + 16512 sum q. */
static inline __attribute__((always_inline)) void q8_tile(const uint8_t *wt, long nb, int rows, const uint8_t *xu,
                                                          const uint8_t *xulo, const float *dx, long k,
                                                          __m512 *acc) {
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *p = wt + b * Q8_TILE_BLOCK_BYTES;
        for (int c = 0; c < Q8_TILE_BLOCK_BYTES / 64; c++)
            _mm_prefetch((const char *)(p + Q8_PREFETCH + 64 * c), _MM_HINT_T0);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 512)));
        __m512i offset = _mm512_mullo_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(p + 544))),
                                            _mm512_set1_epi32(16512));
        for (int r = 0; r < rows; r++) {
            const int32_t *xs = (const int32_t *)(xu + r * k + b * Q4_BLOCK);
            const int32_t *xl = (const int32_t *)(xulo + r * k + b * Q4_BLOCK);
            /* four independent chains per level: one chain of 16 vpdpbusd
             * waits out its latency at every step (integer sums: same result) */
            __m512i h[4], l[4];
            for (int g = 0; g < 4; g++) {
                const __m512i w = _mm512_loadu_si512(p + 64 * g);
                h[g] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(xs[g]), w);
                l[g] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(xl[g]), w);
            }
            for (int g = 4; g < 8; g++) {
                const __m512i w = _mm512_loadu_si512(p + 64 * g);
                h[g - 4] = _mm512_dpbusd_epi32(h[g - 4], _mm512_set1_epi32(xs[g]), w);
                l[g - 4] = _mm512_dpbusd_epi32(l[g - 4], _mm512_set1_epi32(xl[g]), w);
            }
            __m512i s = _mm512_add_epi32(_mm512_add_epi32(h[0], h[1]), _mm512_add_epi32(h[2], h[3]));
            s = _mm512_add_epi32(_mm512_slli_epi32(s, 7),
                                 _mm512_add_epi32(_mm512_add_epi32(l[0], l[1]), _mm512_add_epi32(l[2], l[3])));
            s = _mm512_sub_epi32(s, offset);
            __m512 unit = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * nb + b] * (1.0f / 128.0f)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), unit, acc[r]);
        }
    }
}

#define Q8_TILE_ROWS(R)                                                                       \
    static void q8_tile_##R(const uint8_t *wt, long nb, const uint8_t *xu, const uint8_t *xl, \
                            const float *dx, long k, __m512 *acc) {                           \
        q8_tile(wt, nb, R, xu, xl, dx, k, acc);                                               \
    }
Q8_TILE_ROWS(1) Q8_TILE_ROWS(2) Q8_TILE_ROWS(3) Q8_TILE_ROWS(4)
Q8_TILE_ROWS(5) Q8_TILE_ROWS(6) Q8_TILE_ROWS(7) Q8_TILE_ROWS(8)

typedef void (*q8_tile_fn)(const uint8_t *, long, const uint8_t *, const uint8_t *, const float *, long, __m512 *);
static const q8_tile_fn q8_tiles[Q4_ROWS + 1] = {0, q8_tile_1, q8_tile_2, q8_tile_3, q8_tile_4,
                                                  q8_tile_5, q8_tile_6, q8_tile_7, q8_tile_8};
#else
#define Q4_FAST 0
#endif

int agentserve_q4_fast(void) { return Q4_FAST; }

/* y [rows, n] = x [rows, k] W^T (+ bias [n], float32), W packed by
 * agentserve_q4_pack (q8 = 0) or agentserve_q8_pack (q8 = 1). dtype 0: x and
 * y float32, 1: bfloat16. Returns 0, or -1 when this build has no kernel (not
 * an AVX512-VNNI target), -2 on bad shapes, -3 when out of memory. */
int agentserve_gguf_matmul(int q8, int dtype, const void *x, long rows, long k, const uint8_t *w, long n,
                           const float *bias, void *y, int nthreads) {
#if Q4_FAST
    if (rows < 0 || n % Q4_TILE || k % Q4_BLOCK) return -2;
    if (rows == 0) return 0;
    long nb = k / Q4_BLOCK, ntiles = n / Q4_TILE;
    const long tile_bytes = nb * (q8 ? Q8_TILE_BLOCK_BYTES : Q4_TILE_BLOCK_BYTES);
    int8_t *x8 = malloc((size_t)(2 * rows * k) + 64);
    float *dx = malloc(sizeof(float) * (size_t)(2 * rows * nb));
    if (!x8 || !dx) {
        free(x8);
        free(dx);
        return -3;
    }
    float *sx = dx + rows * nb;
    int8_t *x8lo = x8 + rows * k;
    for (long r = 0; r < rows; r++)
        q4_quantize_row(dtype, x, r * k, nb, x8 + r * k, x8lo + r * k, dx + r * nb, sx + r * nb);
    if (q8) { /* unsigned codes for vpdpbusd: + 128 */
        for (long i = 0; i < 2 * rows * k; i++) x8[i] = (int8_t)(uint8_t)((int)x8[i] + 128);
    }
    #pragma omp parallel for schedule(static) num_threads(nthreads > 0 ? nthreads : 1)
    for (long t = 0; t < ntiles; t++) {
        const uint8_t *wt = w + t * tile_bytes;
        __m512 b = bias ? _mm512_loadu_ps(bias + t * Q4_TILE) : _mm512_setzero_ps();
        for (long r0 = 0; r0 < rows; r0 += Q4_ROWS) {
            int R = rows - r0 < Q4_ROWS ? (int)(rows - r0) : Q4_ROWS;
            __m512 acc[Q4_ROWS];
            if (q8)
                q8_tiles[R](wt, nb, (const uint8_t *)x8 + r0 * k, (const uint8_t *)x8lo + r0 * k, dx + r0 * nb, k, acc);
            else
                q4_tiles[R](wt, nb, x8 + r0 * k, x8lo + r0 * k, dx + r0 * nb, sx + r0 * nb, k, acc);
            for (int r = 0; r < R; r++) q4_store16(dtype, y, (r0 + r) * n + t * Q4_TILE, _mm512_add_ps(acc[r], b));
        }
    }
    free(x8);
    free(dx);
    return 0;
#else
    (void)q8; (void)dtype; (void)x; (void)rows; (void)k; (void)w; (void)n; (void)bias; (void)y; (void)nthreads;
    return -1;
#endif
}
