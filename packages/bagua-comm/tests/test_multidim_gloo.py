"""gloo primitives with multi-dimensional buffers: the same result as flat ones (as on NCCL).

A ``[world, n]`` allgather output, ``[world, n]`` gather/scatter buffers and ``[2, n]``
reduce_scatter/alltoall inputs are laid out row-major; the reference is the flat call."""

import torch

import bagua_comm as bc
from bagua_comm.testing import run_ranks

N = 5


def _mine(rank, shape, dtype=torch.float32):
    return (torch.arange(int(torch.tensor(shape).prod()), dtype=dtype) + 100 * rank).reshape(shape)


def _multidim():
    rank, world = bc.get_rank(), bc.get_world_size()
    out = {}
    # allgather: [n] -> [world, n], and [2, n] -> [world, 2, n]
    recv = torch.zeros(world, N)
    bc.allgather(_mine(rank, (N,)), recv)
    out["allgather"] = recv
    recv3 = torch.zeros(world, 2, N)
    bc.allgather(_mine(rank, (2, N)), recv3)
    out["allgather3"] = recv3
    # gather [n] into [world, n] on rank 0
    g = torch.zeros(world, N) if rank == 0 else None
    bc.gather(_mine(rank, (N,)), g, 0)
    out["gather"] = g
    # scatter [world, n] from rank 1 into [n]
    s = _mine(rank, (world, N)) if rank == 1 else None
    r = torch.zeros(N)
    bc.scatter(s, r, 1)
    out["scatter"] = r
    # reduce_scatter [world, n] -> [n] and [2, n] -> [1, n]-shaped
    rs = torch.zeros(N)
    bc.reduce_scatter(_mine(rank, (world, N)), rs)
    out["reduce_scatter"] = rs
    rs2 = torch.zeros(1, N)
    bc.reduce_scatter(_mine(rank, (2, N)), rs2, bc.ReduceOp.MAX)
    out["reduce_scatter_max"] = rs2
    a = torch.zeros(world, N)
    bc.alltoall(_mine(rank, (world, N)), a)
    out["alltoall"] = a
    return out


def test_multidim_buffers_match_flat_reference():
    res = run_ranks(_multidim, 2, timeout=60)
    world = 2
    for rank, out in enumerate(res):
        flat = [_mine(r, (N,)) for r in range(world)]
        torch.testing.assert_close(out["allgather"], torch.stack(flat), rtol=0, atol=0)
        torch.testing.assert_close(out["allgather3"],
                                   torch.stack([_mine(r, (2, N)) for r in range(world)]),
                                   rtol=0, atol=0)
        if rank == 0:
            torch.testing.assert_close(out["gather"], torch.stack(flat), rtol=0, atol=0)
        torch.testing.assert_close(out["scatter"], _mine(1, (world, N))[rank], rtol=0, atol=0)
        total = sum(_mine(r, (world, N)) for r in range(world))
        torch.testing.assert_close(out["reduce_scatter"], total[rank], rtol=0, atol=0)
        biggest = torch.maximum(_mine(0, (2, N)), _mine(1, (2, N)))
        torch.testing.assert_close(out["reduce_scatter_max"], biggest[rank:rank + 1],
                                   rtol=0, atol=0)
        torch.testing.assert_close(out["alltoall"],
                                   torch.stack([_mine(r, (world, N))[rank]
                                                for r in range(world)]), rtol=0, atol=0)


def _inplace_multidim():
    """The ``*_inplace`` primitives and alltoall_v count elements, whatever the shape (they
    sliced dimension 0: gather_inplace wrote wrong values, scatter_inplace left a peer
    hanging, allgather_inplace refused valid input, alltoall_v raised from torch)."""
    rank = bc.get_rank()
    out = {}
    x = _mine(rank, (4, 2))
    bc.gather_inplace(x, 2, 0)                 # 2 elements per rank, not 2 rows
    out["gather_inplace"] = x.reshape(-1)
    x = _mine(rank, (2, 4))
    bc.scatter_inplace(x, 2, 0)
    out["scatter_inplace"] = x.reshape(-1)
    x = _mine(rank, (3, 2))
    bc.allgather_inplace(x)
    out["allgather_inplace"] = x.reshape(-1)
    x = _mine(rank, (1, 4))
    bc.reduce_scatter_inplace(x)
    out["reduce_scatter_inplace"] = x.reshape(-1)
    # rank 0 keeps 1 element and sends 3; rank 1 sends 3 and keeps 1
    counts, displs = ([1, 3], [0, 1]) if rank == 0 else ([3, 1], [0, 3])
    y = torch.zeros(2, 2)
    bc.alltoall_v(_mine(rank, (2, 2)), counts, displs, y, counts, displs)
    out["alltoall_v"] = y.reshape(-1)
    return out


def test_inplace_primitives_and_alltoall_v_count_elements_whatever_the_shape():
    r0, r1 = run_ranks(_inplace_multidim, 2, timeout=60)
    flat = [_mine(r, (8,)) for r in range(2)]
    assert r0["gather_inplace"].tolist() == [0, 1, 102, 103, 4, 5, 6, 7]
    assert r1["gather_inplace"].tolist() == flat[1].tolist()          # not the root
    assert r0["scatter_inplace"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert r1["scatter_inplace"].tolist() == [100, 101, 2, 3, 104, 105, 106, 107]
    for r in (r0, r1):
        assert r["allgather_inplace"].tolist() == [0, 1, 2, 103, 104, 105]
    assert r0["reduce_scatter_inplace"].tolist() == [100, 102, 2, 3]
    assert r1["reduce_scatter_inplace"].tolist() == [100, 101, 104, 106]
    assert r0["alltoall_v"].tolist() == [0, 100, 101, 102]
    assert r1["alltoall_v"].tolist() == [1, 2, 3, 103]
