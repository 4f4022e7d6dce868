"""CUDA kernels of the MinMaxUInt8 and MinMaxUInt4 formats, through CuPy; bytes identical to
the Cython ones.

Same float32 arithmetic as ``_minmax.pyx``: 16-bit inputs are widened exactly (float16 by
decoding its bits, bfloat16 by a shift), rounding is ``rintf`` (half to even), the scale is an
IEEE division, and the kernels are compiled with ``--fmad=false`` (no product fused into an
add), ``--ftz=false`` and ``--prec-div=true``.

MinMaxUInt8: the kernels write the whole payload themselves, with no torch operation around
them.  Chunks of at most ``SMALL_M`` elements take one launch (a block a chunk: its min/max,
header, codes, padding); larger chunks two (the min/max of slices of at most ``_PART_ELEMS``
elements, spread over the GPU, into a buffer kept per stream; then every block folds its
chunk's slices and encodes, block 0 writing the header and padding).  A single launch for
large chunks would need a grid-wide barrier (a cooperative launch), which is not safe beside
NCCL's kernels.  Decoding reads the headers in the kernel and reduces several ranks' records
(``rows``) into one float32 output in the same launch (``compressed_allreduce``'s reduce).
MinMaxUInt4: min and max per chunk come from torch's ``aminmax``, codes from a grid over
(chunk, group of code bytes), headers and padding written with torch, exactly as on CPU.
Kernels run on CuPy's current stream (the caller sets it to torch's current stream).
A chunk holding a NaN or an infinity gets the header ``[NaN, NaN]`` and codes 0, as on CPU.
``tests/cuda_emu.py`` runs this source on the CPU (real threads per block) for the tests.
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

/* -- MinMaxUInt8, fused: a bucket's whole payload (min/max, headers, codes, padding) in one
   launch (chunks of at most SMALL_M elements: one block a chunk) or two (larger chunks: the
   min/max of slices first, spread over the GPU, then the encoding), and the decoding of
   several ranks' records reduced into one output in one launch.  Any blockDim that is a
   power of two <= 256 gives the same bytes (the reductions are of min, max and a flag). */
#define F_NAN __uint_as_float(0x7fc00000u)

__device__ __forceinline__ u16 f32_to_f16_exact(float v) {
    /* float16 bits of v, a float16 value widened exactly (a chunk's min or max) */
    u32 b = __float_as_uint(v);
    u32 sign = (b >> 16) & 0x8000u;
    if (v != v) return (u16)0x7E00u;
    if (v == 0.0f) return (u16)sign;
    int e = (int)((b >> 23) & 0xffu) - 127;
    if (e >= -14) return (u16)(sign | ((u32)(e + 15) << 10) | ((b >> 13) & 0x3ffu));
    return (u16)(sign | (u32)(fabsf(v) * 16777216.0f));      /* subnormal: m * 2^-24 */
}

__device__ __forceinline__ void put_header(u8* rec, float mn, float mx, int kind) {
    /* [min, max] in the input's type (canonical NaN), zeros to 32 bytes; rec is 4-aligned */
    u32 w0, w1 = 0;
    if (kind == 0) {
        w0 = __float_as_uint(mn);
        w1 = __float_as_uint(mx);
    } else if (kind == 2) {
        u32 a = mn != mn ? 0x7FC0u : (__float_as_uint(mn) >> 16);
        u32 b = mx != mx ? 0x7FC0u : (__float_as_uint(mx) >> 16);
        w0 = a | (b << 16);
    } else {
        w0 = (u32)f32_to_f16_exact(mn) | ((u32)f32_to_f16_exact(mx) << 16);
    }
    u32* h = (u32*)rec;
    h[0] = w0;
    h[1] = w1;
    for (int i = 2; i < 8; ++i) h[i] = 0u;
}

__device__ __forceinline__ void get_header(const u8* rec, int kind, float* mn, float* mx) {
    u32 w0 = *(const u32*)rec;
    if (kind == 0) {
        *mn = __uint_as_float(w0);
        *mx = __uint_as_float(*(const u32*)(rec + 4));
    } else if (kind == 2) {
        *mn = __uint_as_float((w0 & 0xffffu) << 16);
        *mx = __uint_as_float(w0 & 0xffff0000u);
    } else {
        *mn = f16_to_f32((u16)(w0 & 0xffffu));
        *mx = f16_to_f32((u16)(w0 >> 16));
    }
}

/* min, max and -0 -> +0 on the bits, never on float arithmetic: a GPU that flushes subnormals
   (FTZ/DAZ: NVRTC without --ftz=false, or a CuPy that drops the flag) would compare a subnormal
   as 0 and write 0 for it, where the CPU writes its bits.  The key orders floats as their
   values (-0 just below +0); NaN chunks never reach it (they are flagged apart). */
__device__ __forceinline__ u32 fkey(float v) {
    u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float fmin_bits(float a, float b) { return fkey(b) < fkey(a) ? b : a; }
__device__ __forceinline__ float fmax_bits(float a, float b) { return fkey(b) > fkey(a) ? b : a; }
__device__ __forceinline__ float plus_zero(float v) {
    return __float_as_uint(v) == 0x80000000u ? __uint_as_float(0u) : v;
}

/* min, max and "some value was NaN or infinite" of the block's values, in thread 0 and then
   broadcast: every thread returns the block's result */
__device__ void block_reduce(float a, float b, int bad, float* res) {
    __shared__ float sa[256];
    __shared__ float sb[256];
    __shared__ int sbad[256];
    unsigned t = threadIdx.x;
    sa[t] = a;
    sb[t] = b;
    sbad[t] = bad;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) {
            sa[t] = fmin_bits(sa[t], sa[t + s]);
            sb[t] = fmax_bits(sb[t], sb[t + s]);
            sbad[t] |= sbad[t + s];
        }
        __syncthreads();
    }
    res[0] = sa[0];
    res[1] = sb[0];
    res[2] = sbad[0] ? 1.0f : 0.0f;
    __syncthreads();                      /* the shared arrays are reused by a next call */
}

template <int KIND>
__device__ void slice_minmax(const void* src, long long lo, long long hi, float* res) {
    float a = __uint_as_float(0x7f800000u), b = -a, z = 0.0f;   /* +inf, -inf */
    for (long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = load<KIND>(src, i);
        a = fmin_bits(a, v);
        b = fmax_bits(b, v);
        z = z + v * 0.0f;                 /* NaN once a NaN or an infinity was seen */
    }
    block_reduce(a, b, z != z, res);
}

__device__ __forceinline__ void chunk_params(float mn, float mx, float* scale, float* upper,
                                             float* lower) {
    *scale = 255.0f / ((mx - mn) + 1e-7f);
    *upper = rintf(mx * *scale);
    *lower = *upper - 255.0f;
}

/* codes of chunk c (elements first..first+m) by the block's threads, groups of 4 bytes
   g0, g0 + step, ...; the zero padding after them by block x 0 */
template <int KIND>
__device__ void encode_chunk(const void* src, long long first, long long m, float mn, float mx,
                             u8* rec, long long record, long long g0, long long step,
                             bool pad) {
    float scale, upper, lower;
    chunk_params(mn, mx, &scale, &upper, &lower);
    bool bad = mn != mn;
    u8* out = rec + 32;
    long long groups = (m + 3) / 4;
    for (long long g = g0; g < groups; g += step) {
        u32 word = 0;
        long long e0 = g * 4;
        if (!bad) {
            for (int j = 0; j < 4 && e0 + j < m; ++j) {
                float q = rintf(load<KIND>(src, first + e0 + j) * scale);
                q = q < upper ? q : upper;
                q = q - lower;
                q = q > 0.0f ? q : 0.0f;
                q = q < 255.0f ? q : 255.0f;
                word |= ((u32)q) << (8 * j);
            }
        }
        long long nbytes = m - e0;
        if (nbytes >= 4) {
            *(u32*)(out + e0) = word;
        } else {
            for (int b = 0; b < nbytes; ++b) out[e0 + b] = (u8)(word >> (8 * b));
        }
    }
    if (pad)
        for (long long b = 32 + m + threadIdx.x; b < record; b += blockDim.x) rec[b] = 0;
}

/* one launch, grid (chunks): block c finds chunk c's min/max and writes its whole record */
template <int KIND>
__device__ void compress8_one(const void* src, long long m, u8* payload, long long record) {
    long long c = blockIdx.x;
    float res[3];
    slice_minmax<KIND>(src, c * m, c * m + m, res);
    float mn = res[2] != 0.0f ? F_NAN : plus_zero(res[0]);
    float mx = res[2] != 0.0f ? F_NAN : plus_zero(res[1]);
    u8* rec = payload + c * record;
    if (threadIdx.x == 0) put_header(rec, mn, mx, KIND);
    encode_chunk<KIND>(src, c * m, m, mn, mx, rec, record, threadIdx.x, blockDim.x, true);
}

/* first of two launches, grid (parts, chunks): block (p, c) writes the min and max of slice p
   of chunk c (NaN for both if the slice holds a NaN or an infinity) to part[2 (c parts + p)] */
template <int KIND>
__device__ void minmax8_part(const void* src, long long m, float* part) {
    long long c = blockIdx.y, p = blockIdx.x, parts = gridDim.x;
    long long span = (m + parts - 1) / parts;
    long long lo = p * span < m ? p * span : m;
    long long hi = lo + span < m ? lo + span : m;
    float res[3];
    slice_minmax<KIND>(src, c * m + lo, c * m + hi, res);
    if (threadIdx.x == 0) {
        part[2 * (c * parts + p)] = res[2] != 0.0f ? F_NAN : res[0];
        part[2 * (c * parts + p) + 1] = res[2] != 0.0f ? F_NAN : res[1];
    }
}

/* second launch, grid (x, chunks): every block folds its chunk's parts, then encodes; block
   x 0 writes the header and the padding */
template <int KIND>
__device__ void encode8_part(const void* src, long long m, const float* part, long long parts,
                             u8* payload, long long record) {
    long long c = blockIdx.y;
    float a = __uint_as_float(0x7f800000u), b = -a;
    int bad = 0;
    for (long long p = threadIdx.x; p < parts; p += blockDim.x) {
        float pa = part[2 * (c * parts + p)], pb = part[2 * (c * parts + p) + 1];
        bad |= pa != pa;
        a = fmin_bits(a, pa);
        b = fmax_bits(b, pb);
    }
    float res[3];
    block_reduce(a, b, bad, res);
    float mn = res[2] != 0.0f ? F_NAN : plus_zero(res[0]);
    float mx = res[2] != 0.0f ? F_NAN : plus_zero(res[1]);
    u8* rec = payload + c * record;
    if (blockIdx.x == 0 && threadIdx.x == 0) put_header(rec, mn, mx, KIND);
    encode_chunk<KIND>(src, c * m, m, mn, mx, rec, record,
                       (long long)blockIdx.x * blockDim.x + threadIdx.x,
                       (long long)gridDim.x * blockDim.x, blockIdx.x == 0);
}

/* grid (x, k): out[j m + e] = op over rows r of the decoding of record r k + j, element e;
   op 0 sum, 1 average (the sum divided by rows), 2 min, 3 max (a NaN wins); rows in order;
   op 4 (one row): out += the decoding */
__device__ void decode_reduce8_impl(const u8* payload, long long record, long long m,
                                    long long k, long long rows, int kind, float* out, int op) {
    long long j = blockIdx.y;
    long long groups = (m + 3) / 4;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < groups;
         g += (long long)gridDim.x * blockDim.x) {
        long long e0 = g * 4;
        long long nbytes = m - e0;
        int cnt = nbytes >= 4 ? 4 : (int)nbytes;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (long long r = 0; r < rows; ++r) {
            const u8* rec = payload + (r * k + j) * record;
            float mn, mx, scale, upper, lower;
            get_header(rec, kind, &mn, &mx);
            chunk_params(mn, mx, &scale, &upper, &lower);
            const u8* codes = rec + 32;
            u32 word = 0;
            if (cnt == 4) {
                word = *(const u32*)(codes + e0);
            } else {
                for (int b = 0; b < cnt; ++b) word |= ((u32)codes[e0 + b]) << (8 * b);
            }
            for (int i = 0; i < cnt; ++i) {
                float v = ((float)((word >> (8 * i)) & 0xffu) + lower) / scale;
                float a = acc[i];
                if (op == 4) a = out[j * m + e0 + i] + v;      /* out += decoding (one row) */
                else if (r == 0) a = v;
                else if (op <= 1) a = a + v;
                else if (op == 2) a = (v < a || v != v) ? v : a;
                else a = (v > a || v != v) ? v : a;
                acc[i] = a;
            }
        }
        for (int i = 0; i < cnt; ++i) {
            float a = acc[i];
            if (op == 1 && rows > 1) a = a / (float)rows;
            out[j * m + e0 + i] = a;
        }
    }
}

extern "C" {
__global__ void compress8_one_f32(const void* s, long long m, u8* p, long long r) { compress8_one<0>(s, m, p, r); }
__global__ void compress8_one_f16(const void* s, long long m, u8* p, long long r) { compress8_one<1>(s, m, p, r); }
__global__ void compress8_one_bf16(const void* s, long long m, u8* p, long long r) { compress8_one<2>(s, m, p, r); }
__global__ void minmax8_part_f32(const void* s, long long m, float* q) { minmax8_part<0>(s, m, q); }
__global__ void minmax8_part_f16(const void* s, long long m, float* q) { minmax8_part<1>(s, m, q); }
__global__ void minmax8_part_bf16(const void* s, long long m, float* q) { minmax8_part<2>(s, m, q); }
__global__ void encode8_part_f32(const void* s, long long m, const float* q, long long n, u8* p, long long r) { encode8_part<0>(s, m, q, n, p, r); }
__global__ void encode8_part_f16(const void* s, long long m, const float* q, long long n, u8* p, long long r) { encode8_part<1>(s, m, q, n, p, r); }
__global__ void encode8_part_bf16(const void* s, long long m, const float* q, long long n, u8* p, long long r) { encode8_part<2>(s, m, q, n, p, r); }
__global__ void decode_reduce8(const u8* p, long long r, long long m, long long k, long long rows, int kind, float* o, int op) { decode_reduce8_impl(p, r, m, k, rows, kind, o, op); }
}

extern "C" {
__global__ void encode4_f32(const void* s, long long m, const float* a, const float* b, u8* p, long long r) { encode_impl<0, 4>(s, m, a, b, p, r); }
__global__ void encode4_f16(const void* s, long long m, const float* a, const float* b, u8* p, long long r) { encode_impl<1, 4>(s, m, a, b, p, r); }
__global__ void encode4_bf16(const void* s, long long m, const float* a, const float* b, u8* p, long long r) { encode_impl<2, 4>(s, m, a, b, p, r); }
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


#: chunks of at most this many elements are compressed by one block each, in one launch;
#: larger ones in two (slices' min/max spread over the GPU, then the encoding)
SMALL_M = 1 << 16
#: elements a block of the min/max launch reads at least
_PART_ELEMS = 1 << 14
_PARTS: dict = {}


def _parts(device, stream, n: int) -> torch.Tensor:
    """The min/max launch's float32 output, one buffer per (device, stream), grown when
    needed and reused call after call (the stream orders its reuse)."""
    key = (device, stream)
    buf = _PARTS.get(key)
    if buf is None or buf.numel() < n:
        buf = _PARTS[key] = torch.empty(max(n, 1024), dtype=torch.float32, device=device)
    return buf


def compress(flat: torch.Tensor, chunks: int, payload: torch.Tensor | None = None,
             bits: int = 8):
    """The ``bits``-bit record layout (8: ``compression``; 4: ``_minmax4``) on the GPU."""
    if chunks > 65535:
        raise ValueError(f"chunks must be <= 65535 for CUDA tensors, got {chunks}")
    m = flat.numel() // chunks
    rec = record_bytes(m) if bits == 8 else record_bytes4(m)
    if payload is None:
        payload = torch.empty(chunks * rec, dtype=torch.uint8, device=flat.device)
    elif payload.dim() != 1:
        payload = payload.view(-1)
    if payload.data_ptr() % 4:            # the kernels store 4 code bytes at a time
        return payload.copy_(compress(flat, chunks, None, bits))
    if bits == 8:
        _compress8(flat, chunks, m, payload, rec)
        return payload
    import numpy as np

    isz = flat.element_size()
    mins, maxs = minmax(flat, chunks)
    kind = _KINDS[flat.dtype]
    fn = _module(flat.device.index).get_function(f"encode{bits}_{_NAMES[kind]}")
    with _stream():
        fn((_grid(m, bits), chunks), (_THREADS,), (_ptr(flat), np.int64(m), _ptr(mins),
                                                   _ptr(maxs), _ptr(payload), np.int64(rec)))
    rows = payload.view(chunks, rec)
    rows[:, :2 * isz] = header_bytes(mins, maxs, flat.dtype)
    rows[:, 2 * isz:HEADER_BYTES] = 0
    rows[:, HEADER_BYTES + m // 2:] = 0
    return payload


def _compress8(flat, chunks, m, payload, rec) -> None:
    """The whole 8-bit payload (min/max, headers, codes, padding) by the kernels alone: one
    launch for chunks of at most ``SMALL_M`` elements, else two; no torch operation."""
    import numpy as np

    mod = _module(flat.device.index)
    name = _NAMES[_KINDS[flat.dtype]]
    stream = _stream()
    with stream:
        if m <= SMALL_M:
            mod.get_function(f"compress8_one_{name}")(
                (chunks,), (_THREADS,), (_ptr(flat), np.int64(m), _ptr(payload), np.int64(rec)))
            return
        parts = min(-(-m // _PART_ELEMS), 1024)
        buf = _parts(flat.device, stream.ptr, 2 * parts * chunks)
        mod.get_function(f"minmax8_part_{name}")(
            (parts, chunks), (_THREADS,), (_ptr(flat), np.int64(m), _ptr(buf)))
        mod.get_function(f"encode8_part_{name}")(
            (_grid(m, 8), chunks), (_THREADS,), (_ptr(flat), np.int64(m), _ptr(buf),
                                                 np.int64(parts), _ptr(payload), np.int64(rec)))


def decompress(payload: torch.Tensor, out: torch.Tensor, chunks: int, dtype: torch.dtype,
               bits: int = 8, *, rows: int = 1, op: int = 0):
    """Decode ``payload`` into ``out``; 8 bits: ``rows`` payloads of ``chunks / rows`` records
    (concatenated) reduced into ``out`` by ``op`` (0 sum, 1 average, 2 min, 3 max) in the
    same launch, headers read by the kernel."""
    import numpy as np

    if payload.data_ptr() % 4:            # the kernels load 4 code bytes at a time
        payload = payload.clone()
    target = out if out.dtype is torch.float32 else torch.empty(out.numel(),
                                                                dtype=torch.float32,
                                                                device=out.device)
    if bits == 8:
        k = chunks // rows
        m = out.numel() // k
        rec = record_bytes(m)
        fn = _module(out.device.index).get_function("decode_reduce8")
        with _stream():
            fn((_grid(m, 8), k), (_THREADS,), (_ptr(payload), np.int64(rec), np.int64(m),
                                               np.int64(k), np.int64(rows),
                                               np.int32(_KINDS[dtype]), _ptr(target),
                                               np.int32(op)))
    else:
        if rows != 1:
            raise ValueError("the 4-bit decoder decodes one row")
        m = out.numel() // chunks
        rec = record_bytes4(m)
        isz = torch.empty(0, dtype=dtype).element_size()
        header = payload.view(chunks, rec)[:, :2 * isz].contiguous().view(dtype).float()
        mins = header[:, 0].contiguous()
        maxs = header[:, 1].contiguous()
        fn = _module(out.device.index).get_function("decode4")
        with _stream():
            fn((_grid(m, bits), chunks), (_THREADS,), (_ptr(payload), np.int64(rec),
                                                       np.int64(m), _ptr(mins), _ptr(maxs),
                                                       _ptr(target)))
    if target is not out:
        out.copy_(target)
