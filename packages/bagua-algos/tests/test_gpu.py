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


# -- TopK's and LowRank's exchanges on CUDA against the same code on CPU ------------------------
# At one rank with_bagua exchanges nothing (there is nobody to reduce with), so these call the
# algorithms' exchange functions directly on a one-rank group: gloo on CPU tensors, NCCL on
# CUDA tensors, three steps each so that error feedback (and LowRank's warm start) carries over.

def _sparse_algorithm(name):
    from bagua_algos import LowRank, TopK
    from bagua_comm.compression import MinMaxUInt4, MinMaxUInt8

    return {"topk": lambda: TopK(density=0.1),
            "topk_u8": lambda: TopK(density=0.1, compressor=MinMaxUInt8(1)),
            "topk_u4": lambda: TopK(density=0.1, compressor=MinMaxUInt4(1)),
            "low_rank": lambda: LowRank(rank=2, min_compression_rate=0)}[name]()


def _exchanged(name, device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 8)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = with_bagua(model, [opt], _sparse_algorithm(name), bucket_size=4096)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1)).to(device)
    wrapped(x).square().sum().backward()
    impl, out = wrapped.impl, []
    g = torch.Generator().manual_seed(7)
    for _step in range(3):
        for b in wrapped.buckets:
            # the same gradients on both devices (a backward on each would round differently)
            t = (b.grad_and_flags if name == "low_rank" else b.grad).detach().clone()
            t[:b.grad.numel()] = torch.randn(b.grad.numel(), generator=g).to(device)
            if name == "low_rank":
                impl.exchange(t, impl.plans[b.index], b.name)
            else:
                impl.exchange(t, b.index, impl.group)
            out.append(t.cpu())
        impl.post_backward_hook(wrapped)
    if device == "cuda":
        torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["topk", "topk_u8", "topk_u4", "low_rank"])
def test_sparse_and_low_rank_exchanges_on_cuda_equal_cpu(name):
    cpu = run_ranks(_exchanged, 1, args=(name, "cpu"), timeout=300)[0]
    gpu = run_ranks(_exchanged, 1, args=(name, "cuda"), backend="nccl", timeout=300)[0]
    assert len(cpu) == len(gpu) > 0
    for a, b in zip(cpu, gpu):
        assert torch.isfinite(b).all()
        if name == "low_rank":      # matrix products and QR round differently on the GPU
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()
        else:                       # the same top-k, the same bytes, the same sums
            assert (b != 0).sum() < b.numel() / 2   # sparsified
            assert torch.equal(a, b), (a - b).abs().max()
