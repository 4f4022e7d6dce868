"""The peer-exchanging algorithms through the NCCL backend's code path, on CPU.

bagua_comm.testing_nccl's fake NCCL blocks an ungrouped recv until the peer's send has run,
as NCCL does on a GPU: an exchange issued as ``recv`` then ``send`` (two launches) deadlocks
two ranks there.  Each case trains on 2 ranks over gloo, then again over the fake NCCL, and
the two runs must end bit-identical (the same arithmetic on the same CPU tensors), including
LowPrecisionDecentralized's full-precision replica resync after a resume.
"""

import pytest
import torch
from _common import batch, loss_fn, make_model

import bagua_comm as bc
from bagua_algos import Decentralized, LowPrecisionDecentralized, with_bagua
from bagua_comm.testing import run_ranks

STEPS, RESUME_AT = 6, 3
CASES = {
    "decentralized-shift_one": lambda: Decentralized(hierarchical=False,
                                                     peer_selection_mode="shift_one"),
    "low_precision_decentralized": lambda: LowPrecisionDecentralized(hierarchical=False),
}


def _train(case):
    model = make_model(seed=bc.get_rank() + 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped = with_bagua(model, [opt], CASES[case](), bucket_size=None)
    for step in range(STEPS):
        if step == RESUME_AT:       # LowPrecisionDecentralized re-derives its replicas
            wrapped.impl.load_state_dict(wrapped.impl.state_dict())
        opt.zero_grad()
        loss_fn(wrapped, *batch(step, bc.get_rank())).backward()
        opt.step()
    out = [p.detach().clone() for p in model.parameters()]
    wrapped.impl.shutdown()
    return out


def _job():
    from bagua_comm.testing_nccl import fake_communicators, use_fake_nccl

    gloo = {case: _train(case) for case in CASES}
    use_fake_nccl(timeout=5.0)
    fake = {case: _train(case) for case in CASES}
    ungrouped = sum(c.ungrouped_p2p for c in fake_communicators())
    return {case: all(torch.equal(a, b) for a, b in zip(gloo[case], fake[case]))
            for case in CASES}, ungrouped


@pytest.fixture(scope="module")
def results():
    return run_ranks(_job, 2, timeout=180)


@pytest.mark.parametrize("case", list(CASES))
def test_exchange_through_fake_nccl_matches_gloo(results, case):
    for same, ungrouped in results:
        assert same[case], case
        assert ungrouped == 0
