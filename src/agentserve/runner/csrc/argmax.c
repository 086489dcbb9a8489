/* Greedy sampling's argmax over a row of float32 logits, as torch.argmax picks
 * it (the first maximum; the first NaN where a row has one), in one vector pass
 * for the maximum and one for its index: torch's CPU argmax is a scalar loop,
 * about half a millisecond a step over a 262k-token vocabulary. */

#include <math.h>
#include <stdint.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

static long argmax_row(const float *x, long n) {
    float best = -INFINITY;
    long j = 0;
    int nan = 0;
#if defined(__AVX2__)
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, un = _mm256_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + 8);
        un = _mm256_or_ps(un, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
        m0 = _mm256_max_ps(m0, a);
        m1 = _mm256_max_ps(m1, b);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    for (int i = 0; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
    nan = !_mm256_testz_ps(un, un);
#endif
    for (; j < n; j++) {
        if (x[j] != x[j]) nan = 1;
        else if (x[j] > best) best = x[j];
    }
    long i = 0;
#if defined(__AVX2__)
    const __m256 b = _mm256_set1_ps(best);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, b, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; i < n; i++)
        if (nan ? x[i] != x[i] : x[i] == best) return i;
    return 0; /* n == 0 */
}

/* out[r] = argmax of row r of x [rows, n] */
void agentserve_argmax_rows(const float *x, long rows, long n, int64_t *out) {
    for (long r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n);
}
