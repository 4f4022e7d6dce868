"""TopK's compiled exchange (``_hot.TopKRound``): its buffers, views and launcher, made once
per layout, so that a steady-state step runs each bucket's exchange as one job on the group's
worker thread, with no Python frame and no per-parameter Python loop.

Taken where the Python path (``TopKImpl.exchange``) would run flat, float32, on gloo CPU,
without compressor or momentum; every rank decides the same way (from the configuration and
the layout), so all ranks take the same path.  The selection runs once per group of
equal-size parameters (a batched ``topk`` over the rows of a strided view), which picks the
same entries as one ``topk`` per parameter; indices and values travel in a fixed order that
every rank shares, and the sum adds every rank's entries in rank order, as the Python path
does, so the result is bit for bit that path's.
"""

from __future__ import annotations

import itertools

import torch

from .._engine import _hot


def eligible(impl, buckets) -> bool:
    """Whether ``impl`` (a TopKImpl) runs the compiled exchange for ``buckets``."""
    if (impl.compressor is not None or impl.momentum or impl.reducer.hierarchical
            or impl.group.size < 2 or not buckets):
        return False
    for b in buckets:
        if (b.dtype != torch.float32 or b.device.type != "cpu" or not b.numel
                or b.padded_numel + len(b.params) >= 2 ** 31):
            return False
    be = impl.group.backend_for(buckets[0].grad)
    return getattr(be, "name", None) == "gloo" and getattr(be, "aux", None) is not None


def _groups(slots, mag, sent_idx):
    """Per ``(n, k)`` of the slots that send fewer than all their entries: the rows of
    ``|corrected|`` (a strided view when the slots are evenly spaced, else a ``take`` index),
    ``k``, the slots' offsets (to add to the row-local indices) and their rows of
    ``sent_idx``; slots sending all entries get their indices written once, here."""
    by_shape: dict[tuple[int, int], list[int]] = {}
    pos = 0
    for off, n, k in slots:
        if k == n:
            torch.arange(off, off + n, out=sent_idx[pos:pos + k])
            pos += k
        else:
            by_shape.setdefault((n, k), []).append(off)
    groups = []
    for (n, k), offs in by_shape.items():
        c = len(offs)
        step = offs[1] - offs[0] if c > 1 else n
        even = step >= n and all(b - a == step for a, b in itertools.pairwise(offs))
        rows = take = None
        if even:
            rows = mag.as_strided((c, n), (step, 1), offs[0])
        else:
            take = (torch.tensor(offs, dtype=torch.int64).unsqueeze(1)
                    + torch.arange(n, dtype=torch.int64)).to(mag.device)
        offsets = torch.tensor(offs, dtype=torch.int64, device=mag.device).unsqueeze(1)
        groups.append((rows, take, k, offsets, sent_idx[pos:pos + c * k].view(c, k)))
        pos += c * k
    return groups


def launchers(impl, buckets) -> list:
    """Per bucket, the compiled launcher of its exchange (``_hot.WorkerLauncher``)."""
    g = impl.group
    n = g.size
    be = g.backend_for(buckets[0].grad)
    worker = be.worker()
    most = max(b.padded_numel for b in buckets)
    dev = buckets[0].device
    # one working set for every bucket: the worker runs their jobs one after another
    nxt_all = torch.empty(most, dtype=torch.float32, device=dev)
    mag_all = torch.empty(most, dtype=torch.float32, device=dev)
    out = []
    for i, b in enumerate(buckets):
        slots = impl.slots[i]
        k = sum(s[2] for s in slots)
        flags = b.flags if b.flags is not None and impl.carries_unused_flags(None) else None
        f = 0 if flags is None else flags.numel()
        index_dtype = torch.int32
        sent_idx = torch.empty(k + f, dtype=index_dtype, device=dev)
        nxt, mag = nxt_all[:b.padded_numel], mag_all[:b.padded_numel]
        groups = _groups(slots, mag, sent_idx)
        values = torch.empty(k + f, dtype=torch.float32, device=dev)
        full = b.grad_and_flags if f else b.grad
        if f:       # the flags land past the gradients, summed over the ranks
            torch.arange(b.padded_numel, b.padded_numel + f, out=sent_idx[k:])
        job = _hot.TopKRound(
            b.grad, full, b.grad[:b.numel], impl.residuals[i], nxt, mag, groups, sent_idx,
            sent_idx[:k], values, values[:k], flags, values[k:] if f else None,
            torch.empty(n * (k + f), dtype=index_dtype, device=dev),
            torch.empty(n * (k + f), dtype=torch.float32, device=dev),
            be.aux._allgather_base, n, impl.op_average)
        nbytes = (sent_idx.numel() * sent_idx.element_size() + values.numel() * 4) * (n - 1)
        out.append(_hot.WorkerLauncher(worker, job, nbytes, "allgather"))
    return out
