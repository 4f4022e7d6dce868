"""Host work of one GradientAllReduce step against torch DDP's, by exact counts (issue #46):
Python function calls over one training step (zero_grad, forward, backward, optimizer
step), the wrapped step minus the same step of the bare model, measured in the same process
for DDP (the reference) and with_bagua, 2 gloo ranks, the same bucket size.  Counts are
deterministic: this is not a timing test."""

import itertools
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import bagua_comm as bc
from bagua_algos import GradientAllReduce, with_bagua
from bagua_comm.testing import run_ranks

BUCKET = 16 * 1024
MODELS = {"mlp": [1024, 256, 256, 256, 256, 10],      # 10 tensors
          "t100": [32] * 51}                           # 100 tensors


def _model(dims):
    torch.manual_seed(0)
    layers = []
    for a, b in itertools.pairwise(dims):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _calls(model, opt, x, y) -> int:
    """Python calls of one step (after 4 warm-up steps), on every thread."""
    for _ in range(4):
        _step(model, opt, x, y)
    bc.barrier()
    n = [0]

    def prof(_frame, event, _arg):
        if event == "call":
            n[0] += 1

    threading.setprofile(prof)
    sys.setprofile(prof)
    try:
        _step(model, opt, x, y)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    bc.barrier()
    return n[0]


def _rank(dims):
    g = torch.Generator().manual_seed(bc.get_rank())
    x = torch.randn(8, dims[0], generator=g)
    y = torch.randint(0, dims[-1], (8,), generator=g)

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)

    bare = _model(dims)
    plain = _calls(bare, sgd(bare), x, y)
    ddp = DDP(_model(dims), process_group=dist.group.WORLD, bucket_cap_mb=BUCKET / 2**20)
    ddp_calls = _calls(ddp, sgd(ddp), x, y) - plain
    ddp_buckets = len(ddp.reducer._get_zeros_like_grad_buckets())
    model = _model(dims)
    opt = sgd(model)
    wrapped = with_bagua(model, [opt], GradientAllReduce(), bucket_size=BUCKET)
    bagua_calls = _calls(wrapped, opt, x, y) - plain
    buckets = len(wrapped.buckets)
    wrapped.detach_algorithm()
    return ddp_calls, ddp_buckets, bagua_calls, buckets


@pytest.mark.parametrize("model", sorted(MODELS))
def test_gradient_allreduce_python_calls_within_twice_ddps(model):
    ddp_calls, ddp_buckets, bagua_calls, buckets = run_ranks(_rank, 2, args=(MODELS[model],),
                                                             timeout=240)[0]
    assert buckets == ddp_buckets          # the same layout: per-bucket costs compare
    assert ddp_calls > 0
    assert bagua_calls <= 2 * ddp_calls, (model, bagua_calls, ddp_calls)
