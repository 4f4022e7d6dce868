"""Every primitive on 2 gloo ranks against a numpy reference (float32)."""

import numpy as np
import torch

import bagua_comm as bc
from bagua_comm.testing import run_ranks

N = 6


def _data(rank, n=N, world=2):
    return np.arange(n * world, dtype=np.float32).reshape(world, n)[rank] * (rank + 1) + 1


def _all_primitives():
    r, w = bc.get_rank(), bc.get_world_size()
    x = torch.from_numpy(_data(r))
    ref_all = np.stack([_data(i) for i in range(w)])
    out = {}

    y = torch.empty_like(x)
    bc.allreduce(x, y)
    out["allreduce"] = np.allclose(y.numpy(), ref_all.sum(0))
    y = x.clone()
    bc.allreduce_inplace(y, op=bc.ReduceOp.AVG)
    out["allreduce_avg"] = np.allclose(y.numpy(), ref_all.mean(0))
    y = x.clone()
    bc.allreduce_inplace(y, op=bc.ReduceOp.MAX, async_op=True).wait()
    out["allreduce_max_async"] = np.allclose(y.numpy(), ref_all.max(0))

    y = torch.empty(N * w)
    bc.allgather(x, y)
    out["allgather"] = np.allclose(y.numpy(), ref_all.reshape(-1))

    y = torch.zeros(N)
    bc.reduce(x, y, dst=1)
    out["reduce"] = np.allclose(y.numpy(), ref_all.sum(0)) if r == 1 else True

    y = x.clone()
    bc.broadcast(y, src=1)
    out["broadcast"] = np.allclose(y.numpy(), ref_all[1])
    out["broadcast_object"] = bc.broadcast_object({"r": r}, src=1) == {"r": 1}

    y = torch.empty(N // w)
    bc.reduce_scatter(x, y)
    out["reduce_scatter"] = np.allclose(y.numpy(), ref_all.sum(0).reshape(w, -1)[r])

    y = torch.empty(N)
    bc.alltoall(x, y)
    ref = np.concatenate([ref_all[j].reshape(w, -1)[r] for j in range(w)])
    out["alltoall"] = np.allclose(y.numpy(), ref)

    y = torch.empty(N * w)
    bc.gather(x, y, dst=0)
    out["gather"] = np.allclose(y.numpy(), ref_all.reshape(-1)) if r == 0 else True

    y = torch.empty(N // w)
    bc.scatter(x, y, src=0)
    out["scatter"] = np.allclose(y.numpy(), ref_all[0].reshape(w, -1)[r])

    if r == 0:
        bc.send(x, 1)
        out["send_recv"] = True
    else:
        y = torch.empty(N)
        bc.recv(y, 0)
        out["send_recv"] = np.allclose(y.numpy(), ref_all[0])
    bc.barrier()
    return out


def test_every_primitive_matches_numpy():
    for rank_out in run_ranks(_all_primitives, 2):
        assert all(rank_out.values()), {k: v for k, v in rank_out.items() if not v}
