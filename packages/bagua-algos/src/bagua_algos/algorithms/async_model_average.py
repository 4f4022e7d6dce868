"""AsyncModelAverage: a background thread averages the model with its peers every
``sync_interval_ms`` while training continues, on its own process group."""

from __future__ import annotations

import atexit
import threading

import torch

import bagua_comm as bc

from .._engine.checks import check_int_at_least, check_number
from .._engine.comm import Reducer, on_gpu
from .._engine.state import export_flat, import_flat
from ..algorithm import Algorithm, AlgorithmImpl


class AsyncModelAverage(Algorithm, name="async"):
    """Asynchronous model averaging: ranks never wait for each other's steps.

    The first ``warmup_steps`` steps allreduce gradients synchronously; then a background
    thread (its own process group) averages the weights every ``sync_interval_ms``.  Each round
    starts with an abort flag agreed by all ranks, so that :meth:`BaguaModule.abort` on any
    rank stops every rank's thread at the next round and exit never hangs.  The averaged
    weights are applied by the training thread before the next forward, never during one.
    """

    @property
    def dense_gradients(self):
        return self.warmup_steps > 0      # its warm-up allreduces gradient buckets

    def __init__(self, peer_selection_mode: str = "all", sync_interval_ms: int = 500,
                 warmup_steps: int = 0):
        if peer_selection_mode != "all":
            raise ValueError(f"AsyncModelAverage supports peer_selection_mode='all' only, got "
                             f"{peer_selection_mode!r}")
        check_number("sync_interval_ms", sync_interval_ms, ">= 0", lambda v: not v < 0)
        check_int_at_least("warmup_steps", warmup_steps, 0)
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps

    def reify(self, group):
        return AsyncModelAverageImpl(group, self)


class AsyncModelAverageImpl(AlgorithmImpl):
    flatten_weights = True

    def __init__(self, group, algo: AsyncModelAverage):
        super().__init__(group)
        self.interval = algo.sync_interval_ms / 1000.0
        self.warmup_steps = algo.warmup_steps
        self.uses_grad_buckets = algo.warmup_steps > 0
        self.reducer = Reducer(group, False, "bagua-async")   # warmup: flat allreduce
        self.bg_group = bc.new_group(group.ranks)     # collective: every rank, same order
        self.lock = threading.RLock()   # held around optimizer.step(); re-entered by step(closure)
        self.abort_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.stopped = False
        self.rounds = 0
        self.error: BaseException | None = None
        self.failed = False             # this rank stops because it raised (mark_failed)
        self._opt_hooks = []
        self._atexit_registered = False
        self._step_holds = 0            # acquisitions of `lock` by optimizer steps not released
        self.device: torch.device | None = None   # the weights' device, captured at init
        self._train_done = None   # CUDA event: the training stream's last step / apply
        self._avg_done = None     # CUDA event: the averaging stream's last update of pending
        self._snap_done = None    # CUDA event: the averaging stream's last read of the weights

    def init_operations(self, ctx, buckets):
        self.buckets = buckets
        self.device = buckets[0].weight.device if buckets else torch.device("cpu")
        self.pending = [torch.zeros_like(b.weight) for b in buckets]
        self.has_pending = False
        if not self._opt_hooks:
            for opt in ctx.optimizers:
                self._opt_hooks.append(opt.register_step_pre_hook(self._lock_step))
                self._opt_hooks.append(opt.register_step_post_hook(self._unlock_step))

    def before_rebucket(self, ctx):
        """Stop the averaging thread (every rank does, at the same round), carry the
        averages not yet applied, keyed by parameter."""
        running = self.thread is not None and not self.stopped
        self._release_step_holds()
        if self.thread is not None:
            self.abort_event.set()
            self.thread.join()
            self.thread = None
        with self.lock:
            pending = export_flat(self.buckets, self.pending) if self.has_pending else {}
        return {"running": running, "pending": pending}

    def after_rebucket(self, ctx, buckets, state):
        self.init_operations(ctx, buckets)
        if state["pending"]:
            import_flat(buckets, self.pending, state["pending"], "AsyncModelAverage's averages")
            self.has_pending = True
        if state["running"]:
            self.stopped = False
            self._start()

    def _lock_step(self, *_):
        self.lock.acquire()
        self._step_holds += 1
        # the lock orders the host only: the step's kernels must also wait, on the GPU, for
        # the averaging stream's last snapshot of the weights they are about to overwrite
        self._after_snapshot()

    def _unlock_step(self, *_):
        self._mark_training()     # the snapshot must follow this step on the GPU too
        # torch runs step post-hooks only when the step returns: a step (or its closure) that
        # raised left its hold, which would block the averaging thread for good.  The end of
        # any step therefore lets go of every hold the training thread still has.
        self._release_step_holds()

    def _release_step_holds(self):
        """Release the holds of optimizer steps (training thread only: the RLock's owner)."""
        while self._step_holds:
            self._step_holds -= 1
            self.lock.release()

    def _mark_training(self):
        """Record, on the training thread's current stream, that its writes so far (a step,
        an applied average) come before the averaging thread's next reads."""
        if on_gpu(self.device):
            if self._train_done is None:
                self._train_done = torch.cuda.Event()
            self._train_done.record(torch.cuda.current_stream(self.device))

    # -- training thread ------------------------------------------------------------------------
    def forward_pre_hook(self, ctx):
        if ctx.step <= self.warmup_steps:
            self.uses_grad_buckets = True
            return
        self.uses_grad_buckets = False
        if self.thread is None and not self.stopped:
            self._start()
        self._apply_pending()

    def carries_unused_flags(self, ctx):
        """Gradient buckets start in warmup steps only, and those average (flags included)."""
        return True

    def bucket_ready_hook(self, ctx, bucket):      # warmup steps only
        return self.reducer.allreduce(bucket.grad_and_flags, bc.ReduceOp.AVG)

    def _apply_pending(self):
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError("AsyncModelAverage's background thread failed") from err
        with self.lock:
            if not self.has_pending:
                return
            if self._avg_done is not None:    # pending was written on the averaging stream
                torch.cuda.current_stream(self.device).wait_event(self._avg_done)
            self._after_snapshot()            # (covered by _avg_done unless one is missing)
            with torch.no_grad():
                for b, delta in zip(self.buckets, self.pending):
                    b.gather_weights().add_(delta)
                    b.scatter_weights()
                    delta.zero_()
            self.has_pending = False
            self._mark_training()

    def _start(self):
        if not self._atexit_registered:   # a forgotten abort() must not keep peers waiting
            atexit.register(self._stop_at_exit)
            self._atexit_registered = True
        self.abort_event.clear()
        self._mark_training()   # the first round reads what the training stream wrote so far
        if on_gpu(self.device):
            # the averaging group's NCCL state (communicator, stream, events) is made here,
            # on the training thread, on this rank's device; every rank starts together
            bc.allreduce_inplace(torch.zeros(1, device=self.device), group=self.bg_group)
        # daemon: never keeps the process alive; _stop_at_exit stops it at exit
        self.thread = threading.Thread(target=self._loop, name="bagua-async-average",
                                       daemon=True)
        self.thread.start()

    def abort(self, module):
        """Stop averaging on every rank (at their next round) and wait for this rank's
        thread; then apply the last average."""
        self._release_step_holds()       # a step that raised must not block the thread's exit
        self.abort_event.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.stopped = True
        self._apply_pending()

    def mark_failed(self):
        """This rank is leaving because its training raised: the :meth:`abort` that follows
        tells the peers so, and their next training step raises (naming it) instead of
        training on alone and ending as if the job had succeeded."""
        self.failed = True

    def resume(self, module):
        """Restart averaging after :meth:`abort` (call it on every rank).

        Every rank's thread stops at the same agreed round (a peer's abort stops this rank's
        thread too), so each rank first stops and joins whatever thread it still has, then
        starts a fresh one: all ranks restart together, whether this rank's thread was
        stopped by its own ``abort()``, by a peer's, or never."""
        self._release_step_holds()
        self.abort_event.set()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self._apply_pending()            # raises if the old thread failed (a dead peer)
        self.stopped = False
        self.abort_event.clear()
        if module.step > self.warmup_steps:
            self._start()

    # -- background thread ----------------------------------------------------------------------
    def _loop(self):
        try:
            with _cuda_context(self.device):
                self._rounds()
        except BaseException as err:   # surfaced in the training thread
            self.error = err
            self.stopped = True

    def _rounds(self):
        flag = torch.zeros(1, dtype=torch.int32)
        while True:
            self.abort_event.wait(self.interval)
            # 0: average; 1: stop (abort, rebucket); 2: stop, a rank failed (mark_failed)
            flag.fill_((2 if self.failed else 1) if self.abort_event.is_set() else 0)
            bc.allreduce_inplace(flag, bc.ReduceOp.MAX, group=self.bg_group)
            if flag.item():
                self.stopped = True
                if flag.item() == 2 and not self.failed:
                    self.error = RuntimeError(
                        "AsyncModelAverage stopped: another rank's training raised and it "
                        "left the job; this rank stops too rather than train on alone")
                return
            self._average_once()

    def _average_once(self):
        with self.lock:   # the weights as the next forward will see them
            self._after_training()
            snaps = [b.gather_weights() + delta for b, delta in zip(self.buckets, self.pending)]
            if on_gpu(self.device):    # the next step's writes wait for these reads
                if self._snap_done is None:
                    self._snap_done = torch.cuda.Event()
                self._snap_done.record()
        for s in snaps:
            avg = s.clone()
            bc.allreduce_inplace(avg, bc.ReduceOp.AVG, group=self.bg_group)
            s.sub_(avg).neg_()             # avg - snapshot
        with self.lock:
            self._after_training()
            for delta, s in zip(self.pending, snaps):
                delta.add_(s)
            if on_gpu(self.device):
                if self._avg_done is None:
                    self._avg_done = torch.cuda.Event()
                self._avg_done.record()
            self.has_pending = True
        self.rounds += 1

    def _after_snapshot(self):
        """On the training stream: wait for the averaging stream's last snapshot (the reads
        of the weights and of pending) before overwriting them."""
        if self._snap_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._snap_done)

    def _after_training(self):
        """On the averaging stream: wait for the training stream's last recorded writes."""
        if self._train_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._train_done)

    def _stop_at_exit(self):
        thread = self.thread
        if thread is not None and thread.is_alive():
            if threading.current_thread() is threading.main_thread():
                self._release_step_holds()
            self.abort_event.set()
            thread.join(timeout=self.interval + 10.0)

    def load_foreign_state_dict(self, state, *, world_size, rank):
        return ("averages not yet applied when the checkpoint was taken are dropped; the "
                "background thread starts afresh over the new ranks")

    def shutdown(self):
        self._release_step_holds()
        if self.thread is not None:
            self.abort_event.set()
            self.thread.join()
            self.thread = None
        for h in self._opt_hooks:
            h.remove()
        self._opt_hooks.clear()


def _cuda_context(device):
    """The averaging thread's CUDA context: ``device`` made current (a new thread starts on
    device 0) and a stream of its own, so that its copies and kernels neither run on the
    training stream nor land on another rank's GPU.  A no-op for CPU weights."""
    import contextlib

    if not on_gpu(device):
        return contextlib.nullcontext()
    torch.cuda.set_device(device)
    return torch.cuda.stream(torch.cuda.Stream(device))
