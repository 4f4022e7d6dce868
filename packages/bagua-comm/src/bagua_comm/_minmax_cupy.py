"""CUDA kernels of the MinMaxUInt8 format, through CuPy; bytes identical to the Cython ones.

Same float32 arithmetic as ``_minmax.pyx``: 16-bit inputs are widened exactly (float16 by
decoding its bits, bfloat16 by a shift), rounding is ``rintf`` (half to even), the scale is an
IEEE division, and the kernels are compiled with ``--fmad=false`` so that no product is fused
into an add.  Min and max are reduced per chunk by one block; codes are written by a grid
over (chunk, element).  Headers and zero padding are written with torch, exactly as on CPU.
Kernels run on CuPy's current stream (the caller sets it to torch's current stream).
A chunk holding a NaN or an infinity gets the header ``[NaN, NaN]`` and codes 0, as on CPU.
"""

from __future__ import annotations

import functools

import torch

from .compression import _KINDS, HEADER_BYTES, header_bytes, record_bytes

_SOURCE = r"""
typedef unsigned char u8;
typedef unsigned short u16;

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

__device__ __forceinline__ float scale_of(float mn, float mx) {
    return 255.0f / ((mx - mn) + 1e-7f);
}

template <int KIND>
__device__ void minmax_impl(const void* src, long long m, float* mins, float* maxs) {
    __shared__ float smin[256];
    __shared__ float smax[256];
    long long base = (long long)blockIdx.x * m;
    float first = load<KIND>(src, base);
    float a = first, b = first;
    int bad = 0;
    for (long long i = threadIdx.x; i < m; i += blockDim.x) {
        float v = load<KIND>(src, base + i);
        a = v < a ? v : a;
        b = v > b ? v : b;
        bad |= !isfinite(v);
    }
    bad = __syncthreads_or(bad);          /* a NaN or an infinity anywhere in the chunk */
    smin[threadIdx.x] = a;
    smax[threadIdx.x] = b;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float x = smin[threadIdx.x + s], y = smax[threadIdx.x + s];
            smin[threadIdx.x] = x < smin[threadIdx.x] ? x : smin[threadIdx.x];
            smax[threadIdx.x] = y > smax[threadIdx.x] ? y : smax[threadIdx.x];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float nan = __int_as_float(0x7fc00000);
        mins[blockIdx.x] = bad ? nan : smin[0] + 0.0f;    /* -0 becomes +0 */
        maxs[blockIdx.x] = bad ? nan : smax[0] + 0.0f;
    }
}

template <int KIND>
__device__ void encode_impl(const void* src, long long m, const float* mins, const float* maxs,
                            u8* payload, long long record) {
    long long c = blockIdx.y;
    float scale = scale_of(mins[c], maxs[c]);
    float upper = rintf(maxs[c] * scale);
    float lower = upper - 255.0f;
    u8* out = payload + c * record + 32;
    bool bad = mins[c] != mins[c];        /* non-finite chunk: codes 0, decodes to NaN */
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < m;
         i += (long long)gridDim.x * blockDim.x) {
        if (bad) { out[i] = 0; continue; }
        float q = rintf(load<KIND>(src, c * m + i) * scale);
        q = q < upper ? q : upper;
        q = q - lower;
        q = q > 0.0f ? q : 0.0f;
        q = q < 255.0f ? q : 255.0f;
        out[i] = (u8)q;
    }
}

extern "C" {
__global__ void minmax_f32(const void* s, long long m, float* a, float* b) { minmax_impl<0>(s, m, a, b); }
__global__ void minmax_f16(const void* s, long long m, float* a, float* b) { minmax_impl<1>(s, m, a, b); }
__global__ void minmax_bf16(const void* s, long long m, float* a, float* b) { minmax_impl<2>(s, m, a, b); }
__global__ void encode_f32(const void* s, long long m, const float* a, const float* b, u8* p, long long r) { encode_impl<0>(s, m, a, b, p, r); }
__global__ void encode_f16(const void* s, long long m, const float* a, const float* b, u8* p, long long r) { encode_impl<1>(s, m, a, b, p, r); }
__global__ void encode_bf16(const void* s, long long m, const float* a, const float* b, u8* p, long long r) { encode_impl<2>(s, m, a, b, p, r); }

__global__ void decode(const u8* payload, long long record, long long m, const float* mins,
                       const float* maxs, float* out) {
    long long c = blockIdx.y;
    float scale = scale_of(mins[c], maxs[c]);
    float lower = rintf(maxs[c] * scale) - 255.0f;
    const u8* codes = payload + c * record + 32;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < m;
         i += (long long)gridDim.x * blockDim.x) {
        out[c * m + i] = ((float)codes[i] + lower) / scale;
    }
}
}
"""

_NAMES = {0: "f32", 1: "f16", 2: "bf16"}
_THREADS = 256


@functools.cache
def _module(device: int):
    import cupy

    with cupy.cuda.Device(device):
        # --fmad=false: no product fused into an add (the CPU kernels' rounding).  No -std:
        # CuPy 14 picks C++17 (NVRTC 13's default dialect too); the source is plain C++11.
        return cupy.RawModule(code=_SOURCE, options=("--fmad=false",))


def _stream():
    import cupy

    return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)


def _ptr(t: torch.Tensor):
    import numpy as np

    return np.uint64(t.data_ptr())


def _grid(m):
    return min(max(1, -(-m // _THREADS)), 1024)


def minmax(flat: torch.Tensor, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk float32 min and max on the GPU (``-0`` canonicalised to ``+0``)."""
    import numpy as np

    m = flat.numel() // chunks
    mins = torch.empty(chunks, dtype=torch.float32, device=flat.device)
    maxs = torch.empty_like(mins)
    kind = _KINDS[flat.dtype]
    fn = _module(flat.device.index).get_function(f"minmax_{_NAMES[kind]}")
    with _stream():
        fn((chunks,), (_THREADS,), (_ptr(flat), np.int64(m), _ptr(mins),
                                    _ptr(maxs)))
    return mins, maxs


def compress(flat: torch.Tensor, chunks: int, payload: torch.Tensor | None = None):
    import numpy as np

    if chunks > 65535:
        raise ValueError(f"chunks must be <= 65535 for CUDA tensors, got {chunks}")
    m = flat.numel() // chunks
    rec = record_bytes(m)
    isz = flat.element_size()
    if payload is None:
        payload = torch.empty(chunks * rec, dtype=torch.uint8, device=flat.device)
    payload = payload.view(-1)
    mins, maxs = minmax(flat, chunks)
    kind = _KINDS[flat.dtype]
    fn = _module(flat.device.index).get_function(f"encode_{_NAMES[kind]}")
    with _stream():
        fn((_grid(m), chunks), (_THREADS,), (_ptr(flat), np.int64(m), _ptr(mins),
                                             _ptr(maxs), _ptr(payload),
                                             np.int64(rec)))
    rows = payload.view(chunks, rec)
    rows[:, :2 * isz] = header_bytes(mins, maxs, flat.dtype)
    rows[:, 2 * isz:HEADER_BYTES] = 0
    rows[:, HEADER_BYTES + m:] = 0
    return payload


def decompress(payload: torch.Tensor, out: torch.Tensor, chunks: int, dtype: torch.dtype):
    import numpy as np

    m = out.numel() // chunks
    rec = record_bytes(m)
    isz = torch.empty(0, dtype=dtype).element_size()
    header = payload.view(chunks, rec)[:, :2 * isz].contiguous().view(dtype).float()
    mins = header[:, 0].contiguous()
    maxs = header[:, 1].contiguous()
    target = out if out.dtype is torch.float32 else torch.empty(out.numel(),
                                                                dtype=torch.float32,
                                                                device=out.device)
    fn = _module(out.device.index).get_function("decode")
    with _stream():
        fn((_grid(m), chunks), (_THREADS,), (_ptr(payload), np.int64(rec), np.int64(m),
                                             _ptr(mins), _ptr(maxs),
                                             _ptr(target)))
    if target is not out:
        out.copy_(target)
