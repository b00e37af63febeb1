/* AdamW / Adam step over flat fp32 shards, bitwise equal to torch's single-tensor step.
   Built on first use by runtime/io/native.py and checked against torch before it is used;
   the contract and the checks are in runtime/offload/host_adam.py. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef void (*vsqrt_fn)(int n, const float *a, float *r, int64_t mode);
#define TILE 4096
#define PREFETCH_AHEAD 128  /* floats (512 B) ahead of the 8-wide loop */
#define SPAN 2              /* vectors of each array per round of the 16-wide loop */

#if defined(__AVX2__)
/* MKL's SSE2 high-accuracy float sqrt (mkl_vml_kernel_sSqrt_EXHAynn, the kernel MKL
   runs where it does not use its AVX-512/AVX2 paths, e.g. on AMD CPUs), operation for
   operation: rsqrt estimate, one Newton step on sqrt and on 1/(2 sqrt), one correction;
   no fused multiply-adds. Lanes MKL sends to its scalar path (zero, subnormal, negative,
   inf, NaN, near FLT_MAX) are not reproduced except +0: returns 1 if it meets another. */
static inline __m256 mkl_ex_sqrt_ps(__m256 x, int *needs_mkl)
{
    const __m256 half = _mm256_set1_ps(0.5f);
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i special = _mm256_cmpgt_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7f800000)),
                                               _mm256_set1_epi32((int)0xfefff000u));
    const __m256 y = _mm256_rsqrt_ps(x);
    const __m256 s = _mm256_mul_ps(x, y);
    const __m256 h = _mm256_mul_ps(y, half);
    const __m256 e = _mm256_sub_ps(half, _mm256_mul_ps(s, h));
    const __m256 s1 = _mm256_add_ps(_mm256_mul_ps(s, e), s);
    const __m256 h1 = _mm256_add_ps(_mm256_mul_ps(e, h), h);
    const __m256 d = _mm256_sub_ps(x, _mm256_mul_ps(s1, s1));
    __m256 res = _mm256_add_ps(_mm256_mul_ps(d, h1), s1);
    *needs_mkl = 0;
    if (!_mm256_testz_si256(special, special)) {
        const __m256i zero = _mm256_cmpeq_epi32(bits, _mm256_setzero_si256());
        if (!_mm256_testc_si256(zero, special)) *needs_mkl = 1;  /* a special lane that is not +0 */
        res = _mm256_blendv_ps(res, _mm256_setzero_ps(), _mm256_castsi256_ps(special));
    }
    return res;
}

static int mkl_ex_sqrt8(const float *a, float *r)
{
    int needs_mkl;
    const __m256 res = mkl_ex_sqrt_ps(_mm256_loadu_ps(a), &needs_mkl);
    if (!needs_mkl) _mm256_storeu_ps(r, res);
    return needs_mkl;
}

/* sqrt of a[0..n) into r; 1 if some element needs MKL's scalar path (r then incomplete). */
int zdsl_mkl_ex_sqrt(int n, const float *a, float *r)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        if (mkl_ex_sqrt8(a + i, r + i)) return 1;
    if (i < n) {
        float in[8] = {1, 1, 1, 1, 1, 1, 1, 1}, out[8];
        memcpy(in, a + i, (size_t)(n - i) * sizeof(float));
        if (mkl_ex_sqrt8(in, out)) return 1;
        memcpy(r + i, out, (size_t)(n - i) * sizeof(float));
    }
    return 0;
}
#else
int zdsl_mkl_ex_sqrt(int n, const float *a, float *r) { (void)n; (void)a; (void)r; return 1; }
#endif

#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512F__) && defined(__AVX512DQ__)
static inline __m512 mkl_ex_sqrt_ps512(__m512 x, int *needs_mkl)
{
    const __m512 half = _mm512_set1_ps(0.5f);
    const __m512i bits = _mm512_castps_si512(x);
    const __mmask16 special = _mm512_cmpgt_epi32_mask(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7f800000)),
                                                      _mm512_set1_epi32((int)0xfefff000u));
    const __m256 ylo = _mm256_rsqrt_ps(_mm512_castps512_ps256(x));
    const __m256 yhi = _mm256_rsqrt_ps(_mm512_extractf32x8_ps(x, 1));
    const __m512 y = _mm512_insertf32x8(_mm512_castps256_ps512(ylo), yhi, 1);
    const __m512 s = _mm512_mul_ps(x, y);
    const __m512 h = _mm512_mul_ps(y, half);
    const __m512 e = _mm512_sub_ps(half, _mm512_mul_ps(s, h));
    const __m512 s1 = _mm512_add_ps(_mm512_mul_ps(s, e), s);
    const __m512 h1 = _mm512_add_ps(_mm512_mul_ps(e, h), h);
    const __m512 d = _mm512_sub_ps(x, _mm512_mul_ps(s1, s1));
    __m512 res = _mm512_add_ps(_mm512_mul_ps(d, h1), s1);
    *needs_mkl = 0;
    if (special) {
        const __mmask16 zero = _mm512_cmpeq_epi32_mask(bits, _mm512_setzero_si512());
        if (special & ~zero) *needs_mkl = 1;
        res = _mm512_mask_mov_ps(res, special, _mm512_setzero_ps());
    }
    return res;
}

/* 16 floats a vector, SPAN vectors of each array a round: all loads of a round
   first, array by array (the shape of DeepSpeed's Step_AVX), then the arithmetic, then
   the stores; no prefetch instructions. The step is compute-bound (MKL's sqrt sequence
   and two divisions), so the loop shape decides: on a cache-resident 256K shard one
   vector and four prefetches a round ran at 1002 Mparams/s, eight vectors 1119-1450
   (register spills), four 1768-2215, two 1872-2126; at 16M and 64M two was the best. */
static inline __attribute__((always_inline)) int64_t adam_fused16_body(
    float *restrict p, const float *restrict g, float *restrict m, float *restrict v, int64_t n,
    float decay, float wd, float w, float b2, float omb2, float bc2s, float eps, float neg_step,
    vsqrt_fn vsqrt, int64_t vmode, const int decays, const int l2, const int big_w,
    const int fma_cmul, const int fma_alpha)
{
    const __m512 vdec = _mm512_set1_ps(decay), vwd = _mm512_set1_ps(wd), vw = _mm512_set1_ps(w);
    const __m512 vwm1 = _mm512_set1_ps(w - 1.0f), vb2 = _mm512_set1_ps(b2), vomb2 = _mm512_set1_ps(omb2);
    const __m512 vbc2s = _mm512_set1_ps(bc2s), veps = _mm512_set1_ps(eps), vneg = _mm512_set1_ps(neg_step);
    int64_t i = 0;
    for (; i + 16 * SPAN <= n; i += 16 * SPAN) {
        __m512 P[SPAN], G[SPAN], M[SPAN], V[SPAN], S[SPAN];
        for (int k = 0; k < SPAN; k++) G[k] = _mm512_loadu_ps(g + i + 16 * k);
        for (int k = 0; k < SPAN; k++) M[k] = _mm512_loadu_ps(m + i + 16 * k);
        for (int k = 0; k < SPAN; k++) V[k] = _mm512_loadu_ps(v + i + 16 * k);
        for (int k = 0; k < SPAN; k++) P[k] = _mm512_loadu_ps(p + i + 16 * k);
        int needs_mkl = 0;
        for (int k = 0; k < SPAN; k++) {
            if (decays) P[k] = _mm512_mul_ps(P[k], vdec);
            if (l2) G[k] = fma_alpha ? _mm512_fmadd_ps(vwd, P[k], G[k]) : _mm512_add_ps(G[k], _mm512_mul_ps(vwd, P[k]));
            const __m512 diff = _mm512_sub_ps(G[k], M[k]);
            M[k] = big_w ? _mm512_fmadd_ps(vwm1, diff, G[k]) : _mm512_fmadd_ps(vw, diff, M[k]);
            const __m512 vb = _mm512_mul_ps(V[k], vb2), og = _mm512_mul_ps(vomb2, G[k]);
            V[k] = fma_cmul ? _mm512_fmadd_ps(og, G[k], vb) : _mm512_add_ps(vb, _mm512_mul_ps(og, G[k]));
            int special;
            S[k] = mkl_ex_sqrt_ps512(V[k], &special);
            needs_mkl |= special;
        }
        if (__builtin_expect(needs_mkl, 0)) {  /* MKL itself for the whole round */
            float vs[16] __attribute__((aligned(64))), ss[16] __attribute__((aligned(64)));
            for (int k = 0; k < SPAN; k++) {
                _mm512_store_ps(vs, V[k]);
                vsqrt(16, vs, ss, vmode);
                S[k] = _mm512_load_ps(ss);
            }
        }
        for (int k = 0; k < SPAN; k++) {
            const __m512 d = _mm512_add_ps(_mm512_div_ps(S[k], vbc2s), veps);
            P[k] = _mm512_add_ps(P[k], _mm512_div_ps(_mm512_mul_ps(vneg, M[k]), d));
        }
        for (int k = 0; k < SPAN; k++) _mm512_storeu_ps(p + i + 16 * k, P[k]);
        for (int k = 0; k < SPAN; k++) _mm512_storeu_ps(m + i + 16 * k, M[k]);
        for (int k = 0; k < SPAN; k++) _mm512_storeu_ps(v + i + 16 * k, V[k]);
    }
    return i;
}
#define ZDSL_BODY adam_fused16_body
#else
#define ZDSL_BODY adam_fused8_body
#endif

/* The whole step in one pass, 8 floats at a time, with MKL's sqrt computed inline
   (mkl_ex_sqrt8). Same operations in the same order as the tiled loops below; a group
   of 8 with a special sqrt input goes through MKL itself. Returns the elements done
   (a multiple of 8); the caller finishes the tail with the tiled code. */
static inline __attribute__((always_inline)) int64_t adam_fused8_body(
    float *restrict p, const float *restrict g, float *restrict m, float *restrict v, int64_t n,
    float decay, float wd, float w, float b2, float omb2, float bc2s, float eps, float neg_step,
    vsqrt_fn vsqrt, int64_t vmode, const int decays, const int l2, const int big_w,
    const int fma_cmul, const int fma_alpha)
{
    const __m256 vdec = _mm256_set1_ps(decay), vwd = _mm256_set1_ps(wd), vw = _mm256_set1_ps(w);
    const __m256 vwm1 = _mm256_set1_ps(w - 1.0f), vb2 = _mm256_set1_ps(b2), vomb2 = _mm256_set1_ps(omb2);
    const __m256 vbc2s = _mm256_set1_ps(bc2s), veps = _mm256_set1_ps(eps), vneg = _mm256_set1_ps(neg_step);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        if ((i & 15) == 0) {  /* a line per array every 16 floats, 512 B ahead: measured +60% at 64M */
            __builtin_prefetch(p + i + PREFETCH_AHEAD, 1);
            __builtin_prefetch(g + i + PREFETCH_AHEAD, 0);
            __builtin_prefetch(m + i + PREFETCH_AHEAD, 1);
            __builtin_prefetch(v + i + PREFETCH_AHEAD, 1);
        }
        __m256 P = _mm256_loadu_ps(p + i), G = _mm256_loadu_ps(g + i);
        __m256 M = _mm256_loadu_ps(m + i), V = _mm256_loadu_ps(v + i);
        if (decays) P = _mm256_mul_ps(P, vdec);
        if (l2) G = fma_alpha ? _mm256_fmadd_ps(vwd, P, G) : _mm256_add_ps(G, _mm256_mul_ps(vwd, P));
        const __m256 diff = _mm256_sub_ps(G, M);
        M = big_w ? _mm256_fmadd_ps(vwm1, diff, G) : _mm256_fmadd_ps(vw, diff, M);
        const __m256 vb = _mm256_mul_ps(V, vb2), og = _mm256_mul_ps(vomb2, G);
        V = fma_cmul ? _mm256_fmadd_ps(og, G, vb) : _mm256_add_ps(vb, _mm256_mul_ps(og, G));
        int needs_mkl;
        __m256 S = mkl_ex_sqrt_ps(V, &needs_mkl);
        if (__builtin_expect(needs_mkl, 0)) {
            float vs[8] __attribute__((aligned(32))), ss[8] __attribute__((aligned(32)));
            _mm256_store_ps(vs, V);
            vsqrt(8, vs, ss, vmode);
            S = _mm256_load_ps(ss);
        }
        const __m256 d = _mm256_add_ps(_mm256_div_ps(S, vbc2s), veps);
        P = _mm256_add_ps(P, _mm256_div_ps(_mm256_mul_ps(vneg, M), d));
        _mm256_storeu_ps(p + i, P);
        _mm256_storeu_ps(m + i, M);
        _mm256_storeu_ps(v + i, V);
    }
    return i;
}

/* The whole step in one pass, 16 floats at a time (AVX-512; the rsqrt estimate stays
   the 8-wide instruction MKL's kernel uses) or 8 (AVX2), with MKL's sqrt computed inline.
   Same operations in the same order as the tiled loops below; a group with a special
   sqrt input goes through MKL itself. One copy of the loop per combination of settings,
   so the loop has no branches. Returns the elements done (a multiple of the width);
   the caller finishes the tail with the tiled code. */
static int64_t adam_fused8(float *restrict p, const float *restrict g, float *restrict m,
                           float *restrict v, int64_t n, float decay, float wd, float w, float b2,
                           float omb2, float bc2s, float eps, float neg_step, int flags,
                           vsqrt_fn vsqrt, int64_t vmode)
{
    const int adam_w = flags & 1, big_w = !!(flags & 2), fma_cmul = !!(flags & 4), fma_alpha = !!(flags & 8);
    const int decays = adam_w && wd != 0.0f, l2 = !adam_w && wd != 0.0f;
#define ZDSL_CASE(D, L, B, C, A)                                                                 \
    case (D) | (L) << 1 | (B) << 2 | (C) << 3 | (A) << 4:                                         \
        return ZDSL_BODY(p, g, m, v, n, decay, wd, w, b2, omb2, bc2s, eps, neg_step,              \
                                vsqrt, vmode, D, L, B, C, A);
#define ZDSL_CASES_A(D, L, B, C) ZDSL_CASE(D, L, B, C, 0) ZDSL_CASE(D, L, B, C, 1)
#define ZDSL_CASES_C(D, L, B) ZDSL_CASES_A(D, L, B, 0) ZDSL_CASES_A(D, L, B, 1)
#define ZDSL_CASES_B(D, L) ZDSL_CASES_C(D, L, 0) ZDSL_CASES_C(D, L, 1)
    switch (decays | l2 << 1 | big_w << 2 | fma_cmul << 3 | fma_alpha << 4) {
        ZDSL_CASES_B(0, 0) ZDSL_CASES_B(1, 0) ZDSL_CASES_B(0, 1)
    }
    return 0;
#undef ZDSL_CASE
#undef ZDSL_CASES_A
#undef ZDSL_CASES_C
#undef ZDSL_CASES_B
}
#endif

/* One AdamW/Adam step over [0, n): ATen's float roundings, one pass per tile.
   flags: 1 = decoupled weight decay (AdamW), 2 = lerp weight >= 0.5,
          4 = addcmul contracted into fma, 8 = add(alpha) as fma,
          16 = sqrt by the inline replica of MKL's kernel (vsqrt for tiles it cannot do),
          32 = with 16: the single-pass AVX2 loop (adam_fused8) for all but the tail. */
void zdsl_adam(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
               int64_t n, float decay, float wd, float w, float b2, float omb2, float bc2s,
               float eps, float neg_step, int flags, vsqrt_fn vsqrt, int64_t vmode)
{
    float s[TILE] __attribute__((aligned(64)));
    float gw[TILE] __attribute__((aligned(64)));
    const int adam_w = flags & 1, big_w = flags & 2, fma_cmul = flags & 4, fma_alpha = flags & 8;
#if defined(__AVX2__) && defined(__FMA__)
    if (flags & 32) {  /* one pass, 8 at a time; the tail below */
        const int64_t done = adam_fused8(p, g, m, v, n, decay, wd, w, b2, omb2, bc2s, eps, neg_step,
                                         flags, vsqrt, vmode);
        p += done; g += done; m += done; v += done; n -= done;
    }
#endif
    const float wm1 = w - 1.0f;
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        const int k = (int)(n - t0 < TILE ? n - t0 : TILE);
        float *restrict P = p + t0;
        const float *restrict G = g + t0;
        float *restrict M = m + t0;
        float *restrict V = v + t0;
        const float *restrict GR = G;
        if (adam_w) {
            if (wd != 0.0f)
                for (int i = 0; i < k; i++) P[i] = P[i] * decay;
        } else if (wd != 0.0f) {
            if (fma_alpha) for (int i = 0; i < k; i++) gw[i] = fmaf(wd, P[i], G[i]);
            else           for (int i = 0; i < k; i++) gw[i] = G[i] + wd * P[i];
            GR = gw;
        }
        if (big_w) for (int i = 0; i < k; i++) M[i] = fmaf(wm1, GR[i] - M[i], GR[i]);
        else       for (int i = 0; i < k; i++) M[i] = fmaf(w, GR[i] - M[i], M[i]);
        if (fma_cmul) for (int i = 0; i < k; i++) V[i] = fmaf(omb2 * GR[i], GR[i], V[i] * b2);
        else          for (int i = 0; i < k; i++) V[i] = V[i] * b2 + (omb2 * GR[i]) * GR[i];
        if (flags & 16) {  /* MKL's bits computed inline; MKL itself for tiles with special values */
            if (zdsl_mkl_ex_sqrt(k, V, s)) vsqrt(k, V, s, vmode);
        } else if (vsqrt) vsqrt(k, V, s, vmode);
        else for (int i = 0; i < k; i++) s[i] = sqrtf(V[i]);
        for (int i = 0; i < k; i++) {
            const float d = s[i] / bc2s + eps;
            P[i] = P[i] + (neg_step * M[i]) / d;
        }
    }
}

/* 1 when built with OpenMP: zdsl_adam_mt then runs its ranges on an OpenMP team. */
int zdsl_has_openmp(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* zdsl_adam over [0, n) on `threads` threads, one contiguous range of whole 128-float
   rounds each. OpenMP's team (torch's own libgomp, already loaded) keeps its threads
   spinning briefly between steps, so a step costs no thread wake-up; a Python thread
   pool paid ~0.1 ms of hand-off per step, a third of a 1M-parameter step. */
void zdsl_adam_mt(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                  int64_t n, float decay, float wd, float w, float b2, float omb2, float bc2s,
                  float eps, float neg_step, int flags, vsqrt_fn vsqrt, int64_t vmode, int threads)
{
    const int64_t per = ((n + threads - 1) / threads + 127) / 128 * 128;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (threads > 1)
#endif
    for (int t = 0; t < threads; t++) {
        const int64_t a = (int64_t)t * per, b = a + per < n ? a + per : n;
        if (a < b)
            zdsl_adam(p + a, g + a, m + a, v + a, b - a, decay, wd, w, b2, omb2, bc2s, eps, neg_step,
                      flags, vsqrt, vmode);
    }
}
