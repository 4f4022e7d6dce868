"""Host work of one GradientAllReduce, ByteGrad, QAdam, Decentralized,
LowPrecisionDecentralized, TopK and LowRank step against torch DDP's, by exact
counts (issue #46): Python function calls over one training step (zero_grad, forward,
backward, optimizer step) on every thread (bagua's worker threads included), the wrapped step
minus the same step of the bare model with the same optimizer, measured in the same process
for DDP (the reference) and with_bagua, 2 gloo ranks, the same bucket size.  Counts are
deterministic: this is not a timing test."""

import itertools
import sys
import threading
import time

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


_COUNT = [None]       # a list while a step is counted


def _prof(_frame, event, _arg):
    if event == "call" and _COUNT[0] is not None:
        _COUNT[0].append(1)


def _thread_entry(frame, event, arg):
    sys.setprofile(_prof)
    _prof(frame, event, arg)


def _install():
    """Every thread started from now on is counted too (bagua's worker threads start lazily,
    in the first steps): call first thing in a rank."""
    threading.setprofile(_thread_entry)


def _calls(model, opt, x, y) -> int:
    """Python calls of one step (after 4 warm-up steps), on every thread."""
    for _ in range(4):
        _step(model, opt, x, y)
    bc.barrier()
    _COUNT[0] = []
    sys.setprofile(_prof)
    try:
        _step(model, opt, x, y)
        time.sleep(0.05)      # worker threads finish what follows the step's last wait
    finally:
        sys.setprofile(None)
        n, _COUNT[0] = len(_COUNT[0]), None
    bc.barrier()
    return n


def _rank(dims):
    _install()
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


def _rank_compressed(dims):
    """DDP's, ByteGrad's, QAdam's, Decentralized's, LowPrecisionDecentralized's and DDP with
    bagua's ByteGrad comm hook's calls (each against the bare model with its optimizer: SGD with momentum,
    QAdamOptimizer for QAdam, after its warmup)."""
    from bagua_algos import ByteGrad, Decentralized, LowPrecisionDecentralized, QAdam
    from bagua_algos import QAdamOptimizer as QAdamOpt
    from bagua_algos.ddp_hooks import CompressionHookState, compressed_allreduce_hook

    _install()
    g = torch.Generator().manual_seed(bc.get_rank())
    x = torch.randn(8, dims[0], generator=g)
    y = torch.randint(0, dims[-1], (8,), generator=g)

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)

    def qadam(m):
        return QAdamOpt(m.parameters(), lr=1e-3, warmup_steps=2)

    bare = _model(dims)
    plain_sgd = _calls(bare, sgd(bare), x, y)
    bare = _model(dims)
    plain_qadam = _calls(bare, qadam(bare), x, y)
    ddp = DDP(_model(dims), process_group=dist.group.WORLD, bucket_cap_mb=BUCKET / 2**20)
    out = {"ddp": (_calls(ddp, sgd(ddp), x, y) - plain_sgd,
                   len(ddp.reducer._get_zeros_like_grad_buckets()))}
    hooked = DDP(_model(dims), process_group=dist.group.WORLD, bucket_cap_mb=BUCKET / 2**20)
    hooked.register_comm_hook(CompressionHookState(), compressed_allreduce_hook)
    out["ddp_hook"] = (_calls(hooked, sgd(hooked), x, y) - plain_sgd,
                       len(hooked.reducer._get_zeros_like_grad_buckets()))
    makers = {"bytegrad": ByteGrad, "decentralized": Decentralized,
              "low_precision_decentralized": LowPrecisionDecentralized}
    for name in ("bytegrad", "qadam", "decentralized", "low_precision_decentralized"):
        model = _model(dims)
        opt = qadam(model) if name == "qadam" else sgd(model)
        algo = QAdam(opt) if name == "qadam" else makers[name]()
        wrapped = with_bagua(model, [opt], algo, bucket_size=BUCKET)
        plain = plain_qadam if name == "qadam" else plain_sgd
        out[name] = (_calls(wrapped, opt, x, y) - plain, len(wrapped.buckets))
        wrapped.detach_algorithm()
    return out


@pytest.mark.parametrize("model", sorted(MODELS))
def test_compressed_decentralized_and_hooked_python_calls_within_four_times_ddps(model):
    got = run_ranks(_rank_compressed, 2, args=(MODELS[model],), timeout=240)[0]
    ddp_calls, ddp_buckets = got["ddp"]
    assert ddp_calls > 0
    for name in ("bytegrad", "qadam", "decentralized", "low_precision_decentralized",
                 "ddp_hook"):
        calls, buckets = got[name]
        assert buckets == ddp_buckets, (name, buckets, ddp_buckets)
        assert calls <= 4 * ddp_calls, (model, name, calls, ddp_calls)


def _rank_sparse(dims, name):
    """DDP's and ``name``'s (TopK, LowRank, default arguments) calls and buckets."""
    from bagua_algos import Algorithm

    _install()
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
    wrapped = with_bagua(model, [opt], Algorithm.init(name), bucket_size=BUCKET)
    calls = _calls(wrapped, opt, x, y) - plain
    buckets = len(wrapped.buckets)
    wrapped.detach_algorithm()
    return ddp_calls, ddp_buckets, calls, buckets


@pytest.mark.parametrize("name", ["topk", "low_rank"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_sparse_algorithms_python_calls_within_four_times_ddps(model, name):
    ddp_calls, ddp_buckets, calls, buckets = run_ranks(_rank_sparse, 2,
                                                       args=(MODELS[model], name),
                                                       timeout=240)[0]
    assert buckets == ddp_buckets
    assert ddp_calls > 0
    assert calls <= 4 * ddp_calls, (model, name, calls, ddp_calls)
