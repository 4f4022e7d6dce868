"""QAdam: Adam whose second moment freezes after a warmup, so that afterwards only the
momentum needs averaging, and it travels 8-bit compressed."""

from __future__ import annotations

import math

import torch

import bagua_comm as bc

from .._engine.checks import check_bool, check_int_at_least
from .._engine.overflow import all_finite
from ..algorithm import Algorithm, AlgorithmImpl
from ._shared import CompressedAllReduce, check_compressor, reset_residuals_note, trainable


class QAdamOptimizer(torch.optim.Optimizer):
    """Adam with a frozen second moment after ``warmup_steps`` steps.

    For the first ``warmup_steps`` steps it is Adam (``exp_avg`` and ``exp_avg_sq`` both
    updated).  After that ``exp_avg_sq`` (and its bias correction) stays fixed and only the
    momentum ``exp_avg`` moves; under :class:`QAdam` the momentum is computed in backward and
    averaged across ranks in compressed form before ``step()`` uses it.  Weight decay is
    L2 (added to the gradient), as in ``torch.optim.Adam``.

    The frozen second moment can make training unstable after warmup where ``v`` is tiny
    (measured on sklearn's digits: 3 of 15 seeds diverged, 6 of 15 with the same frozen
    variance and no compression at all, 0 with Adam; ``benchmarks/studies/qadam_digits.py``). A longer
    ``warmup_steps``, a smaller ``lr`` or a larger ``eps`` make it safer.
    """

    # bagua_optim.fuse_optimizer steps stand-in parameters over runs of real ones; QAdam
    # computes the momentum of the real ones in backward, so they are stepped one by one.
    # torch.amp.GradScaler hands this optimizer the scale and the overflow flag (as
    # attributes grad_scale and found_inf, set around step()) instead of unscaling itself.
    _step_supports_amp_scaling = True
    _bagua_fuse_refusal = ("QAdamOptimizer's momentum is computed per parameter in backward "
                           "by the QAdam algorithm, so a fused stand-in would miss it")

    def __init__(self, params, lr: float = 1e-3, warmup_steps: int = 100,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        if not lr > 0.0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        check_int_at_least("warmup_steps", warmup_steps, 1,
                           "the second moment is estimated during warmup")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "step_id": 0}
        super().__init__(params, defaults)
        self.warmup_steps = warmup_steps
        self.momentum_ready: set[int] = set()   # params whose exp_avg QAdam already updated
        self._under_qadam = False               # set by the QAdam algorithm (with_bagua)
        self._amp = False                       # a torch.amp.GradScaler has driven step()

    def init_state(self, p) -> dict:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def next_step_is_warmup(self) -> bool:
        """True while the coming ``step()`` is still a warmup step."""
        return self.param_groups[0]["step_id"] < self.warmup_steps

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._under_qadam and len(self.param_groups) != self._qadam_groups:
            raise ValueError("QAdamOptimizer.add_param_group() after with_bagua: QAdam averages "
                             "the parameters the optimizer held at with_bagua, so the new ones "
                             "would differ between ranks. Add the groups before with_bagua, or "
                             "wrap again (with_bagua(model, [optimizer], QAdam(optimizer)))")
        scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if scale is not None or found_inf is not None:
            if self._under_qadam and self.momentum_ready:
                raise RuntimeError(
                    "QAdam met torch.amp.GradScaler only after warmup, when this step's "
                    "momentum had already been averaged in backward from the loss-scaled "
                    "gradient; use the GradScaler from the first step (QAdam then folds the "
                    "unscaled gradient into the momentum in step())")
            self._amp = True
            # Under QAdam every rank has the same found_inf: in warmup the gradients are
            # averaged (an overflow anywhere is one everywhere); after it, the end of
            # backward spreads any rank's overflow to every rank's gradients.
            if found_inf is not None and float(found_inf) > 0:
                return loss                       # GradScaler: an overflow skips the step
            if scale is not None:                 # unscale as GradScaler.unscale_ would
                inv = scale.double().reciprocal().float()
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(inv.to(p.grad.device))
            if self._under_qadam and not self.next_step_is_warmup():
                self._qadam_average()             # the momentum fold, deferred to here
        ready = self.momentum_ready
        for group in self.param_groups:
            group["step_id"] += 1
            t = group["step_id"]
            beta1, beta2 = group["betas"]
            warm = t <= self.warmup_steps
            bias1 = 1 - beta1 ** t
            bias2 = 1 - beta2 ** min(t, self.warmup_steps)
            # One multi-tensor call per operation over the group, not a Python loop of
            # torch calls per parameter (the same kernels, in the same order, per tensor)
            params, ms, vs, fold = [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:     # inline: no Python call per parameter
                    state = self.init_state(p)
                params.append(p)
                ms.append(state["exp_avg"])
                vs.append(state["exp_avg_sq"])
                if warm or id(p) not in ready:
                    fold.append(len(params) - 1)
            if not params:
                continue
            if fold:
                fp = [params[i] for i in fold]
                fm, grads = [ms[i] for i in fold], [p.grad for p in fp]
                if group["weight_decay"]:
                    grads = torch._foreach_add(grads, fp, alpha=group["weight_decay"])
                torch._foreach_mul_(fm, beta1)
                torch._foreach_add_(fm, grads, alpha=1 - beta1)
                if warm:
                    fv = [vs[i] for i in fold]
                    torch._foreach_mul_(fv, beta2)
                    torch._foreach_addcmul_(fv, grads, grads, value=1 - beta2)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, math.sqrt(bias2))
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_addcdiv_(params, ms, denom, value=-group["lr"] / bias1)
        self.momentum_ready.clear()
        return loss


class QAdam(Algorithm, name="qadam"):
    """The algorithm for :class:`QAdamOptimizer`: allreduce gradients during warmup, then
    compressed allreduce of the momentum (``compressor``: any
    ``bagua_comm.compression.Compressor``, default ``MinMaxUInt8``); ranks stay
    bit-identical."""

    dense_gradients = True

    def compresses(self):
        return True

    def __init__(self, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = True,
                 compressor=None):
        if not isinstance(q_adam_optimizer, QAdamOptimizer):
            raise ValueError(f"q_adam_optimizer must be a QAdamOptimizer, got "
                             f"{type(q_adam_optimizer).__name__}")
        check_bool("hierarchical", hierarchical)
        check_compressor(compressor)
        self.optimizer = q_adam_optimizer
        self.hierarchical = hierarchical
        self.compressor = compressor

    def __repr__(self) -> str:
        return f"QAdam(hierarchical={self.hierarchical}, compressor={self.compressor!r})"

    def check_wrap(self, module: torch.nn.Module, optimizers: list) -> None:
        """QAdam averages its QAdamOptimizer's parameters only (their gradients in warmup,
        their momenta after it): a trainable parameter outside it would train apart on every
        rank, and one of another model would never be averaged."""
        own = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        missing = [name for name, p in trainable(module) if id(p) not in own]
        if missing:
            raise ValueError(
                f"q_adam_optimizer: parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}"
                f" require grad but are not in the QAdamOptimizer given to QAdam, which averages "
                f"only its own parameters, so these would differ between ranks. Put every "
                f"trainable parameter in the QAdamOptimizer (param groups may set their own lr) "
                f"or freeze them (requires_grad_(False))")
        mine = {id(p) for p in module.parameters()}
        foreign = sum(1 for g in self.optimizer.param_groups for p in g["params"]
                      if id(p) not in mine)
        if foreign:
            raise ValueError(f"q_adam_optimizer: {foreign} of its parameters are not the wrapped "
                             f"model's; build the QAdamOptimizer over model.parameters()")

    def reify(self, group):
        return QAdamImpl(group, self)


class QAdamState:
    """Per-bucket momentum buffers (each parameter's ``exp_avg`` is a view of one) and the
    compressed allreduce that averages them; the momenta themselves are optimizer state."""

    def __init__(self, group, algo: QAdam):
        # one runner for both phases: warmup gradients and compressed momenta
        self.compressed = CompressedAllReduce(group, algo.hierarchical, algo.compressor,
                                              average=True, name="bagua-qadam")
        self.reducer = self.compressed.reducer
        self.momentum: list[torch.Tensor] = []
        self.views: list[list[torch.Tensor]] = []

    def build(self, buckets) -> None:
        self.compressed.buckets = buckets
        self.momentum = [torch.zeros_like(b.grad) for b in buckets]
        self.views = [[m[o:o + p.numel()].view_as(p) for o, p in zip(b.offsets, b.params)]
                      for b, m in zip(buckets, self.momentum)]


class QAdamImpl(AlgorithmImpl):
    # its buckets go through compressed_allreduce (the group's aux channel, or the node
    # groups when hierarchical): the group's own channel is free for the unused check
    unused_check_beside = True

    synchronous = True

    def __init__(self, group, algo: QAdam):
        super().__init__(group)
        self.optimizer = algo.optimizer
        self.state = QAdamState(group, algo)
        self._group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        self.optimizer._under_qadam = True
        self.optimizer._qadam_groups = len(self.optimizer.param_groups)
        self.optimizer._qadam_average = self.average_momentum
        # (buckets, (phase, hierarchical), launchers, whether the last carries the flags)
        self._launchers: tuple | None = None
        self._bound_state = None                 # the optimizer state the momenta are bound in

    def bucket_alignment(self) -> int:
        return self.state.compressed.alignment()

    def init_tensors(self, ctx):
        return [p for p in super().init_tensors(ctx) if id(p) in self._group_of]

    def init_operations(self, ctx, buckets):
        self.buckets = buckets
        self.state.build(buckets)
        for b in buckets:
            self._bind_momentum(b)
        self._bound_state = self.optimizer.state

    def _bind_momentum(self, bucket):
        """Make each parameter's ``exp_avg`` a view of the bucket's momentum buffer (again
        after ``optimizer.load_state_dict`` or a re-bucketing replaced it)."""
        for p, view in zip(bucket.params, self.state.views[bucket.index]):
            state = self.optimizer.init_state(p)
            if state["exp_avg"].data_ptr() != view.data_ptr():
                view.copy_(state["exp_avg"])
                state["exp_avg"] = view

    def bucket_launchers(self, ctx, buckets):
        """What :meth:`bucket_ready_hook` starts, per bucket, made once per layout and phase:
        after warmup (no GradScaler) a compiled fold (``_engine._hot.FoldThenStart``) followed by
        the compressed average's launcher (:meth:`CompressedAllReduce.launchers`).  The
        momenta are bound again first when the optimizer's state was replaced
        (``load_state_dict``)."""
        opt = self.optimizer
        phase = "warmup" if opt.next_step_is_warmup() else "amp" if opt._amp else "fold"
        if opt.state is not self._bound_state:
            for b in buckets:
                self._bind_momentum(b)
            self._bound_state = opt.state
        return self._launchers_of(ctx, buckets, phase)[2]

    def _launchers_of(self, ctx, buckets, phase):
        """(buckets, (phase, hierarchical), launchers, whether the last carries the flags)."""
        hier = self.state.reducer.hierarchical
        cached = self._launchers
        if cached is not None and cached[0] is buckets and cached[1] == (phase, hier):
            return cached
        carried = False
        if phase == "fold":
            from .._engine import _hot

            starts, carried = self.state.compressed.launchers(
                buckets, [self.state.momentum[b.index] for b in buckets],
                buckets[-1].flags if buckets else None)
            out = [(None, _hot.FoldThenStart(list(b.params), b.grad_views(),
                                             list(self.state.views[b.index]),
                                             [self._group_of[id(p)] for p in b.params],
                                             self.optimizer.momentum_ready, s))
                   for b, s in zip(buckets, starts)]
        else:
            out = super().bucket_launchers(ctx, buckets)
        self._launchers = (buckets, (phase, hier), out, carried)
        return self._launchers

    def _carried_launchers(self, ctx):
        """This step's launchers when the compressed momentum average carries the flags (its
        last bucket's compiled launcher sums them exactly in its own exchange), else None."""
        opt = self.optimizer
        if opt.next_step_is_warmup() or opt._amp or not self.buckets:
            return None
        got = self.bucket_launchers(ctx, self.buckets)    # made (or found) for this phase
        cached = self._launchers
        return got if cached is not None and cached[2] is got and cached[3] else None

    def carries_unused_flags(self, ctx):
        """Warmup steps average the gradients (flags included); compressed steps carry them
        where the momentum average is compiled (flat MinMaxUInt8 on gloo CPU, float32)."""
        return (self.optimizer.next_step_is_warmup()
                or self._carried_launchers(ctx) is not None)

    def bucket_ready_hook(self, ctx, bucket):
        if self.optimizer.next_step_is_warmup():
            return self.state.reducer.allreduce(bucket.grad_and_flags, bc.ReduceOp.AVG)
        if self.optimizer._amp:
            return None       # loss-scaled gradients: folded in step(), once unscaled
        carried = self._carried_launchers(ctx)
        if carried is not None:   # every start (a joined rank's too) carries the flags
            return carried[bucket.index][1]()
        return self._fold_and_average(bucket, bucket.grad_views())

    def _fold_and_average(self, bucket, grads):
        """m ← β1·m + (1 - β1)·(g + wd·p) for the bucket's parameters, then start the
        compressed average of its momentum buffer."""
        i = bucket.index
        self._bind_momentum(bucket)
        with torch.no_grad():
            for p, g, m in zip(bucket.params, grads, self.state.views[i]):
                group = self._group_of[id(p)]
                beta1 = group["betas"][0]
                if group["weight_decay"]:
                    g = g.add(p, alpha=group["weight_decay"])
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                self.optimizer.momentum_ready.add(id(p))
        return self.state.compressed(self.state.momentum[i], bucket)

    def average_momentum(self) -> None:
        """Under torch.amp.GradScaler, from ``step()`` once the gradients are unscaled and the
        step is known not to be skipped (on every rank alike): the fold and the compressed
        average that backward does otherwise.  The momentum (and so the error-feedback
        residuals) stay in unscaled units whatever the scale does."""
        handles = []
        for b in self.buckets:
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in b.params]
            handles.append(self._fold_and_average(b, grads))
        for h in handles:
            if h is not None:
                h.wait()

    def post_backward_hook(self, ctx):
        """Under GradScaler after warmup nothing crossed ranks in backward, so each rank's
        scaler would see its own overflow only: agree on one (a 1-element MAX), and write an
        inf into every rank's gradients when any rank overflowed, so that every scaler skips
        the step and backs off alike."""
        if not self.optimizer._amp or self.optimizer.next_step_is_warmup():
            return
        grads = [p.grad for b in self.buckets for p in b.params if p.grad is not None]
        device = self.buckets[0].device if self.buckets else "cpu"   # NCCL: a CUDA flag
        flag = torch.tensor([0.0 if all_finite(grads) else 1.0], device=device)
        if self.group.size > 1:
            bc.allreduce_inplace(flag, bc.ReduceOp.MAX, group=self.group)
        if flag.item() and grads:
            grads[0].view(-1)[0] = float("inf")

    def state_dict(self):
        return {"compressor": self.state.compressed.state_dict()}

    def load_state_dict(self, state):
        self.state.compressed.load_state_dict(state["compressor"])

    def before_rebucket(self, ctx):
        state = self.state_dict()
        self.state.compressed.share(state["compressor"])
        return state

    def foreign_view(self, state):
        return reset_residuals_note(state)      # all that a foreign load reads

    def load_foreign_state_dict(self, state, *, world_size, rank):
        # Moments and step_id are ordinary optimizer state (restored by torch); only the
        # compressors' chunking (one chunk per rank) and any residuals belong to the old job.
        return reset_residuals_note(state)

    def shutdown(self):
        self.optimizer._under_qadam = False
        self.optimizer._qadam_average = None
        self.state.compressed.close()
