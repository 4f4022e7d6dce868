"""Host synchronisations in the steady-state step, counted on CPU on every thread (the
bucket hooks of TopK and LowRank run on bagua_comm's worker thread): each ``bool(tensor)``,
``tensor.item()`` or ``tensor.tolist()`` would make the host wait for the GPU on CUDA
tensors.  TopK's and LowRank's keep-the-state-unless-overflow decision is taken on the device
(``torch.where``), so their steps read nothing back.  (The GPU side:
``test_gpu_no_sync.py`` under ``torch.cuda.set_sync_debug_mode("error")``.)"""

import pytest
import torch
from _common import batch, loss_fn, make_model

from bagua_algos import LowRank, TopK, with_bagua
from bagua_comm.compression import MinMaxUInt8
from bagua_comm.testing import run_ranks

CASES = {
    "topk": lambda: TopK(density=0.1),
    "topk-dgc-8bit": lambda: TopK(density=0.1, momentum=0.9, compressor=MinMaxUInt8(2)),
    "low-rank": lambda: LowRank(rank=2, min_compression_rate=0),
}


def _count(name):
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped = with_bagua(model, [opt], CASES[name](), bucket_size=256)
    rank = torch.distributed.get_rank()

    def step(i):
        opt.zero_grad()
        loss_fn(wrapped, *batch(i, rank)).backward()
        opt.step()

    for i in range(3):
        step(i)
    reads = []
    originals = {k: getattr(torch.Tensor, k) for k in ("__bool__", "item", "tolist")}

    def counting(k):
        def read(self, *args, **kwargs):
            reads.append(k)
            return originals[k](self, *args, **kwargs)
        return read

    for k in originals:
        setattr(torch.Tensor, k, counting(k))
    try:
        step(3)
        step(4)
    finally:
        for k, v in originals.items():
            setattr(torch.Tensor, k, v)
    wrapped.detach_algorithm()
    return reads, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", list(CASES))
def test_steady_state_steps_read_no_tensor_value_on_the_host(name):
    r0, r1 = run_ranks(_count, 2, args=(name,), timeout=300)
    assert r0[0] == [] and r1[0] == [], (r0[0], r1[0])
    for a, b in zip(r0[1], r1[1]):
        assert torch.equal(a, b)


def test_all_finite_is_exact_where_the_fast_two_norm_overflows():
    """Reference: ``torch.isfinite`` of every element.  The 2-norm that decides the common case
    overflows float32 from |x| ~1e19 up: such gradients are finite all the same."""
    from bagua_algos._engine.overflow import all_finite

    g = torch.Generator().manual_seed(0)
    cases = [[torch.randn(1000, generator=g), torch.randn(7, 3, generator=g)],
             [torch.full((4,), 1e30), torch.randn(10, generator=g)],      # 2-norm is inf
             [torch.randn(10, generator=g), torch.tensor([1.0, float("inf")])],
             [torch.tensor([float("nan"), 0.0]), torch.full((3,), 1e30)],
             [torch.tensor([-float("inf")]), torch.zeros(0)],
             [torch.zeros(0)], []]
    for ts in cases:
        want = all(bool(torch.isfinite(t).all()) for t in ts)
        assert all_finite(ts) is want, ts
    assert not torch.isfinite(torch.linalg.vector_norm(torch.full((4,), 1e30))).item()
