"""Averaging sparse gradients (``torch.nn.Embedding(sparse=True)``) over a group.

A sparse gradient holds only the rows a rank's batch touched, a different number on every
rank, so it cannot ride in a dense bucket.  Each rank coalesces its own, the ranks exchange
their row counts, then their (padded) indices and values by two allgathers, and every rank
sums all of them in rank order, so the result is the same on every rank; averaging divides each rank's gradient
by the world size first, as DDP.  Written on
``bagua_comm.allgather`` rather than torch's sparse allreduce, which gloo has and NCCL lacks:
one code path for both backends.
"""

from __future__ import annotations

import torch

import bagua_comm as bc


def allreduce_sparse(grad: torch.Tensor | None, param: torch.Tensor, group: bc.ProcessGroup,
                     average: bool = True) -> torch.Tensor | None:
    """The sum (``average``: the mean) over ``group`` of every rank's sparse ``grad`` of
    ``param``, as a coalesced sparse tensor (dense if ``grad`` came dense).  A rank whose ``grad`` is None counts as zero;
    None when no rank has a gradient.  Collective: every rank calls it for the same ``param``
    in the same order."""
    n = group.size
    dev = param.device
    dense_dims = tuple(param.shape[1:])
    # a weight also used densely (tied to an output layer) accumulates a dense gradient:
    # exchanged as its rows, handed back dense, as it came
    dense_in = grad is not None and not grad.is_sparse
    if grad is not None:
        # as DDP: each rank's gradient is divided by the world size before the sum (then
        # coalesced, as gloo's sparse allreduce coalesces its input)
        g = grad.to_sparse(1) if dense_in else grad
        g = (g / n if average else g).coalesce()
        idx, vals = g.indices()[0], g.values()
    else:
        idx = torch.empty(0, dtype=torch.int64, device=dev)
        vals = torch.empty((0, *dense_dims), dtype=param.dtype, device=dev)
    counts = torch.empty(n, dtype=torch.int64, device=dev)
    bc.allgather(torch.tensor([idx.numel()], dtype=torch.int64, device=dev), counts,
                 group=group)
    counts = counts.tolist()
    most = max(counts)
    if most == 0:
        return None if grad is None else (g.to_dense() if dense_in else g)
    row = 1
    for d in dense_dims:
        row *= d
    send_idx = torch.zeros(most, dtype=torch.int64, device=dev)
    send_idx[:idx.numel()] = idx
    send_vals = torch.zeros(most * row, dtype=vals.dtype, device=dev)
    send_vals[:vals.numel()] = vals.reshape(-1)
    all_idx = torch.empty(n * most, dtype=torch.int64, device=dev)
    all_vals = torch.empty(n * most * row, dtype=vals.dtype, device=dev)
    bc.allgather(send_idx, all_idx, group=group)
    bc.allgather(send_vals, all_vals, group=group)
    all_idx, all_vals = all_idx.view(n, most), all_vals.view(n, most, *dense_dims)
    # the sum in rank order, as gloo's sparse allreduce (DDP's) adds the ranks' parts
    out = None
    for r, c in enumerate(counts):
        part = torch.sparse_coo_tensor(all_idx[r, :c].unsqueeze(0), all_vals[r, :c],
                                       param.shape, check_invariants=True)
        out = part if out is None else out.add_(part)
    out = out.coalesce()
    return out.to_dense() if dense_in else out


def sparse_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable weights of ``module``'s ``Embedding``/``EmbeddingBag(sparse=True)``
    layers, once each, in registration order (the same on every rank)."""
    out: dict[int, torch.nn.Parameter] = {}
    for m in module.modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse \
                and m.weight.requires_grad:
            out.setdefault(id(m.weight), m.weight)
    return list(out.values())
