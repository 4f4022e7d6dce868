"""Runs ``_minmax_cupy``'s CUDA source on the CPU: compiled by the host C++ compiler with CUDA's
keywords defined away, each block's threads as real threads (``__syncthreads`` a barrier,
``__shared__`` arrays shared by them), blocks one after another.  No GPU and no CuPy needed:
the kernels' own text, launch geometry and glue are checked against the Cython bytes.

``kernels()`` returns a stand-in for ``_module(device)`` (``get_function(name)(grid, block,
args)``), or None when no C++20 compiler is found.  Kernels read and write host memory, so
pointers of CPU tensors do.
"""

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile

_SHIM = r"""
#include <barrier>
#include <math.h>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#if defined(__x86_64__) || defined(__SSE__)
#include <xmmintrin.h>
#define EMU_FTZ() _mm_setcsr(_mm_getcsr() | 0x8040)   /* FTZ | DAZ */
#else
#define EMU_FTZ() (void)0
#endif
struct Dim3 { unsigned x, y, z; };
static Dim3 blockIdx, blockDim, gridDim;
static thread_local Dim3 threadIdx;
static std::barrier<>* g_bar;
static int g_ftz;                     /* flush subnormals, as a GPU without --ftz=false */
#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads() g_bar->arrive_and_wait()
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
"""

_DRIVER = r"""
template <class F> static void launch(unsigned gx, unsigned gy, unsigned bx, F f) {
    gridDim = {gx, gy, 1};
    blockDim = {bx, 1, 1};
    for (unsigned y = 0; y < gy; ++y)
        for (unsigned x = 0; x < gx; ++x) {
            blockIdx = {x, y, 0};
            std::barrier<> bar(bx);
            g_bar = &bar;
            std::vector<std::thread> ts;
            for (unsigned t = 0; t < bx; ++t)
                ts.emplace_back([&, t] {
                    if (g_ftz) EMU_FTZ();
                    threadIdx = {t, 0, 0};
                    f();
                });
            for (auto& t : ts) t.join();
        }
}
extern "C" int emu_flush_subnormals(int on) {
#if defined(__x86_64__) || defined(__SSE__)
    g_ftz = on;
    return 1;
#else
    return on ? 0 : 1;
#endif
}
#define P(i) ((void*)a[i])
extern "C" int emu_launch(const char* name, unsigned gx, unsigned gy, unsigned bx,
                          const long long* a) {
    std::string n(name);
#define K4(N, T) if (n == #N) { launch(gx, gy, bx, [&] { N((const void*)a[0], a[1], (u8*)a[2], a[3]); }); return 0; }
    K4(compress8_one_f32, 0) K4(compress8_one_f16, 0) K4(compress8_one_bf16, 0)
#define KP(N) if (n == #N) { launch(gx, gy, bx, [&] { N((const void*)a[0], a[1], (float*)a[2]); }); return 0; }
    KP(minmax8_part_f32) KP(minmax8_part_f16) KP(minmax8_part_bf16)
#define KE(N) if (n == #N) { launch(gx, gy, bx, [&] { N((const void*)a[0], a[1], (const float*)a[2], a[3], (u8*)a[4], a[5]); }); return 0; }
    KE(encode8_part_f32) KE(encode8_part_f16) KE(encode8_part_bf16)
    if (n == "decode_reduce8") {
        launch(gx, gy, bx, [&] { decode_reduce8((const u8*)a[0], a[1], a[2], a[3], a[4],
                                                (int)a[5], (float*)a[6], (int)a[7]); });
        return 0;
    }
    return 1;
}
"""


@functools.cache
def _library():
    from bagua_comm.compression import _minmax_cupy

    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        return None
    tmp = tempfile.mkdtemp(prefix="bagua-cuda-emu-")
    src = os.path.join(tmp, "emu.cpp")
    with open(src, "w") as f:
        f.write(_SHIM + _minmax_cupy._SOURCE + _DRIVER)
    lib = os.path.join(tmp, "emu.so")
    # the kernels' float rules: no contraction into FMAs, IEEE division, no fast math
    done = subprocess.run([cxx, "-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared",
                           "-pthread", src, "-o", lib], capture_output=True, text=True)
    if done.returncode:
        if "barrier" in done.stderr and "No such file" in done.stderr:
            return None                       # no C++20 library
        raise RuntimeError(f"the CUDA source does not compile as C++:\n{done.stderr[-4000:]}")
    so = ctypes.CDLL(lib)
    so.emu_launch.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                              ctypes.POINTER(ctypes.c_longlong)]
    return so


class _Function:
    def __init__(self, so, name, block):
        self.so, self.name, self.block = so, name, block
        self.launches = []

    def __call__(self, grid, block, args):
        grid = tuple(grid) + (1,) * (2 - len(grid))
        assert block == (256,), block                  # what the glue asks for
        vals = (ctypes.c_longlong * len(args))(*[int(a) for a in args])
        if self.so.emu_launch(self.name.encode(), grid[0], grid[1], self.block, vals):
            raise KeyError(f"no emulated kernel {self.name}")
        self.launches.append(grid)


class Module:
    """``get_function`` as CuPy's RawModule; ``block``: threads a block really runs (the
    kernels are written for any power of two up to 256)."""

    def __init__(self, so, block=8):
        self.so, self.block = so, block
        self.calls = []

    def get_function(self, name):
        fn = _Function(self.so, name, self.block)
        self.calls.append((name, fn))
        return fn


def kernels(block=8):
    so = _library()
    return None if so is None else Module(so, block)


def flush_subnormals(on: bool) -> None:
    """Run the next launches as a GPU that flushes subnormals (FTZ and DAZ on every thread):
    what the kernels meet where NVRTC ignores ``--ftz=false``."""
    so = _library()
    if not so.emu_flush_subnormals(int(on)):
        raise NotImplementedError("flushing subnormals is emulated on x86-64 (SSE) only")
