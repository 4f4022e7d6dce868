"""One replica of the fault-tolerance scenarios (tests/test_ft.py, benchmarks/ft/ft.py).

Writes one JSON line per step to --log and, with --dump, torch.save files of its full state:
``sent-<step>.pt`` when it serves a joining peer, ``healed-<step>.pt`` right after it healed,
``end.pt`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch

import bagua_algos as ba
from bagua_algos.ft import FaultTolerant
from bagua_data import LoadBalancingDistributedSampler

ALGOS = {"gradient_allreduce": lambda opt: ba.GradientAllReduce(),
         "bytegrad": lambda opt: ba.ByteGrad(error_feedback=True),
         "decentralized": lambda opt: ba.Decentralized(),
         "decentralized_shift_one": lambda opt: ba.Decentralized(peer_selection_mode="shift_one"),
         "low_precision_decentralized": lambda opt: ba.LowPrecisionDecentralized(),
         "qadam": lambda opt: ba.QAdam(opt),
         "local_sgd": lambda opt: ba.LocalSGD(sync_every=2),
         "diloco": lambda opt: ba.DiLoCo(sync_every=2),
         "diloco_fragments": lambda opt: ba.DiLoCo(sync_every=4, fragments=2, overlap_steps=1),
         "topk": lambda opt: ba.TopK(density=0.1),
         "low_rank": lambda opt: ba.LowRank(rank=2)}


def build(args):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(args.hidden, 1))
    if args.shape_bug:
        model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden + 1), torch.nn.Tanh(),
                                    torch.nn.Linear(args.hidden + 1, 1))
    if args.variant == "double":
        model = model.double()
    if args.algo == "qadam":
        opt = ba.QAdamOptimizer(model.parameters(), lr=1e-2, warmup_steps=2)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.samples, 16, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    data = torch.utils.data.TensorDataset(x, y, torch.arange(args.samples))
    sampler = LoadBalancingDistributedSampler(data, [float(i % 7) for i in range(args.samples)],
                                              num_replicas=1, rank=0, seed=3)
    return model, opt, sched, (data, sampler, args.batch)


def wait_for(path, limit=120.0):
    end = time.time() + limit
    while not os.path.exists(path):
        if time.time() > end:
            raise TimeoutError(f"{path} did not appear within {limit} s")
        time.sleep(0.01)


def sync(args):
    if args.sync_dir:
        open(os.path.join(args.sync_dir, f"ready-{args.tag}"), "w").close()
        wait_for(os.path.join(args.sync_dir, f"go-{args.tag}"))


def fail_heal(ft, n):
    """The first ``n`` heal transfers to this replica fail as a reset connection would
    (while the sender lives)."""
    transport = ft.manager._checkpoint_transport
    recv = transport.recv_checkpoint
    left = [n]

    def failing_recv(*a, **kw):
        if left[0] > 0:
            left[0] -= 1
            raise ConnectionResetError("injected: the heal transfer was reset")
        return recv(*a, **kw)
    transport.recv_checkpoint = failing_recv


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--replica-id", required=True)
    p.add_argument("--algo", default="bytegrad")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kill-at", type=int, default=-1, help="SIGKILL itself in this step")
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--shape-bug", action="store_true")
    p.add_argument("--secret", default=None, help="the job's secret (default: BAGUA_FT_SECRET)")
    p.add_argument("--variant", choices=("", "double", "sync_every"), default="",
                   help="the same shapes, another dtype (double) or other DiLoCo/LocalSGD "
                        "settings (sync_every=4)")
    p.add_argument("--log", required=True)
    p.add_argument("--dump", default="")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--sync-dir", default="", help="write ready-<tag> there, then wait for go-<tag>")
    p.add_argument("--tag", default="")
    p.add_argument("--connect-after-go", action="store_true",
                   help="join the Lighthouse only once go-<tag> is there (a replica that joins)")
    p.add_argument("--hold-at", type=int, default=-1,
                   help="before this step, wait for <sync-dir>/release")
    p.add_argument("--fail-heals", type=int, default=0,
                   help="the first N heal transfers to this replica fail (a reset connection)")
    args = p.parse_args()
    from datetime import timedelta
    model, opt, sched, data = build(args)
    if args.connect_after_go:
        sync(args)
    algorithm = ALGOS[args.algo](opt)
    if args.variant == "sync_every":
        algorithm = type(algorithm)(sync_every=4)
    ft = FaultTolerant(model, opt, algorithm, lighthouse=args.lighthouse,
                       replica_id=args.replica_id, scheduler=sched, data=data,
                       timeout=timedelta(seconds=args.timeout), secret=args.secret)
    if args.fail_heals:
        fail_heal(ft, args.fail_heals)
    if args.sync_dir:
        open(os.path.join(args.sync_dir, f"connected-{args.tag}"), "w").close()
    if args.dump:
        send = ft._send

        def recording_send():
            state = send()
            torch.save(state, os.path.join(
                args.dump, f"sent-{ft.committed_steps}.pt"))
            return state
        ft._send = recording_send
        receive = ft._receive

        def recording_receive(state):
            torch.save(state, os.path.join(args.dump, "received.pt"))
            receive(state)
        ft._receive = recording_receive
    log = open(args.log, "a", buffering=1)  # noqa: SIM115 (lines must reach the file as written)
    if not args.connect_after_go:
        sync(args)
    heals = generation = 0
    while ft.committed_steps < args.steps:
        if args.sync_dir and os.path.exists(os.path.join(args.sync_dir, "stop")):
            break
        if ft.committed_steps == args.hold_at:
            wait_for(os.path.join(args.sync_dir, "release"))
            args.hold_at = -1
        opt.zero_grad()
        t0 = time.time()
        with ft.step() as step:
            if len(ft.heal_times) > heals:
                heals = len(ft.heal_times)
            if ft._generation != generation:
                generation = ft._generation
                if args.dump:
                    torch.save(ft.state_dict(), os.path.join(
                        args.dump, f"quorum-{ft.committed_steps}-{ft.world_size}.pt"))
            x, y, idx = step.batch
            if ft.committed_steps == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            loss = torch.nn.functional.mse_loss(ft.model(x), y)
            loss.backward()
            if args.step_sleep:
                time.sleep(args.step_sleep)
        log.write(json.dumps({"t0": t0, "t": time.time(), "step": ft.committed_steps,
                              "committed": step.committed, "world": ft.world_size,
                              "loss": float(loss), "indices": idx.tolist(),
                              "epoch": ft.data.sampler.epoch,
                              "heal_s": ft.heal_times[-1] if heals else None,
                              "error": None if step.error is None else str(step.error)[:200]})
                  + "\n")
    if args.dump:
        torch.save(ft.state_dict(), os.path.join(args.dump, "end.pt"))
    ft.close()


if __name__ == "__main__":
    main()
