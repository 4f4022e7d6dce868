"""LowRank's compiled exchange (one job per bucket on the gloo worker, issue #46) trains bit
for bit as its Python path (``LowRankImpl.exchange``), at 2 and 3 ranks, over several steps of
error feedback and warm-started Q: rank 1 and 2 factors, compressed and uncompressed tensors
in one bucket (more than two uncompressed runs, and one or two), a parameter one rank leaves
unused, an overflow on one rank (residuals and Q of that bucket stay as they were), a resume
from a checkpoint (the state's tensors replaced), and the warm-up's plain average first."""

import pytest
import torch

import bagua_comm as bc
from bagua_algos import LowRank, with_bagua
from bagua_comm.testing import run_ranks

STEPS = 7
# registration order (buckets take them reversed): matrices of several shapes, vectors and a
# matrix too small to compress between them
SHAPES = {"a": (12, 10), "b": (10,), "c": (3, 3), "d": (9, 14), "e": (14,), "f": (6, 20),
          "g": (4,), "h": (16, 8), "i": (8,)}
UNUSED = ("b", 1, 2)      # no gradient for b on rank 1 at step 2
OVERFLOW = ("d", 1, 4)    # an infinity in d's gradient on rank 1 at step 4
RESUME = 5                # load_state_dict(state_dict()) before this step


class Probe(torch.nn.Module):
    """``forward(cs)`` = sum of ``(p * c).sum()``: each parameter's gradient is its ``c``."""

    def __init__(self):
        super().__init__()
        for name, shape in SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))

    def forward(self, cs):
        return sum((getattr(self, n) * c).sum() for n, c in cs.items() if c is not None)


def grads(step: int, rank: int) -> dict:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    out = {n: torch.randn(s, generator=gen) * (1 + step) for n, s in SHAPES.items()}
    if (rank, step) == UNUSED[1:]:
        out[UNUSED[0]] = None
    if (rank, step) == OVERFLOW[1:]:
        out[OVERFLOW[0]].view(-1)[3] = float("inf")
    return out


def _run(compiled: bool, rank_r: int, bucket_size: int):
    from bagua_algos.algorithms import _low_rank_round

    me = bc.get_rank()
    eligible = _low_rank_round.eligible
    if not compiled:                 # the Python path
        _low_rank_round.eligible = lambda impl, buckets: False
    try:
        model = Probe()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        wrapped = with_bagua(model, [opt], LowRank(rank=rank_r, start_step=1),
                             bucket_size=bucket_size)
        impl = wrapped.impl
        out = []
        for step in range(STEPS):
            if step == RESUME:
                impl.load_state_dict(impl.state_dict())
            opt.zero_grad()
            wrapped(grads(step, me)).backward()
            out.append({n: None if p.grad is None else p.grad.clone()
                        for n, p in model.named_parameters()})
        state = impl.state_dict()
        took = impl._compiled is not None and impl._compiled[-1] is not None
        layout = [list(b.names) for b in wrapped.buckets]
        wrapped.detach_algorithm()
    finally:
        _low_rank_round.eligible = eligible
    return took, out, state, layout


def _all():
    return {(compiled, r, size): _run(compiled, r, size)
            for r in (1, 2) for size in (4000, 1200) for compiled in (True, False)}


def _bits(t):
    return t.view(torch.int32)


@pytest.mark.parametrize("world", [2, 3])
def test_compiled_exchange_is_the_python_path_bit_for_bit(world):
    results = run_ranks(_all, world, timeout=300)
    for r in results:
        for rank_r in (1, 2):
            for size in (4000, 1200):
                took, fast, s_fast, layout = r[(True, rank_r, size)]
                took_slow, slow, s_slow, _ = r[(False, rank_r, size)]
                assert took and not took_slow
                assert len(layout) == (1 if size == 4000 else 2), layout
                for step in range(STEPS):
                    for n in SHAPES:
                        assert torch.equal(_bits(fast[step][n]), _bits(slow[step][n])), \
                            (rank_r, size, step, n)
                assert s_fast["rounds"] == s_slow["rounds"] == STEPS
                for key in ("q", "residuals"):
                    assert sorted(s_fast[key]) == sorted(s_slow[key])
                    for n in s_fast[key]:
                        assert torch.equal(_bits(s_fast[key][n]), _bits(s_slow[key][n]))
    # the overflow reached every rank
    assert not torch.isfinite(results[0][(True, 2, 4000)][1][OVERFLOW[2]][OVERFLOW[0]]).all()
