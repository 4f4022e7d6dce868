/* float32 fast paths of the MinMaxUInt8 / MinMaxUInt4 CPU kernels (_minmax.pyx).
 *
 * Cython turns a branch-free ``v if v < a else a`` into an if/else over temporaries, which
 * GCC leaves scalar; these loops are written with SSE2 intrinsics (part of every x86-64
 * CPU, so no -march flag is needed) and fall back to plain C elsewhere.  Every operation is
 * the float32 operation of the scalar kernels, in the same order, so the bytes are the same:
 * minps/maxps return their second operand when the first is not smaller/larger, exactly the
 * ``v if v < a else a`` of the scalar code; non-finite input is detected separately.
 */
#ifndef BAGUA_MINMAX_SIMD_H
#define BAGUA_MINMAX_SIMD_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2)
#include <emmintrin.h>
#define BAGUA_SSE2 1
#else
#define BAGUA_SSE2 0
#endif

/* Min and max of p[0:m] (m >= 1), -0 written as +0; returns 0, or 1 (outputs untouched)
 * when some element is NaN or infinite: then ``v * 0`` is NaN for that element. */
static int bagua_minmax_f32(const float *p, ptrdiff_t m, float *mn_out, float *mx_out)
{
    ptrdiff_t i = 0;
    float mn = p[0], mx = p[0], z = 0.0f, v;
#if BAGUA_SSE2
    if (m >= 16) {
        __m128 a0 = _mm_set1_ps(p[0]), a1 = a0, a2 = a0, a3 = a0;
        __m128 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        __m128 z0 = _mm_setzero_ps(), z1 = z0, z2 = z0, z3 = z0;
        const __m128 zero = _mm_setzero_ps();
        for (; i + 16 <= m; i += 16) {
            __m128 v0 = _mm_loadu_ps(p + i), v1 = _mm_loadu_ps(p + i + 4);
            __m128 v2 = _mm_loadu_ps(p + i + 8), v3 = _mm_loadu_ps(p + i + 12);
            a0 = _mm_min_ps(v0, a0); a1 = _mm_min_ps(v1, a1);
            a2 = _mm_min_ps(v2, a2); a3 = _mm_min_ps(v3, a3);
            b0 = _mm_max_ps(v0, b0); b1 = _mm_max_ps(v1, b1);
            b2 = _mm_max_ps(v2, b2); b3 = _mm_max_ps(v3, b3);
            z0 = _mm_add_ps(z0, _mm_mul_ps(v0, zero)); z1 = _mm_add_ps(z1, _mm_mul_ps(v1, zero));
            z2 = _mm_add_ps(z2, _mm_mul_ps(v2, zero)); z3 = _mm_add_ps(z3, _mm_mul_ps(v3, zero));
        }
        a0 = _mm_min_ps(_mm_min_ps(a0, a1), _mm_min_ps(a2, a3));
        b0 = _mm_max_ps(_mm_max_ps(b0, b1), _mm_max_ps(b2, b3));
        z0 = _mm_add_ps(_mm_add_ps(z0, z1), _mm_add_ps(z2, z3));
        float la[4], lb[4], lz[4];
        _mm_storeu_ps(la, a0); _mm_storeu_ps(lb, b0); _mm_storeu_ps(lz, z0);
        mn = la[0]; mx = lb[0]; z = lz[0];
        for (int k = 1; k < 4; k++) {
            mn = la[k] < mn ? la[k] : mn;
            mx = lb[k] > mx ? lb[k] : mx;
            z = z + lz[k];
        }
    }
#endif
    for (; i < m; i++) {
        v = p[i];
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
        z = z + v * 0.0f;
    }
    if (z != z)
        return 1;
    *mn_out = mn + 0.0f;   /* -0 becomes +0 */
    *mx_out = mx + 0.0f;
    return 0;
}

/* 4-bit codes of p[0:m] (m even) into out[0:m/2] when |lower|, |upper| <= 2**22: per element
 * clamp(v * scale) to [lower, upper], round half to even by adding and subtracting
 * 1.5 * 2**23, subtract lower; element 2k in the low nibble of out[k], 2k + 1 in the high. */
static void bagua_codes4_f32(const float *p, ptrdiff_t m, float scale, float lower,
                             float upper, uint8_t *out)
{
    ptrdiff_t i = 0;
#if BAGUA_SSE2
    const __m128 s = _mm_set1_ps(scale), lo = _mm_set1_ps(lower), up = _mm_set1_ps(upper);
    /* v + 1.5 * 2**23 is an integer in [2**23, 2**24), where floats are the integers with
     * consecutive bit patterns: the code rint(v) - lower is the difference of the bit
     * patterns of v + 1.5 * 2**23 and lower + 1.5 * 2**23 (both exact), with no conversion. */
    const __m128 magic = _mm_set1_ps(12582912.0f);
    const __m128i base = _mm_castps_si128(_mm_set1_ps(12582912.0f + lower));
    const __m128i low_byte = _mm_set1_epi16(0x00ff);
    for (; i + 32 <= m; i += 32) {
        __m128i w[8];
        for (int j = 0; j < 8; j++) {
            __m128 x = _mm_mul_ps(_mm_loadu_ps(p + i + 4 * j), s);
            x = _mm_add_ps(_mm_max_ps(_mm_min_ps(x, up), lo), magic);
            w[j] = _mm_sub_epi32(_mm_castps_si128(x), base);
        }
        /* codes 0..15 as bytes q[0..31]; as 16-bit lanes q[2k] | q[2k+1] << 8 */
        __m128i q0 = _mm_packus_epi16(_mm_packs_epi32(w[0], w[1]), _mm_packs_epi32(w[2], w[3]));
        __m128i q1 = _mm_packus_epi16(_mm_packs_epi32(w[4], w[5]), _mm_packs_epi32(w[6], w[7]));
        q0 = _mm_and_si128(_mm_or_si128(q0, _mm_srli_epi16(q0, 4)), low_byte);
        q1 = _mm_and_si128(_mm_or_si128(q1, _mm_srli_epi16(q1, 4)), low_byte);
        _mm_storeu_si128((__m128i *)(out + i / 2), _mm_packus_epi16(q0, q1));
    }
#endif
    for (; i < m; i += 2) {
        float c[2];
        for (int j = 0; j < 2; j++) {
            float v = p[i + j] * scale;
            v = v < upper ? v : upper;
            v = v > lower ? v : lower;
            v = (v + 12582912.0f) - 12582912.0f;
            c[j] = v - lower;
        }
        out[i / 2] = (uint8_t)((int)c[0] | ((int)c[1] << 4));
    }
}

/* out[2k], out[2k + 1] = pairs[2 codes[k]], pairs[2 codes[k] + 1] for k < n (the decoded
 * values of each byte, computed once per chunk).  ``stream``: non-temporal stores (large
 * outputs that would only evict the cache, as memcpy does for large copies). */
static void bagua_decode4_f32(const uint8_t *codes, ptrdiff_t n, const float *pairs,
                              float *out, int stream)
{
    ptrdiff_t k = 0;
#if BAGUA_SSE2
    /* align the destination to 16 bytes for the streaming stores (out is 8-byte aligned) */
    if (stream && ((uintptr_t)out & 15) == 8 && n > 0) {
        memcpy(out, pairs + 2 * codes[0], 8);
        k = 1;
    }
    if (stream && ((uintptr_t)(out + 2 * k) & 15) == 0) {
        for (; k + 2 <= n; k += 2) {
            __m128 v = _mm_loadl_pi(_mm_setzero_ps(), (const __m64 *)(pairs + 2 * codes[k]));
            v = _mm_loadh_pi(v, (const __m64 *)(pairs + 2 * codes[k + 1]));
            _mm_stream_ps(out + 2 * k, v);
        }
        _mm_sfence();
    }
#endif
    for (; k < n; k++)
        memcpy(out + 2 * k, pairs + 2 * codes[k], 8);
}

#endif
