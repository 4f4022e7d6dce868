"""Hierarchical modes on one node run flat (there is no inter-node link to save), so that the
default ``ByteGrad()``, ``QAdam(opt)`` and ``LowPrecisionDecentralized()`` compress on a single
machine: fewer bytes than their full-precision counterparts, said in one log line."""

import logging

import pytest
import torch

import bagua_comm as bc
from bagua_algos import (
    ByteGrad,
    Decentralized,
    GradientAllReduce,
    LowPrecisionDecentralized,
    QAdam,
    QAdamOptimizer,
    with_bagua,
)
from bagua_comm import traffic
from bagua_comm.testing import run_ranks

STEPS, WARMUP = 6, 2


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _bytes_per_step(make_algo, qadam=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 8))
    opt = (QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=WARMUP) if qadam
           else torch.optim.SGD(model.parameters(), lr=0.01))
    lines = _Lines()
    logging.getLogger("bagua_algos").addHandler(lines)
    model = with_bagua(model, [opt], make_algo(opt))
    logging.getLogger("bagua_algos").removeHandler(lines)
    g = torch.Generator().manual_seed(bc.get_rank())
    for step in range(STEPS):
        if step == WARMUP:        # QAdam: measure the compressed phase only
            traffic.reset()
        opt.zero_grad()
        x = torch.randn(16, 64, generator=g)
        model(x).square().mean().backward()
        opt.step()
    sent = traffic.bytes_sent() / (STEPS - WARMUP)
    model.detach_algorithm()
    return sent, [m for m in lines.lines if "runs flat" in m]


def _measure():
    return {
        "gradient_allreduce": _bytes_per_step(lambda opt: GradientAllReduce()),
        "bytegrad": _bytes_per_step(lambda opt: ByteGrad()),
        "qadam": _bytes_per_step(lambda opt: QAdam(opt), qadam=True),
        "decentralized": _bytes_per_step(lambda opt: Decentralized()),
        "low_precision_decentralized": _bytes_per_step(lambda opt: LowPrecisionDecentralized()),
    }


@pytest.fixture(scope="module")
def one_node():
    return run_ranks(_measure, 2, timeout=180)


@pytest.mark.parametrize(("compressed", "full"), [
    ("bytegrad", "gradient_allreduce"),
    ("qadam", "gradient_allreduce"),
    ("low_precision_decentralized", "decentralized"),
])
def test_default_compressed_algorithms_send_fewer_bytes_on_one_node(one_node, compressed, full):
    for res in one_node:
        assert res[compressed][0] < 0.5 * res[full][0], (res[compressed][0], res[full][0])


@pytest.mark.parametrize("algo", ["bytegrad", "qadam", "decentralized",
                                  "low_precision_decentralized"])
def test_one_log_line_says_hierarchical_runs_flat(one_node, algo):
    rank0, rank1 = one_node
    assert len(rank0[algo][1]) == 1 and "one node" in rank0[algo][1][0]
    assert rank1[algo][1] == []
    assert rank0["gradient_allreduce"][1] == []     # hierarchical=False: nothing to say
