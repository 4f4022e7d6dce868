"""One replica of benchmarks/ft/ft.py's peer: torchft's own DDP + OptimizerWrapper + Manager on
the same model and optimizer as tests/_ft_worker.py (its batches are per-replica random
draws: torchft has no sampler position to carry)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--replica-id", required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--log", required=True)
    p.add_argument("--dump", default="")
    p.add_argument("--sync-dir", default="")
    p.add_argument("--tag", default="")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--kill-at", type=int, default=-1, help="SIGKILL itself in this step")
    p.add_argument("--fail-heals", type=int, default=0,
                   help="the first N heal transfers to this replica fail (a reset connection)")
    p.add_argument("--die-in-configure", type=int, default=0,
                   help="SIGKILL itself inside the configure of a join that grows the group "
                        "to N members (as tests/_ft_worker.py)")
    p.add_argument("--die-mid-heal", action="store_true",
                   help="SIGKILL itself part-way through a heal transfer it serves")
    p.add_argument("--fault-after", type=int, default=1,
                   help="--die-* only once this many steps are committed")
    args = p.parse_args()
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(args.hidden, 1))
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=3, gamma=0.9)

    def state():
        return {"model": model.state_dict(), "optimizer": inner.state_dict(),
                "scheduler": sched.state_dict()}

    def load(s):
        model.load_state_dict(s["model"])
        inner.load_state_dict(s["optimizer"])
        sched.load_state_dict(s["scheduler"])

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=args.timeout)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(pg=pg, load_state_dict=load,
                      state_dict=state, min_replica_size=1, use_async_quorum=False,
                      timeout=timeout, rank=0, world_size=1, store_addr="127.0.0.1",
                      store_port=store.port, lighthouse_addr=args.lighthouse,
                      replica_id=args.replica_id)
    if args.fail_heals:
        from _ft_worker import fail_heal

        class _Holder:                      # fail_heal takes an object with .manager
            pass
        holder = _Holder()
        holder.manager = manager
        fail_heal(holder, args.fail_heals)
    if args.die_in_configure or args.die_mid_heal:
        from _ft_worker import die_in_configure, die_mid_heal

        def armed():
            return manager.current_step() >= args.fault_after
        if args.die_in_configure:
            die_in_configure(pg, args.die_in_configure, armed)
        if args.die_mid_heal:
            die_mid_heal(manager._checkpoint_transport, armed)
    from _ft_worker import time_configures

    configured = time_configures(pg)
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, inner)
    g = torch.Generator().manual_seed(hash(args.tag) % 1000)
    log = open(args.log, "a", buffering=1)  # noqa: SIM115
    if args.sync_dir:
        open(os.path.join(args.sync_dir, f"ready-{args.tag}"), "w").close()
        while not os.path.exists(os.path.join(args.sync_dir, f"go-{args.tag}")):
            time.sleep(0.01)
    quorum, heal_s = -1, None
    while manager.current_step() < args.steps:
        if args.sync_dir and os.path.exists(os.path.join(args.sync_dir, "stop")):
            break
        t0 = time.time()
        before = manager.current_step()
        opt.zero_grad()                                    # quorum (and healing)
        if heal_s is None and manager.current_step() > before:   # jumped: healed
            heal_s = time.time() - t0
        size = manager.num_participants()
        if manager._quorum_id != quorum:
            quorum = manager._quorum_id
            if args.dump:
                torch.save(state(), os.path.join(args.dump, f"quorum-{manager.current_step()}"
                                                 f"-{size}.pt"))
        if manager.current_step() == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(args.batch, 16, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).sin())
        loss.backward()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        step = manager.current_step()
        opt.step()
        committed = manager.current_step() > step
        if committed:
            sched.step()
        log.write(json.dumps({"t0": t0, "t": time.time(), "step": manager.current_step(),
                              "committed": committed, "world": size, "loss": float(loss),
                              "heal_s": heal_s, "configured": configured[0]}) + "\n")
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
