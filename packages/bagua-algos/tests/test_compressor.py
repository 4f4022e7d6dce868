"""``compressor=``: any bagua_comm Compressor drives ByteGrad, QAdam and
LowPrecisionDecentralized; buckets are aligned to it; bad values raise ValueError."""

import pytest
import torch
from _common import batch, eval_loss, loss_fn, make_model, params

import bagua_comm as bc
from bagua_algos import ByteGrad, LowPrecisionDecentralized, QAdam, QAdamOptimizer, with_bagua
from bagua_comm.compression import Compressor
from bagua_comm.testing import run_ranks

STEPS = 20


class HalfPrecision(Compressor):
    """A user-written compressor: each element travels as float16 (2 bytes)."""

    def __init__(self, chunks: int):
        self.chunks = chunks
        self.calls = 0

    def payload_numel(self, numel, *, chunks=None):
        return 2 * numel

    def compress(self, tensor, *, chunks=None, key=None, out=None):
        self.calls += 1
        payload = tensor.detach().reshape(-1).to(torch.float16).view(torch.uint8)
        if out is None:
            return payload
        return out.copy_(payload)

    def decompress(self, payload, out, *, chunks=None, **_):
        out.view(-1).copy_(payload.view(torch.float16))
        return out


def _half(t):
    return t.to(torch.float16).float()


def _run(kind):
    rank, world = bc.get_rank(), bc.get_world_size()
    model = make_model(seed=1)
    comp = HalfPrecision(chunks=2 if kind != "lpd" else 3)
    if kind == "qadam":
        opt = QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=2)
        algo = QAdam(opt, hierarchical=False, compressor=comp)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        algo = (ByteGrad(hierarchical=False, compressor=comp) if kind == "bytegrad"
                else LowPrecisionDecentralized(hierarchical=False, compressor=comp))
    model = with_bagua(model, [opt], algo, bucket_size=300)
    out = {"aligned": all(b.padded_numel % comp.chunks == 0 for b in model.buckets)}
    if kind == "bytegrad":     # one step's gradient: the float16 average of float16 grads
        loss_fn(model, *batch(0, rank)).backward()
        got = [p.grad.clone() for p in model.parameters()]
        want = []
        locals_ = []
        for r in range(world):
            m = make_model(seed=1)
            loss_fn(m, *batch(0, r)).backward()
            locals_.append([_half(p.grad) for p in m.parameters()])
        for parts in zip(*locals_):
            want.append(_half(sum(parts) / world))
        out["first"] = (got, want)
    before = eval_loss(model, world)
    for step in range(STEPS):
        opt.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        opt.step()
    out.update(params=params(model), before=before, after=eval_loss(model, world),
               calls=comp.calls)
    model.detach_algorithm()
    return out


def _chunks_must_divide():
    try:
        with_bagua(make_model(), [], ByteGrad(hierarchical=False, compressor=HalfPrecision(3)))
    except ValueError as err:
        return str(err)
    return None


def _all():
    out = {k: _run(k) for k in ("bytegrad", "qadam", "lpd")}
    out["chunks"] = _chunks_must_divide()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all, 2, timeout=240)


def test_custom_compressor_in_bytegrad_is_used_trains_and_keeps_ranks_bit_identical(results):
    for r in results:
        res = r["bytegrad"]
        assert res["calls"] > 0 and res["aligned"]
        for g, w in zip(*res["first"]):
            torch.testing.assert_close(g, w, atol=1e-7, rtol=0)
        assert res["after"] < 0.7 * res["before"]
    a, b = results[0]["bytegrad"]["params"], results[1]["bytegrad"]["params"]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_custom_compressor_in_qadam_and_low_precision_decentralized(results):
    for r in results:
        for kind in ("qadam", "lpd"):
            res = r[kind]
            assert res["calls"] > 0 and res["aligned"]
            assert res["after"] < 0.8 * res["before"]
    a, b = results[0]["qadam"]["params"], results[1]["qadam"]["params"]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_compressor_must_be_a_compressor(results):
    for make in (lambda c: ByteGrad(compressor=c),
                 lambda c: LowPrecisionDecentralized(compressor=c),
                 lambda c: QAdam(QAdamOptimizer(make_model().parameters()), compressor=c)):
        with pytest.raises(ValueError, match="compressor must be None"):
            make("minmax")
        with pytest.raises(ValueError, match="compressor must be None"):
            make(object())
    for r in results:
        assert "must be a multiple of the number of ranks" in r["chunks"]
    with pytest.raises(ValueError, match="error_feedback"):
        ByteGrad(error_feedback=True, compressor=HalfPrecision(2))
