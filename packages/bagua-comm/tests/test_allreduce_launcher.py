"""bagua_comm.allreduce_launcher: a buffer reduced again and again, checked once (issue #46).
Against numpy, on 2 gloo ranks: every op and float dtype (gloo's own collective where it runs
natively, the primitive's path for AVG and 16-bit floats), repeated calls, the traffic it
records (the same as allreduce_inplace's), and bad input refused when it is made."""

import numpy as np
import pytest
import torch

import bagua_comm as bc
from bagua_comm.testing import run_ranks

Op = bc.ReduceOp
N = 8


def _np(rank, n=N):
    return (np.arange(n) * (rank + 1) + 3 * rank) % 5 + 1


def _rank():
    me = bc.get_rank()
    out = []
    for dtype in (torch.float32, torch.float64, torch.float16, torch.int64):
        for op in (Op.SUM, Op.MAX, Op.AVG):
            if op is Op.AVG and not dtype.is_floating_point:
                continue
            buf = torch.tensor(_np(me), dtype=dtype)
            start = bc.allreduce_launcher(buf, op)
            bc.traffic.reset()
            got = []
            for _ in range(3):          # the same buffer, refilled, started again
                buf.copy_(torch.tensor(_np(me), dtype=dtype))
                handle = start()
                handle.wait()
                got.append(buf.double().numpy().copy())
            sent = bc.traffic.bytes_sent("allreduce")
            bc.traffic.reset()
            bc.allreduce_inplace(torch.tensor(_np(me), dtype=dtype), op)
            out.append((str(dtype), op.name, got, sent, bc.traffic.bytes_sent("allreduce"),
                        type(start).__module__))
    bad = []
    for make in (lambda: bc.allreduce_launcher(torch.zeros(4, 2).t(), Op.SUM),
                 lambda: bc.allreduce_launcher(torch.zeros(4, dtype=torch.int32), Op.AVG),
                 lambda: bc.allreduce_launcher([1.0], Op.SUM)):
        try:
            make()
        except ValueError as err:
            bad.append(str(err))
    return out, bad


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, 2, timeout=120)


def test_results_match_numpy_on_every_call(results):
    stack = np.stack([_np(0), _np(1)])
    expected = {"SUM": stack.sum(0), "MAX": stack.max(0), "AVG": stack.mean(0)}
    for out, _ in results:
        for dtype, op, got, _sent, _ref, _ in out:
            for g in got:
                np.testing.assert_array_equal(g, expected[op], err_msg=f"{dtype} {op}")


def test_traffic_is_the_primitives_and_gloo_native_ops_run_compiled(results):
    for out, _ in results:
        for dtype, op, _got, sent, ref, module in out:
            assert sent == 3 * ref > 0, (dtype, op)
            native = op != "AVG" and dtype not in ("torch.float16", "torch.bfloat16")
            assert (module == "bagua_comm._launch") == native, (dtype, op, module)


def test_bad_input_is_refused_when_made(results):
    for _, bad in results:
        assert len(bad) == 3
        assert "contiguous" in bad[0] and "AVG" in bad[1] and "torch.Tensor" in bad[2]
