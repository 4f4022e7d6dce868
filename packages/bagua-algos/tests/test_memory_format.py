"""Weight-communicating algorithms keep a parameter's memory format, as DDP does: a
channels_last conv weight and a transposed parameter keep their strides (issue #29, B)."""

import time

import pytest
import torch

import bagua_comm as bc
from bagua_algos import AsyncModelAverage, Decentralized, LowPrecisionDecentralized, with_bagua
from bagua_comm.testing import run_ranks

STEPS = 3


class _Net(torch.nn.Module):
    def __init__(self, strided: bool):
        super().__init__()
        torch.manual_seed(7)
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc_t = torch.nn.Parameter(torch.randn(4, 5) * 0.3)      # used as (5, 4)^T
        self.bias = torch.nn.Parameter(torch.zeros(5))
        if strided:
            self.conv.to(memory_format=torch.channels_last)
            self.fc_t = torch.nn.Parameter(self.fc_t.detach().t().contiguous().t())

    def forward(self, x):
        h = self.conv(x).mean(dim=(2, 3))                               # (N, 4)
        return h @ self.fc_t + self.bias


def _algorithm(name):
    if name == "async":
        return AsyncModelAverage(sync_interval_ms=2, warmup_steps=100)   # synchronous here
    cls = Decentralized if name == "decentralized" else LowPrecisionDecentralized
    return cls(hierarchical=False)


def _run(name, strided):
    rank = bc.get_rank()
    model = _Net(strided)
    strides = {n: p.stride() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model = with_bagua(model, [opt], _algorithm(name), bucket_size=256)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(4, 3, 6, 6, generator=g), torch.randn(4, 5, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        time.sleep(0.01 if name == "async" else 0)
    inner = model.module
    out = {"kept": all(p.stride() == strides[n] for n, p in inner.named_parameters()),
           "channels_last": inner.conv.weight.is_contiguous(memory_format=torch.channels_last),
           "transposed": not inner.fc_t.is_contiguous(),
           "flat": all(b.check_flat(grads=False) for b in model.buckets),
           "values": {n: p.detach().contiguous().clone() for n, p in inner.named_parameters()}}
    if name == "async":
        model.abort()
    model.detach_algorithm()
    return out


def _both(name):
    return _run(name, True), _run(name, False)


@pytest.mark.parametrize("name", ["decentralized", "low_precision_decentralized", "async"])
def test_weight_algorithms_keep_channels_last_and_transposed_parameters(name):
    for strided, plain in run_ranks(_both, 2, args=(name,), timeout=180):
        assert strided["kept"] and strided["channels_last"] and strided["transposed"]
        assert strided["flat"]          # still views of the bucket's weight buffer
        for n, v in strided["values"].items():
            torch.testing.assert_close(v, plain["values"][n], rtol=1e-5, atol=1e-6,
                                       msg=f"{name}: {n}")
