"""GPU stream ordering, checked on CPU through tests/_stream_model.py (issue 46).

- AsyncModelAverage: the averaging thread snapshots the weights on its own stream; the lock
  around the optimizer step orders the host only, so the next step's kernels on the training
  stream must also wait, on the GPU, for the snapshot's reads (else the step may overwrite
  weights the snapshot has not read yet).  The averaging thread's collectives are slowed down
  here so that training steps land between a snapshot and its average, as on a GPU.
- Decentralized and hierarchical DiLoCo run blocking chains of collectives on a runner
  thread: that thread must not enqueue anything on the training stream (the NCCL backend's
  "caller" events and waits would otherwise land in the middle of the next forward and
  backward, which then queue behind the exchange); the training stream waits for an exchange
  only where its result is consumed.  These run through the NCCL backend's code path over
  ``bagua_comm.testing_nccl``'s fake communicator.
"""

import threading
import time

import pytest
import torch
from _common import batch, loss_fn, make_model

import bagua_comm as bc
from bagua_algos import AsyncModelAverage, Decentralized, DiLoCo, with_bagua
from bagua_comm.testing import run_ranks


def _async_job(steps):
    from _stream_model import StreamModel

    from bagua_algos.algorithms import async_model_average as amod

    model_ = StreamModel().install()
    amod.on_gpu = lambda device: device is not None      # CPU weights, the GPU code path
    original = bc.allreduce_inplace

    def slow_in_the_averaging_thread(*args, **kwargs):
        if threading.current_thread().name == "bagua-async-average":
            time.sleep(0.004)              # a step lands between a snapshot and its average
        return original(*args, **kwargs)

    amod.bc = type("bc", (), {k: getattr(bc, k) for k in dir(bc) if not k.startswith("__")})
    amod.bc.allreduce_inplace = staticmethod(slow_in_the_averaging_thread)
    rank = bc.get_rank()
    net = make_model(rank)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with model_.recording():
        wrapped = with_bagua(net, [opt], AsyncModelAverage(sync_interval_ms=1))
        impl = wrapped.impl
        model_.watch([b.weight for b in impl.buckets] + list(impl.pending))
        for step in range(steps):
            opt.zero_grad()
            loss_fn(wrapped, *batch(step, rank)).backward()
            opt.step()
            time.sleep(0.002)
        wrapped.abort()
    rounds = impl.rounds
    wrapped.detach_algorithm()
    return sorted(set(model_.races)), model_.foreign, rounds


def test_async_snapshot_is_ordered_before_the_next_steps_writes():
    for races, foreign, rounds in run_ranks(_async_job, 2, args=(30,), timeout=240):
        assert rounds > 0
        assert races == [], races[:3]
        assert foreign == [], foreign[:3]


CASES = {   # name: (algorithm, ranks, ranks per node); hierarchical runs flat on one node
    "decentralized": (lambda: Decentralized(hierarchical=False), 2, 2),
    "diloco-hierarchical": (lambda: DiLoCo(sync_every=2, hierarchical=True), 4, 2),
}


def _exchange_job(case, steps):
    from _stream_model import StreamModel

    from bagua_comm.testing_nccl import use_fake_nccl

    use_fake_nccl(timeout=10.0)
    model_ = StreamModel().install()
    rank = bc.get_rank()
    net = make_model(rank + 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with model_.recording():
        wrapped = with_bagua(net, [opt], CASES[case][0]())
        model_.watch(p for p in net.parameters())
        for step in range(steps):
            opt.zero_grad()
            loss_fn(wrapped, *batch(step, rank)).backward()
            opt.step()
        wrapped.impl.shutdown()
    ran = model_.enqueuers
    return sorted(set(model_.races)), sorted(set(model_.foreign)), sorted(ran)


@pytest.mark.parametrize("case", list(CASES))
def test_exchange_leaves_the_training_stream_to_the_training_thread(case):
    _, world, per_node = CASES[case]
    for races, foreign, ran in run_ranks(_exchange_job, world, args=(case, 4), timeout=300,
                                         local_world_size=per_node):
        # the exchange ran, from the runner's thread, on some stream
        assert any(thread.startswith("bagua-") for thread, _ in ran), ran
        assert foreign == [], foreign
        assert races == [], races[:3]
