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


def die_in_configure(pg, world_size, armed):
    """SIGKILL this process inside the group configure of a quorum of ``world_size`` members
    that a running group of at least 2 grows into (a join), once ``armed()``: torchft has
    dropped the old group, the new one is not made yet."""
    create = pg._create_pg
    last = [1]

    def dying(store, rank, size):
        if size == world_size and 2 <= last[0] < size and armed():
            os.kill(os.getpid(), signal.SIGKILL)
        last[0] = size
        return create(store, rank, size)
    pg._create_pg = dying


def die_mid_heal(transport, armed):
    """SIGKILL this process in the middle of the first heal transfer it serves once
    ``armed()``: 2 KiB of the answer written, then the kill (torchft's transport or ours:
    both serve with a ``BaseHTTPRequestHandler``)."""
    server = transport._server
    handler = server.RequestHandlerClass

    class Dying(handler):
        def setup(self):
            super().setup()
            write, sent = self.wfile.write, [0]

            def part_then_die(data):
                if armed() and sent[0] + len(data) > 2048:
                    write(bytes(data[:max(2048 - sent[0], 1)]))
                    self.wfile.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                sent[0] += len(data)
                return write(data)
            self.wfile.write = part_then_die
    server.RequestHandlerClass = Dying


def time_configures(pg) -> list:
    """``[start of the last group configure]`` (wall time), kept up to date: torchft's
    Manager calls ``pg.reconfigure`` once per new quorum (benchmarks/ft/ft.py's
    ``rebuild_s`` runs from there to the first commit)."""
    last = [None]
    reconfigure = pg.reconfigure

    def timed(opts):
        last[0] = time.time()
        return reconfigure(opts)
    pg.reconfigure = timed
    return last


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
    p.add_argument("--quorum-timeout", type=float, default=60.0)
    p.add_argument("--sync-dir", default="", help="write ready-<tag> there, then wait for go-<tag>")
    p.add_argument("--tag", default="")
    p.add_argument("--connect-after-go", action="store_true",
                   help="join the Lighthouse only once go-<tag> is there (a replica that joins)")
    p.add_argument("--hold-at", type=int, default=-1,
                   help="before this step, write held-<tag> and wait for <sync-dir>/release")
    p.add_argument("--fail-heals", type=int, default=0,
                   help="the first N heal transfers to this replica fail (a reset connection)")
    p.add_argument("--die-in-configure", type=int, default=0,
                   help="SIGKILL itself inside the configure of a join that grows the group "
                        "to N members")
    p.add_argument("--die-mid-heal", action="store_true",
                   help="SIGKILL itself part-way through a heal transfer it serves")
    p.add_argument("--fault-after", type=int, default=1,
                   help="--die-* only once this many steps are committed")
    p.add_argument("--raise-at", type=int, default=-1,
                   help="raise a bug (ValueError) in this step, then close() and start again "
                        "in the same process with a fresh model (a restart in-process)")
    args = p.parse_args()
    run(args)


def run(args):
    from datetime import timedelta
    model, opt, sched, data = build(args)
    if args.connect_after_go:
        sync(args)
    algorithm = ALGOS[args.algo](opt)
    if args.variant == "sync_every":
        algorithm = type(algorithm)(sync_every=4)
    ft = FaultTolerant(model, opt, algorithm, lighthouse=args.lighthouse,
                       replica_id=args.replica_id, scheduler=sched, data=data,
                       timeout=timedelta(seconds=args.timeout), secret=args.secret,
                       quorum_timeout=timedelta(seconds=args.quorum_timeout))
    configured = time_configures(ft._pg)
    if args.fail_heals:
        fail_heal(ft, args.fail_heals)
    def armed():
        return ft.committed_steps >= args.fault_after
    if args.die_in_configure:
        die_in_configure(ft._pg, args.die_in_configure, armed)
    if args.die_mid_heal:
        die_mid_heal(ft.manager._checkpoint_transport, armed)
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
            open(os.path.join(args.sync_dir, f"held-{args.tag}"), "w").close()
            wait_for(os.path.join(args.sync_dir, "release"))
            args.hold_at = -1
        opt.zero_grad()
        t0 = time.time()
        try:
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
                if ft.committed_steps == args.raise_at:
                    raise ValueError("injected: a bug in the step")
                loss = torch.nn.functional.mse_loss(ft.model(x), y)
                loss.backward()
                if args.step_sleep:
                    time.sleep(args.step_sleep)
        except ValueError as err:
            if "injected" not in str(err):
                raise
            break            # the bug left the step (FaultTolerant re-raised it)
        log.write(json.dumps({"t0": t0, "t": time.time(), "step": ft.committed_steps,
                              "committed": step.committed, "world": ft.world_size,
                              "rank": ft._pg.members[0],
                              "loss": float(loss), "indices": idx.tolist(),
                              "epoch": ft.data.sampler.epoch,
                              "heal_s": ft.heal_times[-1] if heals else None,
                              "error": None if step.error is None else str(step.error)[:200],
                              "configured": configured[0]})
                  + "\n")
    if ft.committed_steps == args.raise_at and ft.committed_steps < args.steps:
        # this replica leaves the job and comes back in the same process with a fresh model,
        # as a supervisor loop would restart it
        ft.close()
        log.close()
        args.raise_at = -1
        args.connect_after_go = False
        args.sync_dir = ""
        return run(args)
    if args.dump:
        torch.save(ft.state_dict(), os.path.join(args.dump, "end.pt"))
    ft.close()


if __name__ == "__main__":
    main()
