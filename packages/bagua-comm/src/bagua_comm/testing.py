"""Run a function on N real ranks, the way every multi-rank test in this repo does.

``run_ranks(fn, world_size)`` spawns ``world_size`` processes (spawn context, so no state
leaks from the parent), joins them through a ``FileStore`` in a fresh temporary directory (no
port probing), initialises bagua_comm in each, and calls ``fn(*args, **kwargs)``.  It returns
the per-rank results in rank order.  The first rank to fail, or the timeout, kills every rank,
and the parent raises :class:`RankFailure` carrying the child's own traceback.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import tempfile
import time
import traceback
from datetime import timedelta


class RankFailure(AssertionError):
    """A rank raised, crashed or timed out; the message holds its traceback."""


def _child(rank, world_size, local_world_size, store_path, backend, init, threads, env,
           fn, args, kwargs, conn, pg_timeout=120.0):
    try:
        # on a timeout the parent sends SIGUSR2 and reports where every thread of this rank was
        stacks = open(_stacks_path(store_path, rank), "w")  # noqa: SIM115 (open for life)
        faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)
        os.environ.update(env)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "LOCAL_RANK": str(rank % local_world_size),
                           "LOCAL_WORLD_SIZE": str(local_world_size),
                           "GROUP_RANK": str(rank // local_world_size)})
        import torch

        if threads:
            torch.set_num_threads(threads)
        if init:
            import torch.distributed as dist

            from . import process_group

            store = dist.FileStore(store_path, world_size)
            process_group.init_process_group(backend, store=store, rank=rank,
                                             world_size=world_size,
                                             local_world_size=local_world_size,
                                             timeout=timedelta(seconds=pg_timeout))
        result = fn(*args, **kwargs)
        try:
            conn.send(("ok", rank, pickle.dumps(result)))
        except Exception:  # unpicklable result: report that instead of hanging
            conn.send(("error", rank, "result of fn is not picklable:\n" + traceback.format_exc()))
        if init:
            from . import process_group

            process_group.destroy_process_group()
    except BaseException:
        conn.send(("error", rank, traceback.format_exc()))
    finally:
        conn.close()


def run_ranks(fn, world_size: int = 2, *, args=(), kwargs=None, timeout: float = 120.0,
              local_world_size: int | None = None, backend: str = "gloo", init: bool = True,
              threads: int | None = 1, env: dict[str, str] | None = None,
              pg_timeout: float = 120.0) -> list:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks; return results by rank.

    ``fn`` must be importable by module name (a module-level function).  ``local_world_size``
    ranks share a node (default: all), so ``world_size=4, local_world_size=2`` emulates two
    nodes of two.  ``threads`` sets torch's intra-op threads per rank (1 keeps 2 ranks on 2
    cores from oversubscribing).  ``pg_timeout`` (seconds) is the ``timeout`` given to
    ``init_process_group`` in each rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    local_world_size = local_world_size or world_size
    if world_size % local_world_size:
        raise ValueError(f"local_world_size ({local_world_size}) must divide world_size "
                         f"({world_size})")
    ctx = mp.get_context("spawn")
    env = {"OMP_NUM_THREADS": str(threads or 1), **(env or {})}
    with tempfile.TemporaryDirectory(prefix="bagua-ranks-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs, conns = [], {}
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"rank{rank}", daemon=True,
                            args=(rank, world_size, local_world_size, store_path, backend, init,
                                  threads, env, fn, tuple(args), dict(kwargs or {}), child_end,
                                  pg_timeout))
            p.start()
            child_end.close()
            procs.append(p)
            conns[parent_end] = rank
        try:
            return _collect(procs, conns, world_size, timeout, store_path)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)


def _stacks_path(store_path, rank):
    return f"{store_path}.stacks{rank}"


def _stacks(procs, store_path, ranks):
    """Where each of ``ranks`` is now: every thread's Python stack (faulthandler's dump)."""
    for rank in ranks:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, signal.SIGUSR2)
    time.sleep(1.0)
    out = []
    for rank in ranks:
        try:
            with open(_stacks_path(store_path, rank)) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        out.append(f"--- rank {rank} ---\n{text or '(no stack dumped)'}")
    return "\n".join(out)


def _collect(procs, conns, world_size, timeout, store_path):
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    pending = dict(conns)
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(pending.values())
            raise RankFailure(f"timed out after {timeout:.0f}s waiting for ranks {missing}; "
                              "all ranks were killed. Their stacks:\n"
                              + _stacks(procs, store_path, missing))
        ready = mpc.wait(list(pending) + list(sentinels), timeout=remaining)
        for obj in ready:
            if obj in pending:
                rank = pending.pop(obj)
                try:
                    status, _, payload = obj.recv()
                except EOFError:
                    raise RankFailure(_died(rank, procs[rank])) from None
                if status == "error":
                    raise RankFailure(f"rank {rank} failed:\n{payload}")
                results[rank] = pickle.loads(payload)
            elif obj in sentinels:
                rank = sentinels.pop(obj)
                conn = next((c for c, r in pending.items() if r == rank), None)
                if conn is not None and not conn.poll(1.0):
                    raise RankFailure(_died(rank, procs[rank]))
    return [results[r] for r in range(world_size)]


def _died(rank, proc):
    proc.join(timeout=5)
    return f"rank {rank} died without reporting (exit code {proc.exitcode}); all ranks were killed"


class HostSyncError(AssertionError):
    """Code under :func:`no_host_sync` called an operation that synchronises with a GPU."""


# aten operations that make the host wait for the GPU when their tensors are on CUDA: reading
# a value (item, bool(), printing) and data-dependent output sizes (nonzero, boolean masks).
_SYNCING = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "nonzero_static",
            "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
            "unique_dim", "repeat_interleave"}
# torch functions that make a tensor from host values: with ``device=`` (the CUDA path's way
# of writing it) a blocking host-to-device copy.
_FROM_HOST = ("tensor", "as_tensor", "scalar_tensor")
# Tensor methods that bring a CUDA tensor's values to the host.
_TO_HOST = {"tolist", "numpy", "cpu", "item", "__bool__", "__int__", "__float__", "__index__"}


def no_host_sync():
    """A context in which every operation that would synchronise the host with the GPU on
    CUDA tensors raises :class:`HostSyncError`, on CPU tensors too: the CPU-side check of
    code that must not synchronise (``torch.cuda.set_sync_debug_mode("error")`` checks the
    same on a GPU).  Caught: reading values (``item``, ``bool``, ``tolist``, ``numpy``,
    ``cpu``), data-dependent sizes
    (``nonzero``, boolean-mask indexing) and ``torch.tensor(..., device=...)``."""
    import contextlib

    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Aten(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__.rstrip("_")
            if name in _SYNCING or (name in ("index", "index_put") and any(
                    getattr(i, "dtype", None) == torch.bool
                    for i in (args[1] if len(args) > 1 else ()) or ())):
                raise HostSyncError(f"{func} synchronises the host with the GPU on CUDA "
                                    "tensors")
            return func(*args, **(kwargs or {}))

    class _FromHost(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "__name__", None) in _TO_HOST:
                raise HostSyncError(f"Tensor.{func.__name__} reads the values on the host (a "
                                    "synchronising copy on CUDA)")
            if getattr(func, "__name__", None) in _FROM_HOST and kwargs.get("device") is not None:
                raise HostSyncError(f"torch.{func.__name__}(..., device=...) copies host values "
                                    "to the device (a synchronising copy on CUDA)")
            return func(*args, **kwargs)

    stack = contextlib.ExitStack()
    stack.enter_context(_FromHost())
    stack.enter_context(_Aten())
    return stack


def cuda_sync_error():
    """A context with ``torch.cuda.set_sync_debug_mode("error")`` (restored on exit): any
    host synchronisation on the GPU raises.  Wrap the code under test, not the reads of its
    results (``.cpu()`` synchronises by design)."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def mode():
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)

    return mode()
