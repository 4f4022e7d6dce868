# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""CPU kernels of the MinMaxUInt8 format (see ``compression.py``), without the GIL.

Inputs are float32 (``float``) or 16-bit floats passed as their raw bits (``uint16_t``:
float16 through a lookup table, bfloat16 by a shift); every value is widened to float32
exactly and all arithmetic is float32.  Rounding is round-half-to-even (``rint``), written
with the 2**23 trick so that it is exact without SSE4.1 and identical to CUDA's ``rintf``.
``compress_records`` writes a whole payload in one call (per chunk: min/max, the ``[min,
max]`` header in the tensor's own type, codes, zero padding); ``decode_reduce`` decodes the
records of several ranks, headers included, and reduces them into one float32 output (the
per-bucket calls of ``compressed_allreduce``).  ``minmax``/``encode``/``decode`` take the
headers from (and leave them to) the caller.
float32 input takes the SSE2 loops of ``_minmax_simd.h`` (same operations, same bytes) for
the min/max pass and the 4-bit codes; 16-bit input the loops below.

Non-finite input: a chunk holding a NaN or an infinity gets the header ``[NaN, NaN]`` and all
codes 0, and decodes to NaN everywhere (the formula itself would quietly clamp a NaN to the
chunk's maximum).  Finite chunks are unaffected.
"""

from libc.stdint cimport uint8_t, uint16_t, uint32_t
from libc.math cimport copysignf, fabsf
from libc.string cimport memcpy, memset

cdef extern from "_minmax_simd.h" nogil:
    # float32 fast paths (SSE2 on x86-64, plain C elsewhere): the same float32 operations
    int bagua_minmax_f32(const float* p, Py_ssize_t m, float* mn, float* mx)
    void bagua_codes4_f32(const float* p, Py_ssize_t m, float scale, float lower, float upper,
                          uint8_t* out)
    void bagua_decode4_f32(const uint8_t* codes, Py_ssize_t n, const float* pairs, float* out,
                           int stream)

ctypedef fused src_t:
    float
    uint16_t

cdef enum:
    # decode4 writes outputs of at least this many floats (16 MiB) with non-temporal stores
    STREAM_FLOATS = 1 << 22
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


cdef inline float _nan() noexcept nogil:
    return _bits_to_f32(0x7fc00000)  # the canonical quiet NaN (as CUDA and torch write it)


cdef inline float _scale(float mn, float mx) noexcept nogil:
    return <float>255.0 / ((mx - mn) + <float>1e-7)


cdef void _minmax_chunk(const src_t* p, Py_ssize_t m, int kind, const float* tab,
                        float* mn_out, float* mx_out) noexcept nogil:
    """Min and max of ``p[:m]``: eight independent lanes (the compiler makes them vector
    min/max instructions), folded at the end.  ``z`` sums ``v * 0``, which stays 0 unless
    some ``v`` is NaN or infinite: then both results are NaN."""
    cdef float a[8]
    cdef float b[8]
    cdef float z[8]
    cdef float v
    cdef Py_ssize_t i = 0
    cdef int k
    v = _load(p, 0, kind, tab)
    for k in range(8):
        a[k] = v
        b[k] = v
        z[k] = 0
    while i + 8 <= m:
        for k in range(8):
            v = _load(p, i + k, kind, tab)
            a[k] = v if v < a[k] else a[k]
            b[k] = v if v > b[k] else b[k]
            z[k] = z[k] + v * <float>0.0
        i += 8
    while i < m:
        v = _load(p, i, kind, tab)
        a[0] = v if v < a[0] else a[0]
        b[0] = v if v > b[0] else b[0]
        z[0] = z[0] + v * <float>0.0
        i += 1
    for k in range(1, 8):
        a[0] = a[k] if a[k] < a[0] else a[0]
        b[0] = b[k] if b[k] > b[0] else b[0]
        z[0] = z[0] + z[k]
    if z[0] != z[0]:  # a NaN or an infinity in the chunk
        mn_out[0] = _nan()
        mx_out[0] = _nan()
        return
    mn_out[0] = a[0] + <float>0.0  # -0 becomes +0
    mx_out[0] = b[0] + <float>0.0


def minmax(const src_t[::1] src, int kind, const float[::1] lut, Py_ssize_t chunks,
           float[::1] mins, float[::1] maxs):
    """One pass per chunk: its min and max in float32 (``-0`` canonicalised to ``+0``)."""
    cdef Py_ssize_t m = src.shape[0] // chunks
    cdef Py_ssize_t c
    cdef const float* tab = &lut[0] if lut.shape[0] else NULL
    cdef const src_t* p = &src[0]
    with nogil:
        for c in range(chunks):
            _minmax_one(p + c * m, m, kind, tab, &mins[c], &maxs[c])


cdef inline void _minmax_one(const src_t* p, Py_ssize_t m, int kind, const float* tab,
                             float* mn, float* mx) noexcept nogil:
    if src_t is float:
        if bagua_minmax_f32(p, m, mn, mx):
            mn[0] = _nan()
            mx[0] = _nan()
    else:
        _minmax_chunk(p, m, kind, tab, mn, mx)


cdef void _codes_small(const src_t* p, Py_ssize_t m, int kind, const float* tab, float scale,
                       float lower, float upper, uint8_t* out) noexcept nogil:
    """Codes when |lower|, |upper| <= 2**22 (every ordinary chunk).

    ``min(rint(v), upper) - lower`` saturated at 0 equals ``rint(clamp(v, lower, upper)) -
    lower`` because rint is monotonic and the bounds are integers; on the clamped value,
    adding and subtracting 1.5 * 2**23 rounds half to even exactly.  Few, branch-free
    operations: the loop vectorises.
    """
    cdef Py_ssize_t i
    cdef float v
    for i in range(m):
        v = _load(p, i, kind, tab) * scale
        v = v if v < upper else upper
        v = v if v > lower else lower
        v = (v + <float>12582912.0) - <float>12582912.0
        out[i] = <uint8_t>(<int>(v - lower))


cdef void _codes_general(const src_t* p, Py_ssize_t m, int kind, const float* tab,
                         float scale, float lower, float upper, uint8_t* out) noexcept nogil:
    """The formula as written, for chunks whose bounds are huge (near-constant chunks)."""
    cdef Py_ssize_t i
    cdef float q
    for i in range(m):
        q = _rint(_load(p, i, kind, tab) * scale)
        q = q if q < upper else upper
        q = q - lower
        # Saturate (only rounding at the chunk's edge can step below 0).
        q = q if q > 0 else <float>0.0
        q = q if q < <float>255.0 else <float>255.0
        out[i] = <uint8_t>q


def encode(const src_t[::1] src, int kind, const float[::1] lut, Py_ssize_t chunks,
           const float[::1] mins, const float[::1] maxs, uint8_t[::1] payload,
           Py_ssize_t record, Py_ssize_t header):
    """One pass: the codes of chunk ``c`` go to ``payload[c * record + header:]``."""
    cdef Py_ssize_t n = src.shape[0]
    cdef Py_ssize_t m = n // chunks
    cdef Py_ssize_t c
    cdef const float* tab = &lut[0] if lut.shape[0] else NULL
    cdef const src_t* p = &src[0]
    with nogil:
        for c in range(chunks):
            _encode_one(p + c * m, m, kind, tab, mins[c], maxs[c], &payload[c * record + header])


def minmax_encode(const src_t[::1] src, int kind, const float[::1] lut, Py_ssize_t chunks,
                  float[::1] mins, float[::1] maxs, uint8_t[::1] payload,
                  Py_ssize_t record, Py_ssize_t header):
    """``minmax`` then ``encode``, chunk by chunk: the encoding pass finds a chunk that fits
    the cache still there, instead of reading the whole input from memory twice."""
    cdef Py_ssize_t m = src.shape[0] // chunks
    cdef Py_ssize_t c
    cdef const float* tab = &lut[0] if lut.shape[0] else NULL
    cdef const src_t* p = &src[0]
    with nogil:
        for c in range(chunks):
            _minmax_one(p + c * m, m, kind, tab, &mins[c], &maxs[c])
            _encode_one(p + c * m, m, kind, tab, mins[c], maxs[c], &payload[c * record + header])


cdef void _encode_one(const src_t* p, Py_ssize_t m, int kind, const float* tab, float mn,
                      float mx, uint8_t* out) noexcept nogil:
    cdef float scale = _scale(mn, mx)
    cdef float upper = _rint(mx * scale)
    cdef float lower = upper - <float>255.0
    if mn != mn:  # non-finite chunk: codes 0, decodes to NaN
        memset(out, 0, m)
    elif fabsf(upper) <= <float>4194304.0 and fabsf(lower) <= <float>4194304.0:
        _codes_small(p, m, kind, tab, scale, lower, upper, out)
    else:
        _codes_general(p, m, kind, tab, scale, lower, upper, out)


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


# -- MinMaxUInt4 (``_minmax4.py``): the same rules at 15 levels, two codes per byte ------------
cdef inline float _scale4(float mn, float mx) noexcept nogil:
    return <float>15.0 / ((mx - mn) + <float>1e-7)


cdef inline uint8_t _code4_small(float v, float lower, float upper) noexcept nogil:
    # as _codes_small: clamp to [lower, upper] (integers), then round half to even
    v = v if v < upper else upper
    v = v if v > lower else lower
    v = (v + <float>12582912.0) - <float>12582912.0
    return <uint8_t>(<int>(v - lower))


cdef inline uint8_t _code4_general(float v, float lower, float upper) noexcept nogil:
    cdef float q = _rint(v)
    q = q if q < upper else upper
    q = q - lower
    q = q if q > 0 else <float>0.0
    q = q if q < <float>15.0 else <float>15.0
    return <uint8_t>q


cdef void _codes4(const src_t* p, Py_ssize_t m, int kind, const float* tab, float scale,
                  float lower, float upper, uint8_t* out) noexcept nogil:
    """Element ``2k`` in the low nibble of ``out[k]``, ``2k + 1`` in the high one."""
    cdef Py_ssize_t k
    cdef uint8_t a, b
    if fabsf(upper) <= <float>4194304.0 and fabsf(lower) <= <float>4194304.0:
        if src_t is float:
            bagua_codes4_f32(p, m, scale, lower, upper, out)
            return
        for k in range(m // 2):
            a = _code4_small(_load(p, 2 * k, kind, tab) * scale, lower, upper)
            b = _code4_small(_load(p, 2 * k + 1, kind, tab) * scale, lower, upper)
            out[k] = a | (b << 4)
    else:
        for k in range(m // 2):
            a = _code4_general(_load(p, 2 * k, kind, tab) * scale, lower, upper)
            b = _code4_general(_load(p, 2 * k + 1, kind, tab) * scale, lower, upper)
            out[k] = a | (b << 4)


def encode4(const src_t[::1] src, int kind, const float[::1] lut, Py_ssize_t chunks,
            const float[::1] mins, const float[::1] maxs, uint8_t[::1] payload,
            Py_ssize_t record, Py_ssize_t header):
    """One pass: chunk ``c``'s ``m / 2`` code bytes go to ``payload[c * record + header:]``."""
    cdef Py_ssize_t m = src.shape[0] // chunks
    cdef Py_ssize_t c
    cdef const float* tab = &lut[0] if lut.shape[0] else NULL
    cdef const src_t* p = &src[0]
    with nogil:
        for c in range(chunks):
            _encode4_one(p + c * m, m, kind, tab, mins[c], maxs[c], &payload[c * record + header])


def minmax_encode4(const src_t[::1] src, int kind, const float[::1] lut, Py_ssize_t chunks,
                   float[::1] mins, float[::1] maxs, uint8_t[::1] payload,
                   Py_ssize_t record, Py_ssize_t header):
    """``minmax`` then ``encode4``, chunk by chunk (see ``minmax_encode``)."""
    cdef Py_ssize_t m = src.shape[0] // chunks
    cdef Py_ssize_t c
    cdef const float* tab = &lut[0] if lut.shape[0] else NULL
    cdef const src_t* p = &src[0]
    with nogil:
        for c in range(chunks):
            _minmax_one(p + c * m, m, kind, tab, &mins[c], &maxs[c])
            _encode4_one(p + c * m, m, kind, tab, mins[c], maxs[c], &payload[c * record + header])


cdef void _encode4_one(const src_t* p, Py_ssize_t m, int kind, const float* tab, float mn,
                       float mx, uint8_t* out) noexcept nogil:
    cdef float scale, upper, lower
    if mn != mn:  # non-finite chunk: codes 0, decodes to NaN
        memset(out, 0, m // 2)
        return
    scale = _scale4(mn, mx)
    upper = _rint(mx * scale)
    lower = upper - <float>15.0
    _codes4(p, m, kind, tab, scale, lower, upper, out)


def decode4(const uint8_t[::1] payload, Py_ssize_t record, Py_ssize_t header,
            Py_ssize_t chunks, const float[::1] mins, const float[::1] maxs, float[::1] out):
    """``out[c * m + i] = (q + lower) / scale`` in float32, two codes per byte."""
    cdef Py_ssize_t m = out.shape[0] // chunks
    cdef Py_ssize_t c
    cdef int b
    cdef float scale, lower
    cdef float pairs[512]  # byte b -> its two decoded values (16 levels: one division each)
    with nogil:
        for c in range(chunks):
            scale = _scale4(mins[c], maxs[c])
            lower = _rint(maxs[c] * scale) - <float>15.0
            for b in range(16):
                pairs[2 * b] = (<float>b + lower) / scale
            for b in range(16, 256):
                pairs[2 * b] = pairs[2 * (b & 15)]
            for b in range(256):
                pairs[2 * b + 1] = pairs[2 * (b >> 4)]
            bagua_decode4_f32(&payload[c * record + header], m // 2, pairs, &out[c * m],
                              out.shape[0] >= STREAM_FLOATS)


# -- fused whole-bucket entry points: headers and padding written here, one call per bucket ----
cdef inline uint16_t _f32_to_f16_exact(float v) noexcept nogil:
    """float16 bits of ``v``, a float16 value widened exactly (a chunk's min or max)."""
    cdef uint32_t b
    cdef uint32_t sign
    cdef int e
    memcpy(&b, &v, 4)
    sign = (b >> 16) & 0x8000
    if v != v:
        return 0x7E00                                  # the canonical quiet NaN
    if v == 0:
        return <uint16_t>sign
    e = <int>((b >> 23) & 0xff) - 127
    if e >= -14:
        return <uint16_t>(sign | ((e + 15) << 10) | ((b >> 13) & 0x3ff))
    return <uint16_t>(sign | <uint32_t>(fabsf(v) * <float>16777216.0))   # subnormal: m * 2^-24


cdef inline void _put_header(uint8_t* rec, float mn, float mx, int kind) noexcept nogil:
    """``[min, max]`` in the input's type, then zeros up to the header's 32 bytes."""
    cdef uint16_t h[2]
    cdef uint32_t bits
    memset(rec, 0, 32)
    if kind == KIND_F32:
        memcpy(rec, &mn, 4)
        memcpy(rec + 4, &mx, 4)
        return
    if kind == KIND_BF16:
        memcpy(&bits, &mn, 4)
        h[0] = 0x7FC0 if mn != mn else <uint16_t>(bits >> 16)
        memcpy(&bits, &mx, 4)
        h[1] = 0x7FC0 if mx != mx else <uint16_t>(bits >> 16)
    else:
        h[0] = _f32_to_f16_exact(mn)
        h[1] = _f32_to_f16_exact(mx)
    memcpy(rec, h, 4)


cdef inline void _get_header(const uint8_t* rec, int kind, const float* lut, float* mn,
                             float* mx) noexcept nogil:
    cdef uint16_t h[2]
    if kind == KIND_F32:
        memcpy(mn, rec, 4)
        memcpy(mx, rec + 4, 4)
        return
    memcpy(h, rec, 4)
    if kind == KIND_BF16:
        mn[0] = _bits_to_f32((<uint32_t>h[0]) << 16)
        mx[0] = _bits_to_f32((<uint32_t>h[1]) << 16)
    else:
        mn[0] = lut[h[0]]
        mx[0] = lut[h[1]]


def compress_records(const src_t[::1] src, int kind, const float[::1] lut, Py_ssize_t chunks,
                     uint8_t[::1] payload, Py_ssize_t record):
    """The whole MinMaxUInt8 payload of ``src`` in one call: per chunk its min/max, header
    (in the input's type, canonical NaN, zero-padded to 32 bytes), codes and zero padding to
    ``record`` bytes.  ``payload`` holds ``chunks * record`` bytes."""
    cdef Py_ssize_t m = src.shape[0] // chunks
    cdef const float* tab = &lut[0] if lut.shape[0] else NULL
    if payload.shape[0] != chunks * record or record < 32 + m:
        raise ValueError(f"payload must hold {chunks} records of at least {32 + m} bytes")
    with nogil:
        _compress_records(&src[0], m, kind, tab, chunks, &payload[0], record)


def compress_records_at(Py_ssize_t src, Py_ssize_t n, int kind, const float[::1] lut,
                        Py_ssize_t chunks, Py_ssize_t payload, Py_ssize_t nbytes,
                        Py_ssize_t record):
    """``compress_records`` on addresses (``tensor.data_ptr()``): ``n`` elements at ``src``
    (float32, or 16-bit floats of ``kind``), ``nbytes`` payload bytes at ``payload``.  The
    caller guarantees both are live, contiguous CPU memory of these sizes."""
    cdef Py_ssize_t m = n // chunks
    cdef const float* tab = &lut[0] if lut.shape[0] else NULL
    if n <= 0 or n % chunks or nbytes != chunks * record or record < 32 + m \
            or (kind != KIND_F32 and kind != KIND_F16 and kind != KIND_BF16) \
            or (kind == KIND_F16 and tab == NULL):
        raise ValueError("compress_records_at: sizes or kind disagree")
    with nogil:
        if kind == KIND_F32:
            _compress_records(<const float*>src, m, kind, tab, chunks, <uint8_t*>payload,
                              record)
        else:
            _compress_records(<const uint16_t*>src, m, kind, tab, chunks, <uint8_t*>payload,
                              record)


cdef void compress_any(const void* src, Py_ssize_t m, int kind, const float* tab,
                       Py_ssize_t chunks, uint8_t* payload, Py_ssize_t record) noexcept nogil:
    """``_compress_records`` of ``chunks`` chunks of ``m`` elements at ``src`` (of ``kind``):
    the entry point of ``_minmax.pxd`` (the caller checked what ``compress_records_at``
    checks)."""
    if kind == KIND_F32:
        _compress_records(<const float*>src, m, kind, tab, chunks, payload, record)
    else:
        _compress_records(<const uint16_t*>src, m, kind, tab, chunks, payload, record)


cdef void _compress_records(const src_t* p, Py_ssize_t m, int kind, const float* tab,
                            Py_ssize_t chunks, uint8_t* payload,
                            Py_ssize_t record) noexcept nogil:
    cdef Py_ssize_t c
    cdef float mn, mx
    cdef uint8_t* rec
    for c in range(chunks):
        rec = payload + c * record
        _minmax_one(p + c * m, m, kind, tab, &mn, &mx)
        _put_header(rec, mn, mx, kind)
        _encode_one(p + c * m, m, kind, tab, mn, mx, rec + 32)
        memset(rec + 32 + m, 0, record - 32 - m)


cdef enum:
    OP_SUM = 0
    OP_AVG = 1
    OP_MIN = 2
    OP_MAX = 3
    OP_ADD = 4      # out += the decoding (one row)


def decode_reduce(const uint8_t[::1] payload, Py_ssize_t record, Py_ssize_t chunks,
                  Py_ssize_t rows, int kind, const float[::1] lut, float[::1] out, int op):
    """Decode ``rows`` concatenated payloads of ``chunks / rows`` records each (headers read
    here, in the type ``kind``) and reduce them element by element into ``out`` (float32,
    one row's elements): ``op`` 0 sum, 1 average (the sum, then divided by ``rows``), 2 min,
    3 max (a NaN wins), rows accumulated in order; 4: ``out += `` the decoding (one row).
    ``rows=1, op=0`` is a plain decode."""
    decode_reduce_at(<Py_ssize_t>&payload[0], payload.shape[0], record, chunks, rows, kind, lut,
                     <Py_ssize_t>&out[0], out.shape[0], op)


def decode_reduce_at(Py_ssize_t payload, Py_ssize_t nbytes, Py_ssize_t record,
                     Py_ssize_t chunks, Py_ssize_t rows, int kind, const float[::1] lut,
                     Py_ssize_t out, Py_ssize_t n, int op):
    """``decode_reduce`` on addresses (``tensor.data_ptr()``): ``nbytes`` payload bytes and
    ``n`` float32 outputs, live contiguous CPU memory the caller vouches for."""
    cdef Py_ssize_t k
    cdef const float* tab = &lut[0] if lut.shape[0] else NULL
    if rows < 1 or chunks % rows or n <= 0 or op < 0 or op > 4 or (op == OP_ADD and rows != 1):
        raise ValueError("decode_reduce: payload, rows and out disagree")
    k = chunks // rows
    if n % k or nbytes != chunks * record or record < 32 + n // k \
            or (kind == KIND_F16 and tab == NULL):
        raise ValueError("decode_reduce: payload, rows and out disagree")
    with nogil:
        _decode_reduce(<const uint8_t*>payload, record, k, rows, kind, tab, <float*>out, n, op)


cdef void decode_reduce_any(const uint8_t* payload, Py_ssize_t record, Py_ssize_t k,
                            Py_ssize_t rows, int kind, const float* tab, float* out,
                            Py_ssize_t n, int op) noexcept nogil:
    """``_decode_reduce``: the entry point of ``_minmax.pxd`` (the caller checked what
    ``decode_reduce_at`` checks)."""
    _decode_reduce(payload, record, k, rows, kind, tab, out, n, op)


cdef void _decode_reduce(const uint8_t* payload, Py_ssize_t record, Py_ssize_t k,
                         Py_ssize_t rows, int kind, const float* tab, float* out, Py_ssize_t n,
                         int op) noexcept nogil:
    cdef Py_ssize_t m = n // k
    cdef Py_ssize_t r, j, i
    cdef float mn, mx, scale, lower, v, a
    cdef float denom = <float>rows
    cdef const uint8_t* rec
    cdef float* dst
    for r in range(rows):
        for j in range(k):
            rec = payload + (r * k + j) * record
            _get_header(rec, kind, tab, &mn, &mx)
            scale = _scale(mn, mx)
            lower = _rint(mx * scale) - <float>255.0
            rec = rec + 32
            dst = out + j * m
            if op == OP_ADD:
                for i in range(m):
                    dst[i] = dst[i] + (<float>rec[i] + lower) / scale
            elif r == 0:
                for i in range(m):
                    dst[i] = (<float>rec[i] + lower) / scale
            elif op == OP_SUM or op == OP_AVG:
                for i in range(m):
                    dst[i] = dst[i] + (<float>rec[i] + lower) / scale
            elif op == OP_MIN:
                for i in range(m):
                    v = (<float>rec[i] + lower) / scale
                    a = dst[i]
                    dst[i] = v if (v < a or v != v) else a
            else:
                for i in range(m):
                    v = (<float>rec[i] + lower) / scale
                    a = dst[i]
                    dst[i] = v if (v > a or v != v) else a
    if op == OP_AVG and rows > 1:
        for i in range(n):
            out[i] = out[i] / denom
