"""bagua_comm.compressed_allreduce_launcher (issue #46): a compressed allreduce of the same
buffers started again and again, checked once, compiled for MinMaxUInt8 on gloo.  Against a
numpy simulation of scatter-reduce-gather (``minmax_ref``) and against ``compressed_allreduce``
through its general Python path (a MinMaxUInt8 subclass takes it), bit for bit: 2 and 3 ranks,
sizes with and without padding, float32/float16/bfloat16, SUM/AVG/MIN/MAX, repeated calls,
in place and not; no Python function call per launch, on the caller's thread or the
worker's; FIFO order with the group's other compressed collectives; traffic; bad input."""

import sys
import threading

import minmax_ref as ref
import numpy as np
import pytest
import torch

import bagua_comm as bc
from bagua_comm.compression import MinMaxUInt8
from bagua_comm.testing import run_ranks

Op = bc.ReduceOp
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
OPS = {"sum": Op.SUM, "avg": Op.AVG, "min": Op.MIN, "max": Op.MAX}


class _General(MinMaxUInt8):
    """The same format through compressed_allreduce's general (Python) path."""


def _x(rank, numel, dtype, call=0):
    g = torch.Generator().manual_seed(100 * call + 7 * rank + numel)
    return (torch.randn(numel, generator=g) * (rank + 1) + call).to(dtype)


def _round(x32, dtype):
    return torch.from_numpy(x32).to(DTYPES[dtype]).float().numpy()


def _simulate(inputs, dtype, chunks, op):
    """Every rank's result, computed in one process: numpy format, float32 reduction in rank
    order, torch only to round to a 16-bit type."""
    n = len(inputs)
    k = chunks // n
    numel = inputs[0].size
    seg = -(-numel // chunks) * k
    padded = seg * n
    xs = [np.concatenate([x, np.zeros(padded - numel, np.float32)]) for x in inputs]
    payloads = [ref.compress(x, dtype, chunks) for x in xs]
    part = payloads[0].size // n
    owns = []
    for j in range(n):
        received = np.concatenate([p[j * part:(j + 1) * part] for p in payloads])
        rows = ref.decompress(received, dtype, padded, chunks).reshape(n, seg)
        mine = rows[0].copy()
        for row in rows[1:]:
            mine = {"min": np.minimum, "max": np.maximum}.get(op, np.add)(mine, row)
        if op == "avg":
            mine = mine / np.float32(n)
        owns.append(ref.compress(_round(mine, dtype), dtype, k))
    return _round(ref.decompress(np.concatenate(owns), dtype, padded, chunks)[:numel], dtype)


def _cases(n):
    # 1000 and 1001 elements: one needs no padding at 2 ranks x 1 or 2 chunks, one does
    for numel in (1000, 1001):
        for k in (1, 2):
            for dtype in DTYPES:
                for op in OPS:
                    yield numel, k * n, dtype, op


def _rank():
    me, n = bc.get_rank(), bc.get_world_size()
    out = {}
    for i, (numel, chunks, dtype, op) in enumerate(_cases(n)):
        dt = DTYPES[dtype]
        send = torch.empty(numel, dtype=dt)
        recv = send if i % 2 else torch.empty(numel, dtype=dt)      # in place, or not
        start = bc.compressed_allreduce_launcher(send, recv, OPS[op], MinMaxUInt8(chunks),
                                                 key=f"case{i}")
        got = []
        for call in range(2):       # the same buffers, refilled, started again
            send.copy_(_x(me, numel, dt, call))
            bc.traffic.reset()
            start().wait()
            got.append((recv.float().numpy().copy(), bc.traffic.bytes_sent()))
        plain, general = torch.empty(numel, dtype=dt), torch.empty(numel, dtype=dt)
        bc.traffic.reset()
        bc.compressed_allreduce(_x(me, numel, dt, 1), plain, OPS[op], MinMaxUInt8(chunks))
        sent = bc.traffic.bytes_sent()
        bc.compressed_allreduce(_x(me, numel, dt, 1), general, OPS[op], _General(chunks))
        out[(numel, chunks, dtype, op)] = (got, plain.float().numpy(), general.float().numpy(),
                                           sent, type(start).__name__)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_results_equal_numpy_and_the_general_path_bit_for_bit(world):
    results = run_ranks(_rank, world, timeout=240)
    for case in _cases(world):
        numel, chunks, dtype, op = case
        expected = [_simulate([_x(r, numel, DTYPES[dtype], call).float().numpy()
                               for r in range(world)], dtype, chunks, op) for call in (0, 1)]
        for r in range(world):
            got, plain, general, sent, kind = results[r][case]
            assert kind == "CompressedLauncher", case
            for call in (0, 1):
                assert np.array_equal(got[call][0], expected[call], equal_nan=True), \
                    (r, case, call)
                assert got[call][1] == sent, (r, case)        # the primitive's traffic
            assert np.array_equal(plain, expected[1]), (r, case)
            assert np.array_equal(general, expected[1]), (r, case)


def _no_python_and_order():
    me = bc.get_rank()
    ons = [False]
    calls = []

    def prof(frame, event, _arg):
        if event == "call" and ons[0]:
            calls.append(frame.f_code.co_name)

    def entry(frame, event, arg):
        sys.setprofile(prof)
        prof(frame, event, arg)

    threading.setprofile(entry)       # before the new group's worker thread starts
    g = bc.new_group(list(range(bc.get_world_size())))
    bufs = [torch.empty(4096) for _ in range(3)]
    starts = [bc.compressed_allreduce_launcher(b, b, group=g) for b in bufs]
    ef = bc.compressed_allreduce_launcher(torch.ones(64), torch.empty(64),
                                          compressor=MinMaxUInt8(2, error_feedback=True),
                                          group=g)
    ef().wait()
    counted = {}
    sys.setprofile(prof)
    for name in ("compiled", "general"):
        for i, b in enumerate(bufs):
            b.copy_(_x(me, 4096, torch.float32, i))
        ons[0] = True
        if name == "compiled":      # written out: no Python function of the test's own
            h0, h1, h2 = starts[0](), starts[1](), starts[2]()
            h0.wait()
            h1.wait()
            h2.wait()
        else:
            ef().wait()
        ons[0] = False
        counted[name] = list(calls)
        calls.clear()
    sys.setprofile(None)
    threading.setprofile(None)
    # FIFO with the group's other compressed collectives: launches and calls interleaved
    ys = [torch.empty(4096) for _ in range(2)]
    for i, b in enumerate(bufs):
        b.copy_(_x(me, 4096, torch.float32, i))
    hs = [starts[0](), bc.compressed_allreduce(_x(me, 4096, torch.float32, 3), ys[0],
                                               group=g, async_op=True),
          starts[1](), starts[2](),
          bc.compressed_allreduce(_x(me, 4096, torch.float32, 4), ys[1], group=g,
                                  async_op=True)]
    for h in hs:
        h.wait()
    order = [b.numpy().copy() for b in bufs] + [y.numpy() for y in ys]
    bad = []
    for make in (lambda: bc.compressed_allreduce_launcher(torch.ones(8), torch.empty(8),
                                                          compressor=MinMaxUInt8(3), group=g),
                 lambda: bc.compressed_allreduce_launcher(torch.ones(8), torch.empty(9),
                                                          group=g)):
        try:
            make()
        except ValueError as err:
            bad.append(str(err))
    g.destroy()
    try:
        starts[0]()
        closed = None
    except RuntimeError as err:
        closed = str(err)
    return counted, order, bad, closed


def test_a_launch_runs_no_python_and_keeps_the_groups_order():
    for counted, order, bad, closed in run_ranks(_no_python_and_order, 2, timeout=120):
        assert counted["compiled"] == [], counted     # 3 launches and waits, both threads
        assert "_run" in counted["general"], counted  # (the counter sees the worker thread)
        for i, got in enumerate(order):
            inputs = [_x(r, 4096, torch.float32, i).numpy() for r in range(2)]
            assert np.array_equal(got, _simulate(inputs, "float32", 2, "avg")), i
        assert "compressor.chunks (3)" in bad[0] and "size mismatch" in bad[1], bad
        assert closed is not None and "closed" in closed


def test_the_worker_completes_a_torch_future_with_the_value_or_the_error():
    from bagua_comm._worker import Worker

    w = Worker("test-worker")
    ok, bad = torch._C.Future([]), torch._C.Future([])
    value = torch.ones(3)
    w.submit(lambda: None, ok, value).wait()

    def fail():
        raise ValueError("job failed")

    with pytest.raises(ValueError, match="job failed"):
        w.submit(fail, bad, value).wait()
    w.close()
    assert ok.wait() is value
    with pytest.raises(ValueError, match="job failed"):
        bad.wait()
    with pytest.raises(RuntimeError, match="closed"):
        w.submit(lambda: None)
