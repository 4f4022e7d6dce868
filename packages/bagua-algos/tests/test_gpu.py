"""GPU: bucket communication runs on a side stream ordered after the gradients, with no host
synchronisation, and the compute stream waits for it at the end of backward."""

import pytest
import torch

import bagua_comm as bc
from bagua_algos import Algorithm, AlgorithmImpl, with_bagua
from bagua_comm.testing import run_ranks


class _Double(Algorithm, name="test_gpu_double"):
    def reify(self, group):
        return _DoubleImpl(group)


class _DoubleImpl(AlgorithmImpl):
    def bucket_ready_hook(self, module, bucket):
        self.streams = getattr(self, "streams", set())
        self.streams.add(torch.cuda.current_stream().cuda_stream)
        torch.cuda._sleep(1_000_000)          # a slow "collective" on the side stream
        bucket.grad.mul_(2)
        return None


def _side_stream_doubles_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8)).cuda()
    ref = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(32, 64, device="cuda")
    wrapped = with_bagua(model, [], _Double(), bucket_size=4096)
    wrapped(x).square().sum().backward()
    got = [p.grad.clone() for p in model.parameters()]    # compute stream: must see x2
    ref_model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 8)).cuda()
    with torch.no_grad():
        for p, r in zip(ref_model.parameters(), ref):
            p.copy_(r)
    ref_model(x).square().sum().backward()
    ok = all(torch.allclose(g, 2 * p.grad) for g, p in zip(got, ref_model.parameters()))
    main = torch.cuda.current_stream().cuda_stream
    return ok, main not in wrapped.impl.streams, bc.get_world_size()


@pytest.mark.gpu
def test_bucket_communication_runs_on_a_side_stream_after_the_gradients():
    ok, side, _ = run_ranks(_side_stream_doubles_gradients, 1)[0]
    assert ok and side
