"""Algorithm state keyed by what it describes: parameter names, not bucket indices.

Algorithms keep their per-element state (residuals, replicas, momenta, pending averages) in
flat per-bucket buffers laid out like the bucket, because that is what they communicate.
Checkpoints and :meth:`~bagua_algos.BaguaModule.rebucket` go through these helpers instead,
which cut a buffer into one flat tensor per parameter (by the bucket's offsets) and pour it
back into any other layout.  State saved with one bucket size therefore loads under another.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .bucket import BaguaBucket


def export_flat(buckets: Sequence[BaguaBucket], buffers: Sequence[torch.Tensor | None], *,
                clone: bool = True, start: Sequence[int] | None = None
                ) -> dict[str, torch.Tensor]:
    """``{param name: flat tensor}`` from per-bucket buffers laid out like the buckets.

    ``buffers[i]`` may be None (no state for bucket ``i``) or shorter than the bucket when it
    covers only ``[start[i], start[i] + len)`` of the bucket's elements (e.g. the segment of a
    compressed allreduce this rank reduces): parameters partly covered get zeros elsewhere,
    parameters not covered are left out.
    """
    out: dict[str, torch.Tensor] = {}
    for i, (b, buf) in enumerate(zip(buckets, buffers)):
        if buf is None:
            continue
        buf = buf.detach().reshape(-1)
        lo = 0 if start is None else start[i]
        hi = lo + buf.numel()
        for name, p, off in zip(b.names, b.params, b.offsets):
            n = p.numel()
            a, z = max(off, lo), min(off + n, hi)
            if a >= z:
                continue
            if a == off and z == off + n:
                piece = buf[a - lo:z - lo]
                out[name] = piece.clone() if clone else piece
            else:
                piece = buf.new_zeros(n)
                piece[a - off:z - off] = buf[a - lo:z - lo]
                out[name] = piece
    return out


def import_flat(buckets: Sequence[BaguaBucket], buffers: Sequence[torch.Tensor],
                state: dict[str, torch.Tensor], what: str, *,
                start: Sequence[int] | None = None) -> int:
    """Copy ``state`` (from :func:`export_flat`) into per-bucket ``buffers``; parameters
    missing from ``state`` keep the buffer's values.  Returns how many were found.

    A tensor whose size does not match its parameter raises ``ValueError`` (a checkpoint of
    another model)."""
    found = 0
    for i, (b, buf) in enumerate(zip(buckets, buffers)):
        buf = buf.detach().reshape(-1)
        lo = 0 if start is None else start[i]
        hi = lo + buf.numel()
        for name, p, off in zip(b.names, b.params, b.offsets):
            t = state.get(name)
            if t is None:
                continue
            n = p.numel()
            if t.numel() != n:
                raise ValueError(f"{what}: the state of parameter {name!r} has {t.numel()} "
                                 f"elements but the parameter has {n}; load a checkpoint of "
                                 "the same model")
            found += 1
            a, z = max(off, lo), min(off + n, hi)
            if a < z:
                with torch.no_grad():
                    buf[a - lo:z - lo].copy_(t.reshape(-1)[a - off:z - off])
    return found
