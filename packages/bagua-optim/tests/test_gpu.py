"""On CUDA: fused optimizers stay bit-identical to unfused ones, fused=True kernels included."""

import pytest
import torch
from _helpers import assert_same_state

from bagua_optim import fuse_optimizer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", [{}, {"foreach": False}, {"foreach": True}, {"fused": True}])
@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_cuda_bit_identical(name, mode):
    kw = {"lr": 1e-2, **mode}
    if name == "SGD":
        kw["momentum"] = 0.9
    g = torch.Generator().manual_seed(0)
    shapes = [(37,), (5, 7), (128,), (3, 3, 3)] * 25
    init = [torch.randn(s, generator=g) for s in shapes]
    pa = [torch.nn.Parameter(x.cuda()) for x in init]
    pb = [torch.nn.Parameter(x.cuda()) for x in init]
    cls = getattr(torch.optim, name)
    plain = cls(pa, **kw)
    fused = fuse_optimizer(cls(pb, **kw))
    for _ in range(4):
        grads = [torch.randn(s, generator=g).cuda() for s in shapes]
        for ps in (pa, pb):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
        plain.step()
        fused.step()
        for x, y in zip(pa, pb):
            assert torch.equal(x, y)
    assert_same_state(plain.state_dict(), fused.state_dict())
    if not mode.get("fused"):
        assert fused._bagua_fuse.layouts[0].runs, "CUDA parameters were fused"
