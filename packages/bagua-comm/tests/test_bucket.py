"""Bucket: one flat padded buffer; parameters and gradients become views of it."""

import pytest
import torch

from bagua_comm.bucket import Bucket


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def test_values_are_copied_and_tensors_become_views_of_the_buffer():
    ts = [torch.arange(6.0).view(2, 3), torch.tensor([7.0]), torch.arange(4.0).view(2, 2).t()]
    before = [t.clone() for t in ts]
    ids = [id(t) for t in ts]
    b = Bucket(ts, alignment=4, name="b0")
    assert b.numel == 11 and b.padded_numel == 12 and b.buffer.shape == (12,)
    assert [id(t) for t in b.tensors] == ids  # same objects
    for t, ref in zip(b.tensors, before):
        assert torch.equal(t, ref) and t.is_contiguous()
    expected = torch.cat([r.reshape(-1) for r in before] + [torch.zeros(1)])
    assert torch.equal(b.buffer, expected)
    assert b.check_flat()
    b.buffer.mul_(2)  # the buffer and the tensors are the same memory
    assert torch.equal(ts[0], before[0] * 2) and torch.equal(ts[2], before[2] * 2)
    ts[1].add_(1)
    assert b.buffer[6].item() == 15.0
    assert torch.equal(b.slice(2), ts[2].reshape(-1))
    assert "b0" in repr(b) and len(b) == 3


def test_parameters_train_through_the_buffer():
    model, ref = _model(), _model()
    params = list(model.parameters())
    b = Bucket(params, alignment=8)
    assert all(isinstance(p, torch.nn.Parameter) for p in b.tensors) and b.check_flat()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 5)
    for m, o in ((model, opt), (ref, opt_ref)):
        m(x).square().sum().backward()
        o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert b.check_flat()
    assert torch.equal(b.buffer[:b.numel], torch.cat([q.detach().view(-1) for q in ref.parameters()]))


def test_gradients_accumulate_into_the_bucket():
    model = _model()
    x = torch.randn(4, 5)
    model(x).sum().backward()
    grads = [p.grad for p in model.parameters()]
    b = Bucket(grads, alignment=3)
    first = b.buffer.clone()
    model(x).sum().backward()  # autograd accumulates in place into the views
    assert b.check_flat()
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert torch.allclose(b.buffer, first * 2)
    b.buffer.zero_()
    assert all(p.grad.abs().sum() == 0 for p in model.parameters())


def test_check_flat_detects_a_replaced_tensor_and_reflatten_repairs_it():
    params = list(_model().parameters())
    b = Bucket(params)
    params[1].data = torch.full_like(params[1], 5.0)
    assert not b.check_flat()
    b.reflatten()
    assert b.check_flat() and torch.equal(b.slice(1), torch.full((3,), 5.0))
    new = [torch.ones_like(p) for p in params]
    b.reflatten(new)
    assert b.tensors[0] is new[0] and b.check_flat()
    assert torch.equal(b.buffer[:b.numel], torch.ones(b.numel))
    with pytest.raises(ValueError, match="tensors must have 4 entries"):
        b.reflatten(new[:2])
    with pytest.raises(ValueError, match=r"tensors\[0\] must be a torch.float32 tensor of 15"):
        b.reflatten([torch.ones(2)] + new[1:])


def test_bad_input_names_the_rule():
    with pytest.raises(ValueError, match="non-empty"):
        Bucket([])
    with pytest.raises(ValueError, match="share a dtype"):
        Bucket([torch.ones(2), torch.ones(2, dtype=torch.float16)])
    with pytest.raises(ValueError, match="one device"):
        Bucket([torch.ones(2), torch.ones(2, device="meta")])
    with pytest.raises(ValueError, match="alignment"):
        Bucket([torch.ones(2)], alignment=0)
    t = torch.ones(2)
    with pytest.raises(ValueError, match="only once"):
        Bucket([t, t])
    with pytest.raises(ValueError, match=r"tensors\[1\] must be a torch.Tensor"):
        Bucket([t, [1.0]])
