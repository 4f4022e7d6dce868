"""Compressors: the MinMaxUInt8 format of ByteGrad (byte-compatible with Bagua), and
:class:`MinMaxUInt4`, the same min-max rule at 4 bits (see ``_minmax4``).

A compressor turns a flat float tensor into a ``uint8`` payload and back::

    c = MinMaxUInt8(chunks=4)
    payload = c.compress(x)                 # uint8 tensor, c.payload_numel(x.numel()) bytes
    c.decompress(payload, out)              # out: same dtype and numel as x
    payload, ctx = c.pack(x)                # compress with a context ...
    y = c.unpack(payload, ctx)              # ... that knows dtype, shape and device

Format.  The tensor is split into ``chunks`` equal chunks.  Per chunk,
with ``eps = 1e-7`` and every operation in float32::

    scale = 255 / (max - min + eps)
    upper = rint(max * scale);  lower = upper - 255
    q     = uint8(min(rint(x * scale), upper) - lower)      # saturating; rint: half to even
    x'    = (q + lower) / scale                              # decoding

Each chunk is one record: ``[min, max]`` in the tensor's own dtype, zero-padded to 32 bytes,
then the chunk's codes, zero-padded so the record is a multiple of 32 bytes.  ``-0`` is
written as ``+0``.

Non-finite input never comes out finite: a chunk holding a NaN or an infinity (of either
sign) is written as the header ``[NaN, NaN]`` with all codes 0, and decodes to NaN in every
element of the chunk (CPU and CUDA kernels alike).  Through :func:`bagua_comm.
compressed_allreduce` that NaN reaches every rank, so ``torch.isfinite`` checks and
``GradScaler`` see the overflow; the chunk's other elements are lost for that call.  Input
without NaN/inf is encoded exactly as the formula says.

Error feedback (``error_feedback=True``, or :class:`ErrorFeedback` around any compressor)
keeps, per ``key``, the residual ``x - x'`` of the last compression and adds it to the next
input before compressing it (EF-SGD), so that the quantisation error is not lost but delayed (a non-finite chunk's residual is reset to 0, so
one overflowing step does not poison the next ones).  The residuals are the compressor's state:
:meth:`~Compressor.state_dict` / :meth:`~Compressor.load_state_dict` checkpoint them.

Layout: ``_format`` (record sizes, headers, checks), ``_base`` (:class:`Compressor`),
``_error_feedback`` (:class:`ErrorFeedback`), ``_minmax8`` and ``_minmax4`` (the two formats),
``_minmax_cupy`` (their CUDA kernels); import from here, not from those modules.
"""

from ._base import Compressor, Context
from ._error_feedback import ErrorFeedback
from ._format import HEADER_BYTES, RECORD_ALIGN, header_bytes, record_bytes, record_bytes4
from ._minmax4 import MinMaxUInt4
from ._minmax8 import MinMaxUInt8

__all__ = ["HEADER_BYTES", "RECORD_ALIGN", "Compressor", "Context", "ErrorFeedback",
           "MinMaxUInt4", "MinMaxUInt8", "header_bytes", "record_bytes", "record_bytes4"]
