"""What ``with_bagua`` refuses from the model alone, before any communication: sparse
gradients under an algorithm of dense gradient buckets, and parameters a compressing algorithm
cannot quantise.  Before, both crashed in the middle of backward (sparse: "Cannot access data
pointer of Tensor that doesn't have storage"; float64: a bagua_comm message naming neither the
parameter nor the algorithm).  Single-process cases run with no process group at all: the
error comes before with_bagua looks for one."""

from __future__ import annotations

import pytest
import torch

import bagua_comm as bc
from bagua_algos import (
    AsyncModelAverage,
    ByteGrad,
    Decentralized,
    DiLoCo,
    GradientAllReduce,
    LowPrecisionDecentralized,
    LowRank,
    QAdam,
    QAdamOptimizer,
    TopK,
    with_bagua,
)
from bagua_comm.compression import MinMaxUInt8
from bagua_comm.testing import run_ranks


class _Emb(torch.nn.Module):
    def __init__(self, sparse: bool, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(20, 6, sparse=sparse)
        self.head = torch.nn.Linear(6, 1).to(dtype)

    def forward(self, i):
        return self.head(self.tok(i).to(self.head.weight.dtype))


def _wrap(model, make):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if make == "qadam":
        opt = QAdamOptimizer(model.parameters(), lr=0.01)
        return with_bagua(model, [opt], QAdam(opt))
    return with_bagua(model, [opt], make())


DENSE = {"bytegrad": ByteGrad, "qadam": "qadam",
         "topk": TopK, "low_rank": LowRank,
         "async with warm-up": lambda: AsyncModelAverage(warmup_steps=2)}
# weights averaged, or (GradientAllReduce) sparse gradients averaged on their own
# (tests/test_sparse_gradients.py)
SPARSE_OK = {"gradient_allreduce": GradientAllReduce, "decentralized": Decentralized, "low_precision_decentralized":
           LowPrecisionDecentralized, "diloco": DiLoCo, "async": AsyncModelAverage}
COMPRESSING = {"bytegrad": ByteGrad, "qadam": "qadam", "low_precision_decentralized":
               LowPrecisionDecentralized,
               "topk with a compressor": lambda: TopK(compressor=MinMaxUInt8(2))}
EXACT = {"gradient_allreduce": GradientAllReduce, "topk": TopK, "low_rank": LowRank,
         "decentralized": Decentralized, "diloco": DiLoCo}


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not bc.is_initialized()


@pytest.mark.parametrize("name", list(DENSE))
def test_sparse_embedding_is_refused_by_dense_gradient_buckets(name):
    with pytest.raises(ValueError, match=r"modules \['tok'\] are Embedding\(sparse=True\).*"
                                         r"sparse=False"):
        _wrap(_Emb(sparse=True), DENSE[name])


@pytest.mark.parametrize("name", list(SPARSE_OK))
def test_sparse_embedding_passes_where_sparse_gradients_are_handled(name):
    with pytest.raises(RuntimeError, match="not initialised"):   # past the model checks
        _wrap(_Emb(sparse=True), SPARSE_OK[name])


@pytest.mark.parametrize("name", list(COMPRESSING))
def test_float64_parameters_are_refused_by_a_compressing_algorithm(name):
    with pytest.raises(ValueError, match=r"parameters \['head.weight', 'head.bias'\] are "
                                         r"float64.*float32, float16 or bfloat16"):
        _wrap(_Emb(sparse=False, dtype=torch.float64), COMPRESSING[name])


@pytest.mark.parametrize("name", list(EXACT))
def test_float64_parameters_pass_where_nothing_is_quantised(name):
    with pytest.raises(RuntimeError, match="not initialised"):
        _wrap(_Emb(sparse=False, dtype=torch.float64), EXACT[name])


def test_frozen_sparse_embedding_is_not_refused():
    model = _Emb(sparse=True)
    model.tok.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="not initialised"):
        _wrap(model, GradientAllReduce)


class _Functional(torch.nn.Module):
    """Sparse gradients no module declares: F.embedding(sparse=True) on a bare parameter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(20, 6))
        self.head = torch.nn.Linear(6, 1)

    def forward(self, i):
        return self.head(torch.nn.functional.embedding(i, self.table, sparse=True))


def _functional_sparse():
    model = _Functional()
    net = with_bagua(model, [torch.optim.SGD(model.parameters(), lr=0.1)], GradientAllReduce())
    try:
        net(torch.arange(8)).sum().backward()
    except ValueError as err:
        return str(err)
    return None


def test_sparse_gradient_at_run_time_raises_on_every_rank_naming_the_parameter():
    for message in run_ranks(_functional_sparse, 2, timeout=120):
        assert message is not None and "'table' got a sparse gradient" in message


# -- QAdam averages its QAdamOptimizer's parameters only -------------------------------------
def test_qadam_refuses_trainable_parameters_outside_its_optimizer():
    """Before: with the head in an SGD optimizer beside the QAdamOptimizer, the head's
    gradients were never averaged and the ranks drifted apart (0.12 after 4 steps)."""
    model = _Emb(sparse=False)
    q = QAdamOptimizer(model.tok.parameters(), lr=0.01)
    sgd = torch.optim.SGD(model.head.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"q_adam_optimizer: parameters \['head.weight', "
                                         r"'head.bias'\] require grad but are not in the "
                                         r"QAdamOptimizer"):
        with_bagua(model, [q, sgd], QAdam(q))
    model.head.requires_grad_(False)                # frozen: nothing to average, accepted
    with pytest.raises(RuntimeError, match="not initialised"):
        with_bagua(model, [q], QAdam(q))


def test_qadam_refuses_an_optimizer_over_another_model():
    model, other = _Emb(sparse=False), _Emb(sparse=False)
    q = QAdamOptimizer([*model.parameters(), *other.head.parameters()], lr=0.01)
    with pytest.raises(ValueError, match="2 of its parameters are not the wrapped model's"):
        with_bagua(model, [q], QAdam(q))


def _qadam_group_added_later():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[1].requires_grad_(False)
    q = QAdamOptimizer(model[0].parameters(), lr=0.01, warmup_steps=2)
    net = with_bagua(model, [q], QAdam(q, hierarchical=False))
    model[1].requires_grad_(True)
    q.add_param_group({"params": list(model[1].parameters())})
    net(torch.ones(2, 4)).sum().backward()
    try:
        q.step()
    except ValueError as err:
        return str(err)
    return None


def test_qadam_refuses_a_param_group_added_after_wrapping():
    for message in run_ranks(_qadam_group_added_later, 2, timeout=120):
        assert message is not None and "add_param_group() after with_bagua" in message


# -- complex tensors; a dtype changed after wrapping --------------------------------------------
@pytest.mark.parametrize("what", ["parameter", "buffer"])
def test_complex_tensors_are_refused_naming_them(what):
    """They failed inside bagua_comm's broadcast ("carries float32, ... cast it first (e.g.
    .float())", advice that drops the imaginary part), naming neither tensor nor with_bagua."""
    model = torch.nn.Linear(3, 2)
    if what == "parameter":
        model.z = torch.nn.Parameter(torch.zeros(2, dtype=torch.cfloat))
    else:
        model.register_buffer("z", torch.zeros(2, dtype=torch.cfloat))
    for algo in (GradientAllReduce, Decentralized, DiLoCo):
        with pytest.raises(ValueError, match=r"model: \['z'\] are complex tensors.*view_as_real"):
            _wrap(model, algo)


def _cast_after_wrap():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    net = with_bagua(model, [torch.optim.SGD(model.parameters(), lr=0.1)], GradientAllReduce())
    model.double()
    try:
        net(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    except RuntimeError as err:
        return str(err)
    return None


def test_a_dtype_changed_after_wrapping_is_named():
    """It was torch's "attempting to assign a gradient with dtype 'float' to a tensor with
    grad_dtype 'Double'" from inside the bucket code."""
    for message in run_ranks(_cast_after_wrap, 2, timeout=120):
        assert message is not None and "is torch.float64 on cpu but was torch.float32" in message
        assert "cast or move the model before wrapping it" in message
