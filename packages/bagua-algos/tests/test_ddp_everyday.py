"""A DDP user's everyday training loops, run with torch DDP and with
``with_bagua(..., GradientAllReduce())`` on the same seeds (2 gloo ranks): the parameters, the
optimizer state and the GradScaler's scale after every scenario equal DDP's bit for bit
(docs/design.md §5, "DDP parity").  The same loops with the compressing algorithms set to lose
nothing: TopK sending every entry equals DDP bit for bit too, LowRank at full rank up to
rounding; so what the loops exercise around the compression (buffers, unused parameters,
GradScaler, accumulation, several optimizers) is DDP's."""

import pytest
import torch
from _common import batch, make_model
from torch.nn.parallel import DistributedDataParallel as DDP

import bagua_comm as bc
from bagua_algos import GradientAllReduce, LowRank, TopK, with_bagua
from bagua_comm.testing import run_ranks

STEPS = 5
SCENARIOS = ("sgd", "adamw", "no_sync", "clip", "two_optimizers", "grad_scaler",
             "eval_between", "zero_grad_keep", "small_buckets", "lr_scheduler", "batchnorm",
             "two_forwards", "no_sync_bn", "eval_between_bn")


def _model(scenario):
    model = make_model(seed=3)
    if scenario in ("batchnorm", "two_forwards", "no_sync_bn", "eval_between_bn"):
        # running statistics: DDP broadcasts rank 0's each forward
        torch.manual_seed(4)
        model.insert(1, torch.nn.BatchNorm1d(model[0].out_features))
    return model


def _optimizers(model, scenario):
    ps = list(model.parameters())
    if scenario == "adamw":
        return [torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)]
    if scenario == "two_optimizers":
        return [torch.optim.SGD(ps[:4], lr=0.05, momentum=0.9),
                torch.optim.Adam(ps[4:], lr=1e-2)]
    return [torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3)]


# lossless settings: every entry sent; rank 12 >= every matrix's smaller side (_common's model)
ALGORITHMS = {"gradient_allreduce": GradientAllReduce,
              "topk_dense": lambda: TopK(density=1.0),
              "low_rank_full": lambda: LowRank(rank=12, min_compression_rate=0.0)}
ATOL = {"gradient_allreduce": 0.0, "topk_dense": 0.0, "low_rank_full": 1e-6}


def _run(wrapper, scenario, algorithm="gradient_allreduce"):
    rank = bc.get_rank()
    model = _model(scenario)
    opts = _optimizers(model, scenario)
    if wrapper == "ddp":
        net = DDP(model, bucket_cap_mb=0.0005 if scenario == "small_buckets" else 25)
    else:
        net = with_bagua(model, opts, ALGORITHMS[algorithm](),
                         bucket_size=256 if scenario == "small_buckets" else None)
    sched = (torch.optim.lr_scheduler.StepLR(opts[0], step_size=2, gamma=0.5)
             if scenario == "lr_scheduler" else None)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scenario == "grad_scaler" else None
    evals = []
    for step in range(STEPS):
        for o in opts:
            o.zero_grad(set_to_none=scenario != "zero_grad_keep")
        if scenario.startswith("no_sync"):       # with BatchNorm: DDP broadcasts the
            # buffers in the cycle's first forward (the one after a synchronised forward)
            x, y = batch(step, rank, micro=1)
            with net.no_sync():
                torch.nn.functional.mse_loss(net(x), y).backward()
        x, y = batch(step, rank)
        loss = torch.nn.functional.mse_loss(net(x), y)
        if scenario == "two_forwards":      # a second forward before the one backward: its
            # buffer broadcast must not bump the version of what the first saved for backward
            loss = loss + net(batch(700 + step, rank)[0]).square().mean()
        if scaler is not None:
            if step == 2 and rank == 1:
                loss = loss * float("inf")          # an overflow on one rank: both skip
            scaler.scale(loss).backward()
            for o in opts:
                scaler.step(o)
            scaler.update()
            continue
        loss.backward()
        if scenario == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        for o in opts:
            o.step()
        if sched is not None:
            sched.step()
        if scenario.startswith("eval_between"):  # with BatchNorm: DDP's evaluation forward
            net.eval()                          # after a step runs on rank 0's statistics
            with torch.no_grad():
                evals.append(net(batch(500 + step, rank)[0]))
            net.train()
    state = {"params": [p.detach().clone() for p in model.parameters()],
             "eval": evals,
             "buffers": [b.detach().clone() for b in model.buffers()],
             "optim": [o.state_dict()["state"] for o in opts],
             "scale": None if scaler is None else scaler.get_scale()}
    if wrapper != "ddp":
        net.detach_algorithm()
    return state


def _all_runs():
    out = {}
    for s in SCENARIOS:
        ddp = _run("ddp", s)
        for a in ALGORITHMS:
            out[a, s] = (ddp, _run("bagua", s, a))
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_all_runs, 2, timeout=300)


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        return {k2: v2 for k, v in obj.items() for k2, v2 in _flat(v, f"{prefix}/{k}").items()}
    if isinstance(obj, (list, tuple)):
        return {k2: v2 for i, v in enumerate(obj) for k2, v2 in _flat(v, f"{prefix}/{i}").items()}
    return {prefix: obj}


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_everyday_loop_equals_ddp_bit_for_bit(runs, scenario, algorithm):
    atol = ATOL[algorithm]
    for rank, per_rank in enumerate(runs):
        ddp, ours = (_flat(s) for s in per_rank[algorithm, scenario])
        assert ddp.keys() == ours.keys()
        for k, a in ddp.items():
            b = ours[k]
            if isinstance(a, torch.Tensor):
                diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
                assert (torch.equal(a, b) if atol == 0 else diff <= atol), (
                    f"rank {rank}, {algorithm}, {scenario}: {k} differs from DDP by {diff:.3g}")
            else:
                assert a == b, f"rank {rank}, {scenario}: {k}: DDP {a!r}, bagua {b!r}"
    # the scenarios are not vacuous: training moved the parameters away from the start
    start = _model(scenario)
    moved = [not torch.equal(p, q)
             for p, q in zip(start.parameters(), runs[0][algorithm, scenario][1]["params"])]
    assert all(moved), moved


def _two_models(wrapper):
    """A GAN-shaped loop: two wrapped models, each with its own optimizer, the second fed the
    first's detached output, both stepped every iteration."""
    rank = bc.get_rank()
    g, d = make_model(seed=5), make_model(seed=6)
    d[0] = torch.nn.Linear(1, d[0].out_features)          # d reads g's 1-wide output
    og = torch.optim.Adam(g.parameters(), lr=1e-2)
    od = torch.optim.SGD(d.parameters(), lr=0.05, momentum=0.9)
    if wrapper == "ddp":
        wg, wd = DDP(g), DDP(d)
    else:
        wg, wd = with_bagua(g, [og], GradientAllReduce()), with_bagua(d, [od], GradientAllReduce())
    for step in range(STEPS):
        x, y = batch(step, rank)
        od.zero_grad()
        torch.nn.functional.mse_loss(wd(wg(x).detach()), y).backward()
        od.step()
        og.zero_grad()
        (wg(x) - y).pow(2).mean().backward()
        og.step()
    if wrapper != "ddp":
        wg.detach_algorithm()
        wd.detach_algorithm()
    return [p.detach().clone() for m in (g, d) for p in m.parameters()]


def _two_model_runs():
    return _two_models("ddp"), _two_models("bagua")


def test_two_wrapped_models_in_one_loop_equal_ddp():
    for ddp, ours in run_ranks(_two_model_runs, 2, timeout=120):
        assert len(ddp) == len(ours)
        for a, b in zip(ddp, ours):
            assert torch.equal(a, b)
