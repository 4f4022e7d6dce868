# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""CPU kernels of the MinMaxUInt8 format (DESIGN.md section 4), without the GIL.

Inputs are float32 (``float``) or 16-bit floats passed as their raw bits (``uint16_t``:
float16 through a lookup table, bfloat16 by a shift); every value is widened to float32
exactly and all arithmetic is float32.  Rounding is round-half-to-even (``rint``), written
with the 2**23 trick so that it is exact without SSE4.1 and identical to CUDA's ``rintf``.
Headers (the ``[min, max]`` pair in the tensor's own type) are written by the caller.
"""

from libc.stdint cimport uint8_t, uint16_t, uint32_t
from libc.math cimport copysignf, fabsf
from libc.string cimport memcpy

ctypedef fused src_t:
    float
    uint16_t

cdef enum:
    KIND_F32 = 0
    KIND_F16 = 1
    KIND_BF16 = 2


cdef inline float _bits_to_f32(uint32_t bits) noexcept nogil:
    cdef float f
    memcpy(&f, &bits, 4)
    return f


cdef inline float _load(const src_t* p, Py_ssize_t i, int kind,
                        const float* lut) noexcept nogil:
    if src_t is float:
        return p[i]
    else:
        if kind == KIND_BF16:
            return _bits_to_f32((<uint32_t>p[i]) << 16)
        return lut[p[i]]


cdef inline float _rint(float v) noexcept nogil:
    """Round half to even in float32, branch-free so that loops vectorise.

    For |v| < 2**23, adding and subtracting 2**23 rounds to an integer in the current
    (nearest-even) mode; larger magnitudes are integers already.
    """
    cdef float a = fabsf(v)
    cdef float r = copysignf((a + <float>8388608.0) - <float>8388608.0, v)
    return r if a < <float>8388608.0 else v


cdef inline float _scale(float mn, float mx) noexcept nogil:
    return <float>255.0 / ((mx - mn) + <float>1e-7)


def minmax(const src_t[::1] src, int kind, const float[::1] lut, Py_ssize_t chunks,
           float[::1] mins, float[::1] maxs):
    """One pass per chunk: its min and max in float32 (``-0`` canonicalised to ``+0``)."""
    cdef Py_ssize_t n = src.shape[0]
    cdef Py_ssize_t m = n // chunks
    cdef Py_ssize_t c, i, j, base
    cdef float v, mn, mx
    cdef float a0, a1, a2, a3, b0, b1, b2, b3
    cdef const float* tab = &lut[0] if lut.shape[0] else NULL
    cdef const src_t* p = &src[0]
    with nogil:
        for c in range(chunks):
            base = c * m
            v = _load(p, base, kind, tab)
            a0 = a1 = a2 = a3 = v
            b0 = b1 = b2 = b3 = v
            i = 0
            # Four independent min and max chains keep the pipeline full.
            while i + 4 <= m:
                j = base + i
                v = _load(p, j, kind, tab)
                a0 = v if v < a0 else a0
                b0 = v if v > b0 else b0
                v = _load(p, j + 1, kind, tab)
                a1 = v if v < a1 else a1
                b1 = v if v > b1 else b1
                v = _load(p, j + 2, kind, tab)
                a2 = v if v < a2 else a2
                b2 = v if v > b2 else b2
                v = _load(p, j + 3, kind, tab)
                a3 = v if v < a3 else a3
                b3 = v if v > b3 else b3
                i += 4
            while i < m:
                v = _load(p, base + i, kind, tab)
                a0 = v if v < a0 else a0
                b0 = v if v > b0 else b0
                i += 1
            a0 = a1 if a1 < a0 else a0
            a2 = a3 if a3 < a2 else a2
            mn = a2 if a2 < a0 else a0
            b0 = b1 if b1 > b0 else b0
            b2 = b3 if b3 > b2 else b2
            mx = b2 if b2 > b0 else b0
            mins[c] = mn + <float>0.0
            maxs[c] = mx + <float>0.0


def encode(const src_t[::1] src, int kind, const float[::1] lut, Py_ssize_t chunks,
           const float[::1] mins, const float[::1] maxs, uint8_t[::1] payload,
           Py_ssize_t record, Py_ssize_t header):
    """One pass: the codes of chunk ``c`` go to ``payload[c * record + header:]``."""
    cdef Py_ssize_t n = src.shape[0]
    cdef Py_ssize_t m = n // chunks
    cdef Py_ssize_t c, i, base
    cdef float scale, upper, lower, q
    cdef const float* tab = &lut[0] if lut.shape[0] else NULL
    cdef const src_t* p = &src[0]
    cdef uint8_t* out
    with nogil:
        for c in range(chunks):
            base = c * m
            scale = _scale(mins[c], maxs[c])
            upper = _rint(maxs[c] * scale)
            lower = upper - <float>255.0
            out = &payload[c * record + header]
            for i in range(m):
                q = _rint(_load(p, base + i, kind, tab) * scale)
                q = q if q < upper else upper
                q = q - lower
                # Saturate (only rounding at the chunk's edge can step outside [0, 255]).
                q = q if q > 0 else <float>0.0
                q = q if q < <float>255.0 else <float>255.0
                out[i] = <uint8_t>q


def decode(const uint8_t[::1] payload, Py_ssize_t record, Py_ssize_t header,
           Py_ssize_t chunks, const float[::1] mins, const float[::1] maxs, float[::1] out):
    """``out[c * m + i] = (q + lower) / scale`` in float32, chunk by chunk."""
    cdef Py_ssize_t n = out.shape[0]
    cdef Py_ssize_t m = n // chunks
    cdef Py_ssize_t c, i
    cdef float scale, lower
    cdef const uint8_t* codes
    cdef float* dst
    with nogil:
        for c in range(chunks):
            scale = _scale(mins[c], maxs[c])
            lower = _rint(maxs[c] * scale) - <float>255.0
            codes = &payload[c * record + header]
            dst = &out[c * m]
            for i in range(m):
                dst[i] = (<float>codes[i] + lower) / scale
