"""AdamW / Adam step on the host over flat fp32 shards (ZeRO-Offload's CPU step).

The contract is *bitwise* equality with ``torch.optim.AdamW(foreach=False)``
(equivalently ``torch.optim.Adam(foreach=False)`` with ``adam_w=False``),
which is torch's default on CPU and what plain data-parallel training uses,
so offloading the step never changes a single bit of training. ``foreach``
gives the same bits; ``fused=True`` does not (it computes the first moment
as ``m*b1 + g*(1-b1)`` instead of a ``lerp`` and takes ``sqrt`` in double),
so it is a separate, explicit choice here (``fused=True`` below), bitwise
equal to ``torch.optim.AdamW(fused=True)``.

How the exact step is made fast. The reference is seven separate ATen
kernels per tensor (mul, lerp, mul, addcmul, sqrt, div+add, addcdiv), each
streaming the whole shard through memory: ~20 passes over 4-byte arrays.
Here one C kernel does the same arithmetic, operation for operation, in one
pass (16 floats at a time with AVX-512, else 8 with AVX2), on
``torch.get_num_threads()`` threads:

- the same float32 roundings in the same order, with the fused
  multiply-adds exactly where ATen's compiled kernels have them (``lerp``
  is an ``fma``; ATen's ``addcmul`` is compiled with contraction into an
  ``fma``; ``add(alpha=)`` is an ``fma``);
- ``sqrt`` with the bits of the very function ATen calls for float
  ``sqrt``: MKL's ``vmsSqrt`` in high-accuracy mode (not correctly rounded:
  up to 0.75 ulp, so ``sqrtf`` differs). Calling it per tile halves the
  kernel's speed, so the kernel computes the sequence of MKL's SSE2 kernel
  inline (``mkl_ex_sqrt_ps``: rsqrt estimate, two Newton steps, no fma),
  and calls MKL only for special inputs (subnormal, inf, NaN). Where MKL
  runs another kernel (it picks one per CPU), the copy does not match and
  MKL is called for every tile; torch builds without MKL use ``sqrtf``.

Because "the same roundings as this torch build on this CPU" is an
empirical fact about binaries, the kernel is compiled on first use
(runtime/io/native.py: ``cc -O3 -march=native -ffp-contract=off``, cached under
``~/.cache/zdsl``) and then *checked*: the sqrt copy against MKL on a
million random floats, and the whole step against torch's single-tensor
Adam on awkward values (zeros, subnormals, magnitudes over 1e±10) for every
combination of its settings; the fastest variant that matches bit for bit
is used. If no compiler works or nothing matches, the step falls back to
the same ATen ops run tile by tile (exact by construction, about twice as
fast as the reference, far slower than the kernel) and says so in the log.
``exact_backend()`` tells which one runs.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from zdsl.runtime.io import native

log = structlog.get_logger("zdsl.runtime.offload.host_adam")

# MKL vector-math mode used by ATen for float sqrt: VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE
_VML_MODE = 0x00000002 | 0x00140000 | 0x00000100
_TILE_ELEMS = 1 << 18  # ATen fallback: elements per tile (1 MiB per fp32 array)
_MIN_PER_THREAD = 1 << 16  # below this, one thread: thread hand-off would cost more than it saves

_KERNEL_SOURCE = r"""
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
#ifndef ZDSL_PF
#define ZDSL_PF 128
#endif
#ifndef ZDSL_SPAN
#define ZDSL_SPAN 2
#endif

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

/* 16 floats a vector, ZDSL_SPAN vectors of each array a round: all loads of a round
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
    for (; i + 16 * ZDSL_SPAN <= n; i += 16 * ZDSL_SPAN) {
        __m512 P[ZDSL_SPAN], G[ZDSL_SPAN], M[ZDSL_SPAN], V[ZDSL_SPAN], S[ZDSL_SPAN];
        for (int k = 0; k < ZDSL_SPAN; k++) G[k] = _mm512_loadu_ps(g + i + 16 * k);
        for (int k = 0; k < ZDSL_SPAN; k++) M[k] = _mm512_loadu_ps(m + i + 16 * k);
        for (int k = 0; k < ZDSL_SPAN; k++) V[k] = _mm512_loadu_ps(v + i + 16 * k);
        for (int k = 0; k < ZDSL_SPAN; k++) P[k] = _mm512_loadu_ps(p + i + 16 * k);
        int needs_mkl = 0;
        for (int k = 0; k < ZDSL_SPAN; k++) {
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
            for (int k = 0; k < ZDSL_SPAN; k++) {
                _mm512_store_ps(vs, V[k]);
                vsqrt(16, vs, ss, vmode);
                S[k] = _mm512_load_ps(ss);
            }
        }
        for (int k = 0; k < ZDSL_SPAN; k++) {
            const __m512 d = _mm512_add_ps(_mm512_div_ps(S[k], vbc2s), veps);
            P[k] = _mm512_add_ps(P[k], _mm512_div_ps(_mm512_mul_ps(vneg, M[k]), d));
        }
        for (int k = 0; k < ZDSL_SPAN; k++) _mm512_storeu_ps(p + i + 16 * k, P[k]);
        for (int k = 0; k < ZDSL_SPAN; k++) _mm512_storeu_ps(m + i + 16 * k, M[k]);
        for (int k = 0; k < ZDSL_SPAN; k++) _mm512_storeu_ps(v + i + 16 * k, V[k]);
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
            __builtin_prefetch(p + i + ZDSL_PF, 1);
            __builtin_prefetch(g + i + ZDSL_PF, 0);
            __builtin_prefetch(m + i + ZDSL_PF, 1);
            __builtin_prefetch(v + i + ZDSL_PF, 1);
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
"""


class HostAdamError(ValueError):
    """Bad arguments to the host step (wrong dtype, device, sizes or layout)."""


# ----------------------------------------------------------------------------
# the reference, tile by tile (exact by construction; the fallback)
# ----------------------------------------------------------------------------


def _scalars(step: int, lr: float, beta1: float, beta2: float) -> tuple[float, float]:
    """Step size and sqrt of the second bias correction, computed exactly as torch does."""
    step_f = float(step)  # torch keeps the step in a float32 tensor and reads it back with .item()
    bias_correction1 = 1 - beta1**step_f
    bias_correction2 = 1 - beta2**step_f
    return lr / bias_correction1, bias_correction2**0.5


def _aten_tiled(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, adam_w) -> None:
    step_size, bc2_sqrt = _scalars(step, lr, beta1, beta2)
    n = param.numel()
    tile = min(n, _TILE_ELEMS)
    denom_buf = torch.empty(tile, dtype=torch.float32)
    grad_buf = torch.empty(tile, dtype=torch.float32) if (weight_decay != 0 and not adam_w) else None
    for a in range(0, n, tile):
        b = min(n, a + tile)
        p, g, m, v, d = param[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b], denom_buf[: b - a]
        if weight_decay != 0:
            if adam_w:
                p.mul_(1 - lr * weight_decay)
            else:
                g = torch.add(g, p, alpha=weight_decay, out=grad_buf[: b - a])
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        torch.sqrt(v, out=d)
        d.div_(bc2_sqrt).add_(eps)
        p.addcdiv_(m, d, value=-step_size)


# ----------------------------------------------------------------------------
# the compiled kernel
# ----------------------------------------------------------------------------


@dataclass
class _Kernel:
    fn: ctypes._CFuncPtr
    sqrt_ptr: int | None  # MKL vmsSqrt, or None for IEEE sqrtf
    flags: int  # kernel flags that matched ATen: 4/8 (fma placement), 16/32 (inline sqrt, one pass)
    path: Path
    mt: ctypes._CFuncPtr | None = None  # zdsl_adam_mt when built with OpenMP: threads in C


def _mkl_sqrt() -> int | None:
    """Address of MKL's vmsSqrt inside libtorch_cpu, which ATen uses for float sqrt."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        path = lib_dir / name
        if path.exists():
            try:
                return ctypes.cast(ctypes.CDLL(str(path)).vmsSqrt, ctypes.c_void_p).value
            except (OSError, AttributeError):
                return None
    return None


def _sample(n: int, seed: int) -> list[torch.Tensor]:
    """Parameters, gradients and moments spanning many magnitudes, zeros and signs."""
    gen = torch.Generator().manual_seed(seed)
    scale = lambda: torch.exp(torch.randn(n, generator=gen) * 4)  # noqa: E731
    p = torch.randn(n, generator=gen) * scale()
    g = torch.randn(n, generator=gen) * scale()
    m = torch.randn(n, generator=gen) * scale() * 1e-2
    v = torch.rand(n, generator=gen) * scale() * 1e-3
    g[:64] = 0.0
    v[64:128] = 0.0
    p[128:192] = 0.0
    if n > 5010:  # subnormal second moments in the second tile: the sqrt's special-value path
        g[5000:5010] = 0.0
        v[5000:5010] = 1e-41
    return [p, g, m, v]


_CHECK_CASES = [  # (lr, beta1, beta2, eps, weight_decay, adam_w): every branch of the kernel
    (1e-3, 0.9, 0.999, 1e-8, 0.01, True),
    (3e-4, 0.9, 0.95, 1e-6, 0.1, False),
    (1e-2, 0.3, 0.99, 1e-8, 0.0, True),
    (5e-3, 0.8, 0.9, 1e-5, 0.0, False),
]


def _matches(kernel: _Kernel) -> bool:
    n = 3 * 4096 + 77  # several tiles and a ragged tail
    for case_index, (lr, b1, b2, eps, wd, adam_w) in enumerate(_CHECK_CASES):
        ref = _sample(n, case_index)
        ours = [t.clone() for t in ref]
        for step in (1, 2, 7):
            _reference_step(*ref, step, lr, b1, b2, eps, wd, adam_w)
            _kernel_step(kernel, *ours, step, lr, b1, b2, eps, wd, adam_w, threads=1)
        if not all(torch.equal(a, b) for a, b in zip(ref, ours)):
            return False
    return True


def _reference_step(p, g, m, v, step, lr, b1, b2, eps, wd, adam_w) -> None:
    """torch.optim's single-tensor Adam/AdamW, called as torch.optim calls it; where this
    torch's private function has another signature, the same ATen ops run by
    ``_aten_tiled`` (tested against torch.optim in tests/runtime/test_host_adam.py)."""
    try:
        from torch.optim.adam import _single_tensor_adam

        kwargs = dict(amsgrad=False, has_complex=False, beta1=b1, beta2=b2, lr=lr, weight_decay=wd, eps=eps,
                      maximize=False, capturable=False, differentiable=False, decoupled_weight_decay=adam_w)
        _single_tensor_adam([p], [g], [m], [v], [], [torch.tensor(float(step - 1))], None, None, **kwargs)
    except (ImportError, TypeError):
        _aten_tiled(p, g, m, v, step, lr, b1, b2, eps, wd, adam_w)


def _replica_matches_mkl(lib: ctypes.CDLL, mkl: int) -> bool:
    """Whether the inline copy of MKL's sqrt gives MKL's bits on this CPU (MKL picks its
    code path by CPU, so the copy is right only where MKL runs the kernel it copies)."""
    replica = lib.zdsl_mkl_ex_sqrt
    replica.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    replica.restype = ctypes.c_int
    vsqrt = ctypes.cast(mkl, ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64))
    gen = torch.Generator().manual_seed(1234)
    # every exponent and mantissa pattern of the positive normal floats, at random, plus a ragged tail
    bits = torch.randint(0x00800000, 0x7F7FF000, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)[: (1 << 20) - 3]
    ours, theirs = torch.empty_like(x), torch.empty_like(x)
    if replica(x.numel(), x.data_ptr(), ours.data_ptr()) != 0:
        return False
    vsqrt(x.numel(), x.data_ptr(), theirs.data_ptr(), _VML_MODE)
    return torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


def _load_kernel() -> _Kernel | None:
    if os.environ.get("ZDSL_HOST_ADAM", "") == "aten":
        return None
    # With OpenMP where the compiler has it (threads in C, no Python hand-off), else without.
    lib = native.build("host_adam_omp", _KERNEL_SOURCE, ("-fopenmp",)) or native.build("host_adam", _KERNEL_SOURCE)
    if lib is None:
        log.warning("host_adam.no_kernel", fallback="aten_tiled")
        return None
    fn = lib.zdsl_adam
    path = Path(lib._name)
    F = ctypes.c_float
    args = [ctypes.c_void_p] * 4 + [ctypes.c_int64] + [F] * 8 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
    fn.argtypes = args
    fn.restype = None
    mt = None
    if lib.zdsl_has_openmp():
        mt = lib.zdsl_adam_mt
        mt.argtypes = [*args, ctypes.c_int]
        mt.restype = None
    mkl = _mkl_sqrt()
    sqrt_modes = []  # (name, vsqrt pointer, extra flags), fastest first
    if mkl and _replica_matches_mkl(lib, mkl):
        sqrt_modes.append(("mkl-replica-1pass", mkl, 16 | 32))
        sqrt_modes.append(("mkl-replica", mkl, 16))
    if mkl:
        sqrt_modes.append(("mkl", mkl, 0))
    sqrt_modes.append(("ieee", None, 0))
    for sqrt_name, sqrt_ptr, sqrt_flag in sqrt_modes:
        for flags in (4 | 8, 8, 4, 0):
            kernel = _Kernel(fn, sqrt_ptr, flags | sqrt_flag, path, mt)
            if _matches(kernel):
                log.debug("host_adam.kernel", path=str(path), sqrt=sqrt_name, flags=kernel.flags)
                return kernel
    log.warning("host_adam.kernel_mismatch", path=str(path), fallback="aten_tiled",
                reason="no rounding variant of the kernel is bitwise equal to this torch build's AdamW")
    return None


_kernel_lock = threading.Lock()
_kernel_state: dict[str, object] = {}


def _kernel() -> _Kernel | None:
    with _kernel_lock:
        if "kernel" not in _kernel_state:
            try:
                _kernel_state["kernel"] = _load_kernel()
            except Exception as e:  # noqa: BLE001 - the fallback is exact; a broken kernel must not stop training
                log.warning("host_adam.kernel_failed", error=f"{type(e).__name__}: {e}", fallback="aten_tiled")
                _kernel_state["kernel"] = None
        return _kernel_state["kernel"]  # type: ignore[return-value]


_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    with _pool_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="zdsl-host-adam")
        return _pools[threads]


def _kernel_step(kernel: _Kernel, p, g, m, v, step, lr, b1, b2, eps, wd, adam_w, *, threads: int) -> None:
    step_size, bc2_sqrt = _scalars(step, lr, b1, b2)
    flags = kernel.flags | (1 if adam_w else 0) | (2 if abs(1 - b1) >= 0.5 else 0)
    # Scalars as ATen sees them: Python doubles rounded once to float32.
    scalars = (1 - lr * wd, wd, 1 - b1, b2, 1 - b2, bc2_sqrt, eps, -step_size)
    n = p.numel()
    ptrs = [t.data_ptr() for t in (p, g, m, v)]

    def run(a: int, b: int) -> None:
        kernel.fn(*(x + 4 * a for x in ptrs), b - a, *scalars, flags, kernel.sqrt_ptr, _VML_MODE)

    threads = max(1, min(threads, n // _MIN_PER_THREAD))
    if threads == 1:
        run(0, n)
        return
    if kernel.mt is not None:
        kernel.mt(*ptrs, n, *scalars, flags, kernel.sqrt_ptr, _VML_MODE, threads)
        return
    per = ((n + threads - 1) // threads + 127) // 128 * 128  # whole rounds of the kernel's loop per thread
    # The calling thread takes the first range itself: one fewer thread wake-up per step.
    futures = [_pool(threads - 1).submit(run, a, min(n, a + per)) for a in range(per, n, per)]
    try:
        run(0, min(n, per))
    finally:
        for f in futures:
            f.result()


# ----------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------


def exact_backend() -> str:
    """Which exact implementation runs here: ``"kernel"`` or ``"aten_tiled"``."""
    return "kernel" if _kernel() is not None else "aten_tiled"


def _check(param, grad, exp_avg, exp_avg_sq) -> None:
    n = param.numel()
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise HostAdamError(f"host_adamw_: {name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
        if not t.is_contiguous():
            raise HostAdamError(f"host_adamw_: {name} must be contiguous")
        if t.numel() != n:
            raise HostAdamError(f"host_adamw_: {name} has {t.numel()} elements, param has {n}")


@torch.no_grad()
def host_adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w: bool = True,
    *,
    fused: bool = False,
    threads: int | None = None,
) -> None:
    """One Adam step, in place on ``param``, ``exp_avg`` and ``exp_avg_sq``.

    ``step`` is the 1-based number of this step (torch's ``state["step"]``
    after its increment). ``adam_w=True``: decoupled weight decay (AdamW);
    False: L2 penalty added to the gradient (Adam). ``grad`` is not changed.

    ``fused=False`` (default): bitwise equal to ``torch.optim.AdamW`` /
    ``Adam`` with ``foreach=False`` (and ``foreach=True``).
    ``fused=True``: ``torch._fused_adamw_`` / ``_fused_adam_``, bitwise equal
    to ``torch.optim.AdamW(fused=True)``, *not* to the above (a few ulps apart).
    ``threads``: worker threads for the exact kernel (default
    ``torch.get_num_threads()``).
    """
    _check(param, grad, exp_avg, exp_avg_sq)
    if param.numel() == 0:
        return
    if fused:
        fused_op = torch._fused_adamw_ if adam_w else torch._fused_adam_
        step_t = torch.tensor(float(step - 1))
        step_t += 1  # torch.optim increments the float32 step tensor before the fused call
        fused_op([param], [grad], [exp_avg], [exp_avg_sq], [], [step_t], lr=lr, beta1=beta1, beta2=beta2,
                 weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        return
    kernel = _kernel()
    if kernel is None:
        _aten_tiled(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, adam_w)
    else:
        _kernel_step(kernel, param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, adam_w,
                     threads=threads or torch.get_num_threads())
