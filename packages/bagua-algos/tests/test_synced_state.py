"""``BaguaModule.synced_state_dict()``: the model every rank agrees on, read without a
collective.  DiLoCo with overlap (its ranks never hold it) against the ranks' own recorded
parameters and buffers at the sync's start; the synchronous algorithms against
``state_dict()``; the decentralized ones refuse."""

from __future__ import annotations

import pytest
import torch
from _common import batch, loss_fn

import bagua_comm as bc
from bagua_algos import Decentralized, DiLoCo, GradientAllReduce, with_bagua
from bagua_comm.testing import run_ranks


class _Normed(torch.nn.Module):
    """BatchNorm's running statistics (moving at every forward) beside a constant -inf mask."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(bc.get_rank())          # ranks start apart: the wrap must agree them
        self.inp = torch.nn.Linear(6, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 1)
        self.register_buffer("mask", torch.tensor([0.0, float("-inf"), 1.5]))

    def forward(self, x):
        return self.out(self.norm(self.inp(x))) + self.mask[0]


def _copy(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


def _diloco_run(H=4, tau=2):
    """Each rank's synced_state_dict() at the wrap, just before the sync lands and after; its
    own state at the sync's start and after the landing; whether reading it moved the model."""
    rank = bc.get_rank()
    model = _Normed()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # outer lr 1, no momentum: the landed anchor is the mean of the ranks' parameters
    net = with_bagua(model, [opt], DiLoCo(sync_every=H, outer_lr=1.0, outer_momentum=0.0,
                                          nesterov=False, overlap_steps=tau))
    seen = {"wrap_own": _copy(net.state_dict()), "wrap": net.synced_state_dict()}
    for step in range(1, H + tau + 1):
        opt.zero_grad()
        loss_fn(net, *batch(step, rank)).backward()
        if step == H + tau:
            seen["before_landing"] = net.synced_state_dict()
        opt.step()
        if step == H:
            seen["start_own"] = _copy(net.state_dict())
    own = _copy(net.state_dict())
    seen["landed"] = net.synced_state_dict()
    seen["untouched"] = all(torch.equal(own[k], v) for k, v in net.state_dict().items())
    seen["landed_own"] = own
    net.detach_algorithm()
    return seen


def test_diloco_synced_state_is_the_anchor_and_the_syncs_buffers():
    """With overlap_steps the ranks' own models are never the synced one.  The synced state:
    rank 0's model at the wrap until the first sync lands; then the mean of the ranks'
    parameters and float buffers at the sync's start (outer lr 1, no momentum), the -inf mask
    exactly itself, num_batches_tracked this rank's own; equal on both ranks."""
    s0, s1 = run_ranks(_diloco_run, 2, timeout=120)
    for seen in (s0, s1):
        assert seen["untouched"]
        for k, v in s0["wrap_own"].items():          # rank 0's model, as the wrap broadcast
            assert torch.equal(seen["wrap"][k], v), k
            if k != "norm.num_batches_tracked":
                assert torch.equal(seen["before_landing"][k], v), k
        for k in seen["landed"]:
            if k == "norm.num_batches_tracked":
                assert torch.equal(seen["landed"][k], seen["landed_own"][k])
                continue
            want = (s0["start_own"][k].double() + s1["start_own"][k].double()) / 2
            if k == "mask":
                want = torch.tensor([0.0, float("-inf"), 1.5], dtype=torch.float64)
            assert torch.allclose(seen["landed"][k].double(), want, rtol=1e-5, atol=1e-6), k
            assert seen["landed"][k].dtype == seen["landed_own"][k].dtype
            assert torch.equal(seen["landed"][k], s0["landed"][k]), k    # ranks agree
        # the rank's own model kept its inner steps made while the sync was in flight
        assert not torch.equal(seen["landed"]["inp.weight"], seen["landed_own"]["inp.weight"])


def _synchronous_and_decentralized():
    rank = bc.get_rank()
    out = {}
    for name, algo in (("gradient_allreduce", GradientAllReduce()),
                       ("decentralized", Decentralized(hierarchical=False))):
        model = _Normed()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        net = with_bagua(model, [opt], algo)
        for step in range(1, 3):
            opt.zero_grad()
            loss_fn(net, *batch(step, rank)).backward()
            opt.step()
        try:
            synced = net.synced_state_dict()
            out[name] = all(torch.equal(synced[k], v) for k, v in net.state_dict().items())
        except RuntimeError as err:
            out[name] = str(err)
        net.detach_algorithm()
    return out


def test_synchronous_algorithms_give_their_state_and_decentralized_ones_refuse():
    for out in run_ranks(_synchronous_and_decentralized, 2, timeout=120):
        assert out["gradient_allreduce"] is True
        assert "Decentralized's ranks hold different models" in out["decentralized"]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
