"""CUDA kernels of the MinMaxUInt8 and MinMaxUInt4 formats, through CuPy; bytes identical to
the Cython ones.

Same float32 arithmetic as ``_minmax.pyx``: 16-bit inputs are widened exactly (float16 by
decoding its bits, bfloat16 by a shift), rounding is ``rintf`` (half to even), the scale is an
IEEE division, and the kernels are compiled with ``--fmad=false`` (no product fused into an
add), ``--ftz=false`` and ``--prec-div=true``.  Min and max per chunk come from torch's
``aminmax`` (spread over the GPU at any chunk count); codes are written by a grid over
(chunk, group of 4 code bytes: one 32-bit store), decoded likewise.  Headers and zero padding
are written with torch, exactly as on CPU.
Kernels run on CuPy's current stream (the caller sets it to torch's current stream).
A chunk holding a NaN or an infinity gets the header ``[NaN, NaN]`` and codes 0, as on CPU.
"""

from __future__ import annotations

import functools

import torch

from ._format import HEADER_BYTES, header_bytes, record_bytes, record_bytes4
from ._format import KINDS as _KINDS

_SOURCE = r"""
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

__device__ __forceinline__ float f16_to_f32(u16 h) {
    unsigned int sign = ((unsigned int)(h & 0x8000u)) << 16;
    unsigned int e = (h >> 10) & 0x1fu;
    unsigned int m = h & 0x3ffu;
    if (e == 0) {                         /* zero or subnormal: m * 2^-24, exact */
        float f = (float)m * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

template <int KIND> __device__ __forceinline__ float load(const void* p, long long i);
template <> __device__ __forceinline__ float load<0>(const void* p, long long i) {
    return ((const float*)p)[i];
}
template <> __device__ __forceinline__ float load<1>(const void* p, long long i) {
    return f16_to_f32(((const u16*)p)[i]);
}
template <> __device__ __forceinline__ float load<2>(const void* p, long long i) {
    return __uint_as_float(((unsigned int)((const u16*)p)[i]) << 16);
}

/* BITS 8: 255 levels, one code a byte; BITS 4: 15 levels, two codes a byte (element 2k in
   the low nibble).  A thread handles a group of 4 code bytes: one 32-bit store or load. */
template <int BITS> struct Fmt {
    static constexpr float levels = BITS == 8 ? 255.0f : 15.0f;
    static constexpr int per = BITS == 8 ? 4 : 8;          /* elements a group */
};

template <int KIND, int BITS>
__device__ void encode_impl(const void* src, long long m, const float* mins, const float* maxs,
                            u8* payload, long long record) {
    const float levels = Fmt<BITS>::levels;
    const int per = Fmt<BITS>::per;
    long long c = blockIdx.y;
    float mn = mins[c], mx = maxs[c];
    float scale = levels / ((mx - mn) + 1e-7f);
    float upper = rintf(mx * scale);
    float lower = upper - levels;
    bool bad = mn != mn;                  /* non-finite chunk: codes 0, decodes to NaN */
    u8* out = payload + c * record + 32;  /* records are multiples of 32 bytes */
    long long first = c * m;
    long long groups = (m + per - 1) / per;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < groups;
         g += (long long)gridDim.x * blockDim.x) {
        u32 word = 0;
        long long e0 = g * per;
        if (!bad) {
            for (int j = 0; j < per; ++j) {
                long long e = e0 + j;
                if (e >= m) break;
                float q = rintf(load<KIND>(src, first + e) * scale);
                q = q < upper ? q : upper;
                q = q - lower;
                q = q > 0.0f ? q : 0.0f;
                q = q < levels ? q : levels;
                word |= ((u32)q) << (BITS * j);
            }
        }
        long long nbytes = BITS == 8 ? m - e0 : (m - e0) / 2;
        if (nbytes >= 4) {
            *(u32*)(out + g * 4) = word;
        } else {
            for (int b = 0; b < nbytes; ++b) out[g * 4 + b] = (u8)(word >> (8 * b));
        }
    }
}

template <int BITS>
__device__ void decode_impl(const u8* payload, long long record, long long m, const float* mins,
                            const float* maxs, float* out) {
    const float levels = Fmt<BITS>::levels;
    const int per = Fmt<BITS>::per;
    long long c = blockIdx.y;
    float scale = levels / ((maxs[c] - mins[c]) + 1e-7f);
    float lower = rintf(maxs[c] * scale) - levels;
    const u8* codes = payload + c * record + 32;
    float* dst = out + c * m;
    long long groups = (m + per - 1) / per;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < groups;
         g += (long long)gridDim.x * blockDim.x) {
        long long e0 = g * per;
        long long nbytes = BITS == 8 ? m - e0 : (m - e0) / 2;
        u32 word;
        if (nbytes >= 4) {
            word = *(const u32*)(codes + g * 4);
        } else {
            word = 0;
            for (int b = 0; b < nbytes; ++b) word |= ((u32)codes[g * 4 + b]) << (8 * b);
        }
        for (int j = 0; j < per; ++j) {
            long long e = e0 + j;
            if (e >= m) break;
            float q = (float)((word >> (BITS * j)) & (BITS == 8 ? 0xffu : 0xfu));
            dst[e] = (q + lower) / scale;
        }
    }
}

extern "C" {
__global__ void encode8_f32(const void* s, long long m, const float* a, const float* b, u8* p, long long r) { encode_impl<0, 8>(s, m, a, b, p, r); }
__global__ void encode8_f16(const void* s, long long m, const float* a, const float* b, u8* p, long long r) { encode_impl<1, 8>(s, m, a, b, p, r); }
__global__ void encode8_bf16(const void* s, long long m, const float* a, const float* b, u8* p, long long r) { encode_impl<2, 8>(s, m, a, b, p, r); }
__global__ void encode4_f32(const void* s, long long m, const float* a, const float* b, u8* p, long long r) { encode_impl<0, 4>(s, m, a, b, p, r); }
__global__ void encode4_f16(const void* s, long long m, const float* a, const float* b, u8* p, long long r) { encode_impl<1, 4>(s, m, a, b, p, r); }
__global__ void encode4_bf16(const void* s, long long m, const float* a, const float* b, u8* p, long long r) { encode_impl<2, 4>(s, m, a, b, p, r); }
__global__ void decode8(const u8* p, long long r, long long m, const float* a, const float* b, float* o) { decode_impl<8>(p, r, m, a, b, o); }
__global__ void decode4(const u8* p, long long r, long long m, const float* a, const float* b, float* o) { decode_impl<4>(p, r, m, a, b, o); }
}
"""

_NAMES = {0: "f32", 1: "f16", 2: "bf16"}
_THREADS = 256
#: --fmad=false: no product fused into an add (the CPU kernels' rounding); --ftz=false and
#: --prec-div=true: subnormals kept and IEEE division, as on CPU.  No -std: CuPy 14 picks C++17
#: (NVRTC 13's default dialect too); the source is plain C++11.
_OPTIONS = ("--fmad=false", "--ftz=false", "--prec-div=true")


@functools.cache
def _module(device: int):
    import cupy

    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=_SOURCE, options=_OPTIONS)
        try:
            module.compile()
        except cupy.cuda.compiler.CompileException:
            # a CuPy that sets --ftz or --prec-div itself may refuse them twice: its own then
            module = cupy.RawModule(code=_SOURCE, options=_OPTIONS[:1])
        return module


_STREAMS: dict = {}


def _stream():
    """CuPy's view of torch's current stream, made once per stream (CuPy 14 warns at every
    ``ExternalStream`` made, and making one costs host time at every call)."""
    ptr = torch.cuda.current_stream().cuda_stream
    got = _STREAMS.get(ptr)
    if got is None:
        import cupy

        got = _STREAMS[ptr] = cupy.cuda.ExternalStream(ptr)
    return got


def _ptr(t: torch.Tensor):
    import numpy as np

    return np.uint64(t.data_ptr())


def _grid(m, bits):
    groups = -(-m // (4 if bits == 8 else 8))
    return min(max(1, -(-groups // _THREADS)), 1024)


def minmax(flat: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk float32 min and max (``-0`` canonicalised to ``+0``; a chunk holding a NaN
    or an infinity gets NaN for both), by torch's one-pass ``aminmax``: a reduction spread
    over the whole GPU whatever the chunk count (one block per chunk left a single block
    reading the whole tensor at one chunk).  Min and max of 16-bit values are exact, and
    widening them is exact, so this equals the CPU kernels' float32 min and max."""
    mn, mx = torch.aminmax(flat.view(chunks, -1), dim=1)
    mins, maxs = mn.float() + 0.0, mx.float() + 0.0     # + 0 turns -0 into +0
    bad = ~(torch.isfinite(mins) & torch.isfinite(maxs))  # NaN propagates; infinities show
    return mins.masked_fill(bad, float("nan")), maxs.masked_fill(bad, float("nan"))


def compress(flat: torch.Tensor, chunks: int, payload: torch.Tensor | None = None,
             bits: int = 8):
    """The ``bits``-bit record layout (8: ``compression``; 4: ``_minmax4``) on the GPU."""
    import numpy as np

    if chunks > 65535:
        raise ValueError(f"chunks must be <= 65535 for CUDA tensors, got {chunks}")
    m = flat.numel() // chunks
    rec = record_bytes(m) if bits == 8 else record_bytes4(m)
    isz = flat.element_size()
    if payload is None:
        payload = torch.empty(chunks * rec, dtype=torch.uint8, device=flat.device)
    payload = payload.view(-1)
    if payload.data_ptr() % 4:            # the kernels store 4 code bytes at a time
        return payload.copy_(compress(flat, chunks, None, bits))
    mins, maxs = minmax(flat, chunks)
    kind = _KINDS[flat.dtype]
    fn = _module(flat.device.index).get_function(f"encode{bits}_{_NAMES[kind]}")
    with _stream():
        fn((_grid(m, bits), chunks), (_THREADS,), (_ptr(flat), np.int64(m), _ptr(mins),
                                                   _ptr(maxs), _ptr(payload), np.int64(rec)))
    rows = payload.view(chunks, rec)
    rows[:, :2 * isz] = header_bytes(mins, maxs, flat.dtype)
    rows[:, 2 * isz:HEADER_BYTES] = 0
    rows[:, HEADER_BYTES + (m if bits == 8 else m // 2):] = 0
    return payload


def decompress(payload: torch.Tensor, out: torch.Tensor, chunks: int, dtype: torch.dtype,
               bits: int = 8):
    import numpy as np

    m = out.numel() // chunks
    rec = record_bytes(m) if bits == 8 else record_bytes4(m)
    if payload.data_ptr() % 4:            # the kernels load 4 code bytes at a time
        payload = payload.clone()
    isz = torch.empty(0, dtype=dtype).element_size()
    header = payload.view(chunks, rec)[:, :2 * isz].contiguous().view(dtype).float()
    mins = header[:, 0].contiguous()
    maxs = header[:, 1].contiguous()
    target = out if out.dtype is torch.float32 else torch.empty(out.numel(),
                                                                dtype=torch.float32,
                                                                device=out.device)
    fn = _module(out.device.index).get_function(f"decode{bits}")
    with _stream():
        fn((_grid(m, bits), chunks), (_THREADS,), (_ptr(payload), np.int64(rec), np.int64(m),
                                                   _ptr(mins), _ptr(maxs), _ptr(target)))
    if target is not out:
        out.copy_(target)
