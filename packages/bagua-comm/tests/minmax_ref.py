"""An independent numpy implementation of the MinMaxUInt8 format (as the package README
and the MinMaxUInt8 docstring describe it: records of [min, max] header and uint8 codes).

Written from the formula alone, element by element in float32 numpy scalars/arrays, so that
the Cython and CuPy kernels can be compared with it byte for byte.
"""

import numpy as np

F = np.float32


def _header(mn, mx, dtype):
    pair = np.array([mn, mx], dtype=np.float32)
    if dtype == "bfloat16":  # exact for values that came from bfloat16: keep the top half
        raw = (pair.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        raw = pair.astype(dtype).tobytes()
    return raw + bytes(32 - len(raw))


def record_len(m):
    return 32 + (m + 31) // 32 * 32


def params(mn, mx):
    scale = F(255) / (mx - mn + F(1e-7))
    upper = np.rint(mx * scale)
    return scale, upper, upper - F(255)


def compress(x32, dtype, chunks):
    """x32: float32 values (already representable in ``dtype``); dtype: numpy name."""
    x32 = np.asarray(x32, dtype=np.float32)
    m = x32.size // chunks
    out = bytearray()
    for c in range(chunks):
        seg = x32[c * m:(c + 1) * m]
        if not np.isfinite(seg).all():  # NaN or inf: a NaN header, codes 0
            nan = np.array([0x7FC00000], dtype=np.uint32).view(np.float32)[0]
            mn = mx = nan
            codes = bytes(m)
        else:
            mn, mx = seg.min() + F(0), seg.max() + F(0)  # + 0 turns -0 into +0
            scale, upper, lower = params(mn, mx)
            q = np.minimum(np.rint(seg * scale), upper) - lower
            codes = np.clip(q, 0, 255).astype(np.uint8).tobytes()
        rec = _header(mn, mx, dtype) + codes
        out += rec + bytes(record_len(m) - len(rec))
    return np.frombuffer(bytes(out), dtype=np.uint8)


def decompress(payload, dtype, numel, chunks):
    """float32 decoded values of a payload whose headers are in ``dtype``."""
    m = numel // chunks
    rec = record_len(m)
    out = np.empty(numel, dtype=np.float32)
    for c in range(chunks):
        r = payload[c * rec:(c + 1) * rec]
        if dtype == "bfloat16":
            mn, mx = (r[:4].view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            mn, mx = r[:2 * np.dtype(dtype).itemsize].view(dtype).astype(np.float32)
        with np.errstate(invalid="ignore"):
            scale, _, lower = params(mn, mx)
        out[c * m:(c + 1) * m] = (r[32:32 + m].astype(np.float32) + lower) / scale
    return out
