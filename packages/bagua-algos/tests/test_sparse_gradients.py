"""GradientAllReduce averages sparse gradients (``Embedding(sparse=True)``) as DDP does.

Two ranks train the same model with DDP and with ``with_bagua(..., GradientAllReduce())`` on
the same batches, each rank its own tokens (different rows, repeated tokens, so each rank's
gradient holds a different number of rows): the parameters must match DDP's after every step,
the embedding's gradient must stay sparse, and every rank must hold the same model.  Also
under ``no_sync()`` accumulation, with SparseAdam on the embedding beside Adam on the rest,
and with an embedding only one rank uses in a step (DDP raises there; the reference is the
single-process computation of the mean of both ranks' losses).
"""

from __future__ import annotations

import pytest
import torch

import bagua_comm as bc
from bagua_algos import GradientAllReduce, with_bagua
from bagua_algos._engine.sparse import allreduce_sparse
from bagua_comm.testing import run_ranks


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(50, 8, sparse=True)
        self.bag = torch.nn.EmbeddingBag(30, 8, mode="sum", sparse=True)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, i, use_bag=True):
        h = self.tok(i).mean(1)
        if use_bag:
            h = h + self.bag(i % 30)
        return self.head(h).squeeze(1)


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    n = 3 + 2 * rank                  # a different number of rows on each rank
    tokens = torch.randint(0, 50, (n, 4), generator=g)
    tokens[0, :2] = 7                 # a repeated token: duplicate rows in one gradient
    return tokens, torch.randn(n, generator=g)


def _optimizers(model, kind):
    if kind == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=0.1)]
    sparse = [model.tok.weight, model.bag.weight]
    dense = [p for p in model.parameters() if all(p is not q for q in sparse)]
    return [torch.optim.SparseAdam(sparse, lr=0.01), torch.optim.Adam(dense, lr=0.01)]


def _single_process(kind, skip_bag_on_rank1):
    """The reference where DDP has none (it raises "Expected sparse gradient to be defined"
    for a sparse weight one rank leaves unused): one process, the mean of both ranks' losses,
    which has the average of their gradients."""
    model = _Model()
    opts = _optimizers(model, kind)
    traj = []
    for step in range(4):
        for o in opts:
            o.zero_grad()
        for r in (0, 1):
            x, y = _batch(step, r)
            use_bag = not (skip_bag_on_rank1 and r == 1 and step % 2)
            (((model(x, use_bag) - y) ** 2).mean() / 2).backward()
        for o in opts:
            o.step()
        traj.append([p.detach().clone() for p in model.parameters()])
    return traj, True


def _train(kind, accumulate, skip_bag_on_rank1, hierarchical=False):
    from torch.nn.parallel import DistributedDataParallel

    rank = bc.get_rank()
    runs = {}
    if skip_bag_on_rank1:
        runs["ddp"] = _single_process(kind, skip_bag_on_rank1)
    for name in ("ddp", "bagua"):
        if name in runs:
            continue
        model = _Model()
        opts = _optimizers(model, kind)
        if name == "ddp":
            net = DistributedDataParallel(model)
        else:
            net = with_bagua(model, opts, GradientAllReduce(hierarchical=hierarchical))
        traj, sparse_grads = [], True
        for step in range(4):
            for o in opts:
                o.zero_grad()
            use_bag = not (skip_bag_on_rank1 and rank == 1 and step % 2)
            if accumulate:
                with net.no_sync():
                    x, y = _batch(100 + step, rank)
                    ((net(x, use_bag) - y) ** 2).mean().backward()
            x, y = _batch(step, rank)
            ((net(x, use_bag) - y) ** 2).mean().backward()
            sparse_grads &= model.tok.weight.grad.is_sparse
            for o in opts:
                o.step()
            traj.append([p.detach().clone() for p in model.parameters()])
        runs[name] = (traj, sparse_grads)
    ddp, ours = runs["ddp"][0], runs["bagua"][0]
    worst = max((a - b).abs().max().item() for sa, sb in zip(ddp, ours)
                for a, b in zip(sa, sb))
    return worst, runs["bagua"][1], torch.cat([p.flatten() for p in ours[-1]])


@pytest.mark.parametrize("kind,accumulate,skip,hier", [
    ("sgd", False, False, False), ("sgd", True, False, False),
    ("sparse_adam", False, False, False), ("sgd", False, True, False),
    ("sgd", False, False, True)],
    ids=["sgd", "no_sync-accumulation", "sparse_adam+adam", "bag-unused-on-one-rank",
         "hierarchical-two-nodes"])
def test_sparse_gradients_are_averaged_as_ddp(kind, accumulate, skip, hier):
    results = run_ranks(_train, 2, args=(kind, accumulate, skip, hier), timeout=180,
                        local_world_size=1 if hier else None)
    # DDP: the same operations, within 1e-6 (measured 0); the single-process reference scales
    # each loss by 1/2 before backward instead of averaging after it: a few ulps (2.4e-6)
    tolerance = 1e-5 if skip else 1e-6
    for worst, sparse, _ in results:
        assert worst <= tolerance, worst
        assert sparse
    assert torch.equal(results[0][2], results[1][2])


def _unfrozen_later():
    """The embedding frozen at with_bagua, unfrozen before step 2: it joins the sparse
    exchange, not the dense buckets."""
    rank = bc.get_rank()
    model = _Model()
    model.tok.weight.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    net = with_bagua(model, [opt], GradientAllReduce())
    sparse = []
    for step in range(4):
        if step == 2:
            model.tok.weight.requires_grad_(True)
        opt.zero_grad()
        x, y = _batch(step, rank)
        ((net(x) - y) ** 2).mean().backward()
        if step >= 2:
            sparse.append(model.tok.weight.grad.is_sparse)
            g = model.tok.weight.grad.to_dense()
            both = torch.empty(2 * g.numel())
            bc.allgather(g.flatten(), both)
            sparse.append(torch.equal(both[:g.numel()], both[g.numel():]))
        opt.step()
    return sparse, torch.cat([p.detach().flatten() for p in model.parameters()])


def test_an_embedding_unfrozen_after_wrapping_is_averaged_sparsely():
    results = run_ranks(_unfrozen_later, 2, timeout=120)
    for checks, _ in results:
        assert checks == [True] * 4
    assert torch.equal(results[0][1], results[1][1])


class _Tied(torch.nn.Module):
    """The sparse embedding's weight also used densely (an output layer tied to it): its
    gradient accumulates dense."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(50, 8, sparse=True)

    def forward(self, i):
        return self.tok(i).mean(1) @ self.tok.weight.t()


def _tied(wrapped):
    rank = bc.get_rank() if wrapped else None
    model = _Tied()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)     # a dense optimizer
    net = with_bagua(model, [opt], GradientAllReduce()) if wrapped else model
    for step in range(3):
        opt.zero_grad()
        for r in ((rank,) if wrapped else (0, 1)):           # reference: both ranks' losses
            x, _ = _batch(step, r)
            loss = net(x).logsumexp(1).mean()
            (loss if wrapped else loss / 2).backward()
        opt.step()
    return model.tok.weight.detach().clone()


def test_a_tied_sparse_weight_with_a_dense_gradient_stays_dense():
    ours = run_ranks(_tied, 2, args=(True,), timeout=120)
    ref = _tied(False)
    assert torch.equal(ours[0], ours[1])
    assert torch.allclose(ours[0], ref, atol=1e-5), (ours[0] - ref).abs().max()


def _reduce_cases():
    rank, n = bc.get_rank(), bc.get_world_size()
    param = torch.zeros(10, 3)
    out = []
    # every rank, different rows (rank r: rows r, r+1, r+1); one rank none; no rank any
    g = torch.sparse_coo_tensor(torch.tensor([[rank, rank + 1, rank + 1]]),
                                torch.arange(9.0).view(3, 3) + rank, (10, 3),
                                check_invariants=True)
    out.append(allreduce_sparse(g, param, bc.new_group(list(range(n)))).to_dense())
    out.append(allreduce_sparse(g if rank == 0 else None, param,
                                bc.new_group(list(range(n))), average=False).to_dense())
    out.append(allreduce_sparse(None, param, bc.new_group(list(range(n)))))
    return out


def test_allreduce_sparse_against_the_dense_sum():
    results = run_ranks(_reduce_cases, 3, timeout=120)
    dense = [torch.sparse_coo_tensor(torch.tensor([[r, r + 1, r + 1]]),
                                     torch.arange(9.0).view(3, 3) + r, (10, 3),
                                     check_invariants=True).to_dense()
             for r in range(3)]
    for got in results:
        assert torch.allclose(got[0], sum(dense) / 3, atol=1e-6)
        assert torch.equal(got[1], dense[0])
        assert got[2] is None
