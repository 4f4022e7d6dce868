"""In-place primitives work on torch.nn.Parameter (leaves that require grad), as code under
torch.no_grad() would, instead of communicating and then failing in autograd."""

import torch

import bagua_comm as bc
from bagua_comm.testing import run_ranks

Op = bc.ReduceOp


def _on_parameters():
    r = bc.get_rank()
    out = {}
    p = torch.nn.Parameter(torch.full((4,), float(r + 1)))
    bc.allreduce_inplace(p, op=Op.AVG)
    out["allreduce_inplace"] = (p.tolist(), p.requires_grad, p.is_leaf)
    q = torch.nn.Parameter(torch.arange(4.0) * (r + 1))
    bc.reduce_scatter_inplace(q, op=Op.AVG)
    out["reduce_scatter_inplace"] = q.detach()[2 * r:2 * r + 2].tolist()
    s = torch.nn.Parameter(torch.zeros(4))
    bc.allreduce(torch.full((4,), float(r + 1)), s, op=Op.AVG)
    out["allreduce recv"] = s.tolist()
    w = torch.nn.Parameter(torch.full((2,), float(r)))
    h = bc.allreduce_inplace(w, op=Op.AVG, async_op=True)
    h.wait()
    out["async"] = w.tolist()
    b = torch.nn.Parameter(torch.full((3,), float(r + 5)))
    bc.broadcast(b, 1)
    out["broadcast"] = b.tolist()
    d = torch.nn.Parameter(torch.full((2,), float(r + 1)))
    bc.reduce_inplace(d, 0, op=Op.AVG)
    out["reduce_inplace"] = d.tolist()
    # gradients still flow through the parameter afterwards
    (p * 2).sum().backward()
    out["grad"] = p.grad.tolist()
    return out


def test_inplace_primitives_on_parameters():
    res = run_ranks(_on_parameters, 2)
    for r, out in enumerate(res):
        assert out["allreduce_inplace"] == ([1.5] * 4, True, True)
        assert out["reduce_scatter_inplace"] == [x * 1.5 for x in (0.0, 1.0, 2.0, 3.0)][2 * r:2 * r + 2]
        assert out["allreduce recv"] == [1.5] * 4
        assert out["async"] == [0.5, 0.5]
        assert out["broadcast"] == [6.0] * 3
        assert out["grad"] == [2.0] * 4
    assert res[0]["reduce_inplace"] == [1.5, 1.5]
