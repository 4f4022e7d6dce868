"""The record format both min-max compressors share: constants, record sizes, headers, the
argument checks, and the numpy views the Cython kernels read.  The bottom of
``bagua_comm.compression``: it imports nothing of it.
"""

from __future__ import annotations

import numpy as np
import torch

HEADER_BYTES = 32
RECORD_ALIGN = 32

#: The input dtypes and their kernel numbering (CPU and CUDA kernels alike).
KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_CANONICAL_NAN = {torch.float32: (torch.int32, 0x7FC00000), torch.float16: (torch.int16, 0x7E00),
                  torch.bfloat16: (torch.int16, 0x7FC0)}
_f16_lut: np.ndarray | None = None
_NO_LUT = np.empty(0, dtype=np.float32)


def record_bytes(chunk_numel: int) -> int:
    """Bytes of one MinMaxUInt8 record holding ``chunk_numel`` codes."""
    return HEADER_BYTES + -(-chunk_numel // RECORD_ALIGN) * RECORD_ALIGN


def record_bytes4(chunk_numel: int) -> int:
    """Bytes of one MinMaxUInt4 record holding ``chunk_numel`` (even) codes."""
    return HEADER_BYTES + -(-(chunk_numel // 2) // RECORD_ALIGN) * RECORD_ALIGN


def header_bytes(mins: torch.Tensor, maxs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``[min, max]`` headers (float32 in) as ``dtype`` bytes, one row per chunk.

    A NaN (a non-finite chunk) is written as the dtype's canonical quiet NaN on every device
    (torch's own float-to-16-bit conversions of NaN differ between CPU and CUDA).
    """
    pair = torch.stack([mins, maxs], dim=1)
    bits_dtype, canonical = _CANONICAL_NAN[dtype]
    bits = pair.to(dtype).view(bits_dtype)
    # a Python scalar fill: no tensor made from host values (a blocking copy on CUDA)
    return bits.masked_fill(pair.isnan(), canonical).view(torch.uint8)


def write_headers(rows: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor,
                  dtype: torch.dtype, code_bytes: int) -> None:
    """Each record's header, and zeros in its padding after the header and after the
    ``code_bytes`` codes (``rows``: one record per chunk)."""
    isz = torch.empty(0, dtype=dtype).element_size()
    rows[:, :2 * isz] = header_bytes(mins, maxs, dtype)
    rows[:, 2 * isz:HEADER_BYTES] = 0
    rows[:, HEADER_BYTES + code_bytes:] = 0


def read_headers(payload: torch.Tensor, chunks: int, record: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The records' ``[min, max]`` headers (written in ``dtype``) as contiguous float32."""
    isz = torch.empty(0, dtype=dtype).element_size()
    header = payload.view(chunks, record)[:, :2 * isz].contiguous().view(dtype).float()
    return header[:, 0].contiguous(), header[:, 1].contiguous()


# -- argument checks --------------------------------------------------------------------------
def check_chunks(chunks) -> int:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    return chunks


def check_float(name: str, t, fmt: str) -> None:
    """``t`` is a contiguous tensor of a dtype the ``fmt`` compressor takes."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in KINDS:
        raise ValueError(f"{name} must be float32, float16 or bfloat16 for {fmt}, "
                         f"got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def check_dtype(dtype) -> None:
    if dtype not in KINDS:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")


def check_out(out, size: int, device) -> None:
    """``out`` (a caller's payload buffer) holds ``size`` contiguous bytes on ``device``."""
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8
            or out.numel() != size or not out.is_contiguous() or out.device != device):
        raise ValueError(f"out must be a contiguous uint8 tensor of {size} bytes on {device}")


def check_payload_fits(payload: torch.Tensor, out: torch.Tensor, chunks: int,
                       expected: int) -> None:
    if payload.numel() != expected:
        raise ValueError(f"payload has {payload.numel()} bytes, but {out.numel()} elements "
                         f"in {chunks} chunks need {expected}")
    if payload.device != out.device:
        raise ValueError(f"payload is on {payload.device} but out is on {out.device}")


# -- numpy views for the Cython kernels -------------------------------------------------------
def lut(dtype):
    """float16's 65536 values as float32 (the CPU kernels widen through it)."""
    global _f16_lut
    if dtype is not torch.float16:
        return _NO_LUT
    if _f16_lut is None:
        _f16_lut = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16) \
            .astype(np.float32)
    return _f16_lut


def as_numpy(flat):
    if flat.dtype is torch.float32:
        return flat.numpy()
    return flat.view(torch.int16).numpy().view(np.uint16)
