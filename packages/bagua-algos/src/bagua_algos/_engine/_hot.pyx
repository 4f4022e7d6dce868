"""The step engine's hot loop (what torch DDP's C++ ``Reducer`` does per gradient), compiled:
the per-parameter gradient-ready hook, readiness counting per bucket, the in-order launch of
ready buckets, end-of-backward detection, and the copy of gradients into a bucket.

In the steady state a backward enters Python only once per step (the engine's plan of
bucket starters, its end-of-backward callback and the last bucket's flags); the per-bucket
starter of GradientAllReduce is C as well (:func:`bagua_comm.allreduce_launcher`), and so are
ByteGrad's (bagua_comm's compiled compressed launcher) and QAdam's (:class:`FoldThenStart`).
TopK's and LowRank's exchanges are jobs of this module (:class:`TopKRound`,
:class:`LowRankRound`) that :class:`WorkerLauncher` hands to the group's gloo worker thread.
:class:`ReadyLoop` keeps the per-step state; the Python engine (``engine.py``) owns the
buckets, the layout and everything that is not per gradient.
"""

import weakref

import torch
from torch.autograd import Variable

_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_mul = torch.mul


def gather_grads(list params, list views, bint flatten, scale):
    """Make ``views`` (a bucket's gradient slots) hold ``params``' gradients (a missing one
    counts as 0), multiplied by ``scale`` unless it is None, the multiplication fused into
    the copy a gradient that is not yet a view of its slot needs anyway; with ``flatten``
    each gradient becomes its slot."""
    cdef bint grad_mode = _is_grad_enabled()
    if grad_mode:
        _set_grad_enabled(False)
    try:
        for p, v in zip(params, views):
            g = p.grad
            if g is None:
                v.zero_()
            elif flatten and g.data_ptr() == v.data_ptr() and g.shape == v.shape:
                if scale is not None:
                    v.mul_(scale)
                continue
            elif scale is not None:
                _mul(g, scale, out=v)
            else:
                v.copy_(g)
            if flatten:
                p.grad = v
    finally:
        if grad_mode:
            _set_grad_enabled(True)


cdef class ReadyLoop:
    """Per-step readiness of one engine's buckets.  Call it as a parameter's
    post-accumulate-grad hook; :meth:`output_grad` is the hook on a forward's outputs,
    :meth:`sparse_ready` that of a weight averaged on its own.

    The engine (``engine``) provides ``sync`` and ``impl.uses_grad_buckets`` (read at each
    use: an algorithm may switch gradient buckets on and off between steps, as
    AsyncModelAverage after its warm-up), ``_backward_end`` (queued as the
    end-of-backward callback), ``_plan()`` (per bucket ``(scale, start)``, asked once per
    step at the first launch), ``_last_bucket(b)`` (the last bucket's flags, before it
    starts), ``_gather_failed(b, err)``, ``_sparse_error(p)`` and ``_late_error(p, n, e)``
    (each raises).
    """

    cdef object __weakref__          # held weakly by the parameters' hooks (LoopHook)
    cdef object engine
    cdef object impl
    cdef object _queue_callback
    cdef object _end
    cdef public list buckets
    cdef public dict bucket_of       # id(tensor) -> bucket index
    cdef list counts                 # per bucket: its tensors
    cdef public list pending         # per bucket: tensors not ready yet in this backward
    cdef public Py_ssize_t next      # the next bucket to start
    cdef public bint cb_queued
    cdef public bint observing       # first synchronised backward: learn the order
    cdef public list observed
    cdef public set ready            # ids that got a gradient in this backward
    cdef public set used_nosync      # ids that got one under no_sync()
    cdef public dict fires           # this backward's accumulations per tensor
    cdef public dict expected_fires  # the most seen in one backward (if > 1)
    cdef public list handles         # (bucket, handle) started in this backward
    cdef public object plan

    def __init__(self, engine):
        self.engine = engine
        self.impl = engine.impl
        self._queue_callback = Variable._execution_engine.queue_callback
        self._end = engine._backward_end
        self.cb_queued = False
        self.observing = True
        self.observed = []
        self.ready = set()
        self.used_nosync = set()
        self.fires = {}
        self.expected_fires = {}
        self.handles = []
        self.plan = None
        self.set_buckets([])

    def set_buckets(self, list buckets):
        """A new layout (between steps)."""
        self.buckets = buckets
        self.bucket_of = {id(p): b.index for b in buckets for p in b.params}
        self.counts = [len(b.params) for b in buckets]
        self.pending = list(self.counts)
        self.next = 0
        self.plan = None

    def reset(self):
        """The end of a backward: ready for the next one."""
        self.handles = []
        self.ready.clear()
        self.fires.clear()
        self.used_nosync.clear()
        self.pending = list(self.counts)
        self.next = 0
        self.plan = None
        self.cb_queued = False

    cdef void _queue_end(self) except *:
        self.cb_queued = True
        self._queue_callback(self._end)

    def output_grad(self, _grad):
        """Hook on a synchronised forward's outputs: the backward that reaches them (the
        outermost one) ends the step."""
        if self.engine.sync and not self.cb_queued:
            self._queue_end()

    def sparse_ready(self, _param):
        """A sparse-gradient weight's gradient arrived (averaged at the end of backward)."""
        if self.engine.sync and not self.cb_queued:
            self._queue_end()

    def __call__(self, param):
        grad = param.grad
        if grad is not None and grad.is_sparse and self.impl.uses_grad_buckets:
            raise self.engine._sparse_error(param)
        key = id(param)
        if not self.engine.sync:
            self.used_nosync.add(key)
            return
        if not self.cb_queued:           # outputs not hooked (used without forward)
            self._queue_end()
        i = self.bucket_of.get(key)
        if i is None:
            return
        # A weight used in several reentrant-checkpointed segments (a shared block) has its
        # gradient accumulated, and this hook run, once per segment: it is ready after the
        # most accumulations seen in a backward (learnt in the first one, which launches
        # nothing before its end, as DDP's static_graph), not after the first.
        n = self.fires.get(key, 0) + 1
        self.fires[key] = n
        if n == 1:
            self.ready.add(key)
            if self.observing:
                self.observed.append(key)
        expected = self.expected_fires.get(key, 1)
        if n > expected:
            self.expected_fires[key] = n
            if i < self.next:
                raise self.engine._late_error(param, n, expected)
            return
        if n < expected:
            return
        cdef Py_ssize_t j = i
        left = self.pending[j] - 1
        self.pending[j] = left
        if left == 0 and not self.observing:
            self.launch(False)

    cpdef launch(self, bint force):
        """Start buckets in index order (the same on every rank), as far as they are ready
        (all of them when ``force``)."""
        cdef Py_ssize_t n = len(self.buckets)
        cdef Py_ssize_t i
        while self.next < n and (force or self.pending[self.next] == 0):
            i = self.next
            b = self.buckets[i]
            self.next = i + 1
            if not self.impl.uses_grad_buckets:
                continue
            if self.plan is None:
                self.plan = self.engine._plan()
            scale, start = self.plan[i]
            try:
                gather_grads(b.params, b._grad_views, b.flatten, scale)
            except RuntimeError as err:
                self.engine._gather_failed(b, err)
                raise
            if b.flags is not None:      # the last bucket: every rank knows its flags now
                self.engine._last_bucket(b)
            self.handles.append((b, start()))


# -- QAdam's per-bucket momentum fold -----------------------------------------------------------

cdef class LoopHook:
    """A parameter's post-accumulate-grad hook that calls its :class:`ReadyLoop` (``sparse``:
    its ``sparse_ready``) while the loop lives, holding it weakly.  torch keeps a tensor's
    hooks where Python's collector does not look, so a hook holding the loop made the
    parameter and the wrapped model keep each other alive: a wrapper dropped without
    ``detach_algorithm()`` was never freed, nor its process groups' sockets."""

    cdef object ref
    cdef bint sparse

    def __cinit__(self, ReadyLoop loop, bint sparse=False):
        self.ref = weakref.ref(loop)
        self.sparse = sparse

    def __call__(self, param):
        loop = self.ref()
        if loop is None:
            return
        if self.sparse:
            loop.sparse_ready(param)
        else:
            loop(param)

cdef class FoldThenStart:
    """QAdam's bucket starter after warmup (``QAdamImpl.bucket_launchers``): call it (no
    argument) to fold the bucket's gradients into its momenta, ``m <- beta1 m + (1 - beta1)
    (g + wd p)`` (the torch operations of ``QAdamImpl._fold_and_average``, in its order), and
    start their average: returns what ``start()`` returns.  ``groups[i]`` is parameter
    ``i``'s optimizer param group (its ``betas`` and ``weight_decay`` are read at each call);
    ``ready`` is the optimizer's ``momentum_ready`` set."""

    cdef list params, grads, moms, groups
    cdef set ready
    cdef object start

    def __init__(self, list params, list grads, list moms, list groups, set ready, start):
        self.params, self.grads, self.moms, self.groups = params, grads, moms, groups
        self.ready = ready
        self.start = start

    def __call__(self):
        cdef Py_ssize_t i
        cdef bint grad_mode = _is_grad_enabled()
        if grad_mode:
            _set_grad_enabled(False)
        try:
            for i in range(len(self.params)):
                p = self.params[i]
                g = self.grads[i]
                group = self.groups[i]
                beta1 = group["betas"][0]
                wd = group["weight_decay"]
                if wd:
                    g = g.add(p, alpha=wd)
                self.moms[i].mul_(beta1).add_(g, alpha=1 - beta1)
                self.ready.add(id(p))
        finally:
            if grad_mode:
                _set_grad_enabled(True)
        return self.start()


# -- LowPrecisionDecentralized's round over the compiled ring jobs ----------------------------
cdef class WeightRound:
    """One round over a layout's buckets (``LowPrecisionDecentralizedImpl``'s compiled path):
    per bucket, what ``gather_weights()`` does (a parameter that is no longer a view of its
    slot of the flat weights is copied in), ``start()`` (the bucket's compiled ring job,
    handed to the group's worker) waited for, then what ``scatter_weights()`` does; with
    autograd off, as under ``torch.no_grad()``.  ``params[i]`` and ``views[i]`` are bucket
    ``i``'s parameters and their slots, ``starts[i]`` its launcher."""

    cdef list params, views, starts

    def __init__(self, list params, list views, list starts):
        self.params, self.views, self.starts = params, views, starts

    def __call__(self):
        cdef Py_ssize_t i
        cdef bint grad_mode = _is_grad_enabled()
        if grad_mode:
            _set_grad_enabled(False)
        try:
            for i in range(len(self.starts)):
                ps, vs = self.params[i], self.views[i]
                for p, v in zip(ps, vs):
                    if not _same_storage(p.data, v):
                        v.copy_(p)
                self.starts[i]().wait()
                for p, v in zip(ps, vs):
                    if not _same_storage(p.data, v):
                        p.copy_(v)
        finally:
            if grad_mode:
                _set_grad_enabled(True)


# -- Decentralized's exchange over the compiled average job ------------------------------------
cdef class ExchangeRound:
    """One round of ``DecentralizedImpl``'s compiled path, in two halves: :meth:`start` (at
    the forward) does what ``gather_weights()`` does for every bucket (a parameter that is no
    longer a view of its slot is copied in) and starts the exchange (``launch(round_)``,
    ``bagua_comm._peer_average``), returning its handle; :meth:`finish` (at the end of
    backward) waits for it, writes the averages into the flat weights (``launch.copy_out()``)
    and does what ``scatter_weights()`` does; with autograd off, as under
    ``torch.no_grad()``."""

    cdef list params, views
    cdef object launch

    def __init__(self, list params, list views, launch):
        self.params, self.views, self.launch = params, views, launch

    def start(self, Py_ssize_t round_):
        cdef bint grad_mode = _is_grad_enabled()
        if grad_mode:
            _set_grad_enabled(False)
        try:
            for ps, vs in zip(self.params, self.views):
                for p, v in zip(ps, vs):
                    if not _same_storage(p.data, v):
                        v.copy_(p)
        finally:
            if grad_mode:
                _set_grad_enabled(True)
        return self.launch(round_)

    def finish(self, work):
        cdef bint grad_mode
        work.wait()
        self.launch.copy_out()
        grad_mode = _is_grad_enabled()
        if grad_mode:
            _set_grad_enabled(False)
        try:
            for ps, vs in zip(self.params, self.views):
                for p, v in zip(ps, vs):
                    if not _same_storage(p.data, v):
                        p.copy_(v)
        finally:
            if grad_mode:
                _set_grad_enabled(True)


cdef inline bint _same_storage(a, b):
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


# -- TopK's sparse exchange, one compiled job per bucket --------------------------------------
_topk = torch.topk
_index_select = torch.index_select
_norm = torch.linalg.vector_norm
_INF = float("inf")
_where = torch.where
_add = torch.add
_abs = torch.abs


cdef class TopKRound:
    """One bucket's TopK exchange (``TopKImpl.exchange`` without compressor or momentum, flat,
    float32, gloo CPU), built by ``bagua_algos.algorithms._topk_round``, run on the group's
    worker thread with no Python frame; the same torch operations on the same values, so
    bit for bit the Python path.

    ``nxt = residual + grad``; per group of equal-size slots (a strided view of ``|nxt|``,
    or ``take`` of it), ``topk`` written into its rows of ``sent_idx`` (slots that send every
    entry have their indices there already); the values picked (and, on the last bucket, the
    flags) into ``values``; both allgathered over ``aux``; ``nxt`` loses what was sent; the
    gathered pairs added in rank order into ``full`` (the bucket's ``grad_and_flags``, zeroed:
    the flags' indices point past the gradients, so they come out summed); ``dense`` divided
    (average); ``residual = nxt`` where ``dense`` is all finite.  Per step: 2 G + 12
    torch operations (G groups; one more to carry the flags) and no Python call."""

    cdef object grad, full, dense, residual, nxt, mag
    cdef list groups                 # (rows or None, take index or None, k, offsets, out)
    cdef object sent_idx, idx_k, values, vals_k, flags, flags_dst, all_idx, all_vals
    cdef object gather, topv, topi
    cdef object n
    cdef bint average

    def __init__(self, grad, full, dense, residual, nxt, mag, list groups, sent_idx, idx_k,
                 values, vals_k, flags, flags_dst, all_idx, all_vals, gather, n, average):
        self.grad, self.full, self.dense, self.residual = grad, full, dense, residual
        self.nxt, self.mag, self.groups = nxt, mag, groups
        self.sent_idx, self.idx_k, self.values, self.vals_k = sent_idx, idx_k, values, vals_k
        self.flags, self.flags_dst = flags, flags_dst
        self.all_idx, self.all_vals, self.gather = all_idx, all_vals, gather
        self.n, self.average = n, average

    def __call__(self):
        _add(self.residual, self.grad, out=self.nxt)
        _abs(self.nxt, out=self.mag)
        for rows, take, k, offsets, out in self.groups:
            if rows is None:
                rows = self.mag.take(take)
            _add(_topk(rows, k, 1, True, False)[1], offsets, out=out)
        _index_select(self.nxt, 0, self.idx_k, out=self.vals_k)
        if self.flags is not None:
            self.flags_dst.copy_(self.flags)
        w_idx = self.gather(self.all_idx, self.sent_idx)
        w_val = self.gather(self.all_vals, self.values)
        self.nxt.index_add_(0, self.idx_k, self.vals_k, alpha=-1)   # keep what was not sent
        w_idx.wait()
        w_val.wait()
        self.full.zero_()
        self.full.index_add_(0, self.all_idx, self.all_vals)       # rank order
        if self.average:
            self.dense.div_(self.n)
        # an overflow on any rank reached every rank: keep the residual as it was (the
        # inf-norm is NaN or infinite exactly where an entry is: 2 ops, isfinite's all 5)
        _where(_norm(self.dense, _INF) < _INF, self.nxt, self.residual, out=self.residual)


cdef class WorkerLauncher:
    """Call it to hand ``job`` (a compiled callable) to ``worker`` (the group's
    ``bagua_comm._worker.Worker``), recording ``nbytes`` sent by ``primitive``: returns the
    job's completion handle."""

    cdef object submit, job, lock, counts
    cdef object nbytes
    cdef str primitive

    def __init__(self, worker, job, nbytes, str primitive):
        from bagua_comm import traffic

        self.submit, self.job = worker.submit, job
        self.lock, self.counts = traffic._lock, traffic._bytes
        self.nbytes, self.primitive = int(nbytes), primitive

    def __call__(self):
        with self.lock:
            self.counts[self.primitive] += self.nbytes
        return self.submit(self.job)


# -- LowRank's power step, one compiled job per bucket ----------------------------------------
_matmul = torch.matmul
_qr = torch.linalg.qr
_take = torch.take
_reciprocal = torch.reciprocal
_zeros_like = torch.zeros_like


cdef class LowRankRound:
    """One bucket's LowRank exchange (``LowRankImpl.exchange`` without compressor, warm
    start, flat, float32, gloo CPU), built by ``bagua_algos.algorithms._low_rank_round``, run
    on the group's worker thread with no Python frame: the Python path's products, QR and
    allreduces per matrix, in its order, on the same values, into buffers made once.  What
    is elementwise runs once over the bucket: the uncompressed runs moved by one ``take`` and
    one ``put_`` (or a copy each, for one or two runs), the residuals and Q kept in one flat
    buffer each (the ``LowRankImpl`` state's tensors are views of them) and updated by one
    ``where`` each; with ``gather`` (three or more matrices) ``M = residual + G`` and
    ``M -= M̂`` over all of them at once, ``M̂`` reaching the bucket by one ``put_``.
    ``mats[i]`` is ``(M, residual, gradient, P, Mᵀ, Q, new Q, new Qᵀ, M̂ out, QR's Q, R)``;
    ``QR's Q`` is None for a rank-1 factor (normalised in place, as ``orthogonalize``)."""

    cdef object tensor, first, second, take_idx, first_plain
    cdef object res_flat, m_flat, q_flat, gather, gbuf, approx
    cdef list plain, mats
    cdef object allreduce, opts
    cdef object n
    cdef bint average

    def __init__(self, tensor, first, second, take_idx, first_plain, list plain, list mats,
                 res_flat, m_flat, q_flat, gather, gbuf, approx, allreduce, opts, n, average):
        self.tensor, self.first, self.second = tensor, first, second
        self.take_idx, self.first_plain, self.plain, self.mats = take_idx, first_plain, plain, mats
        self.res_flat, self.m_flat, self.q_flat = res_flat, m_flat, q_flat
        self.gather, self.gbuf, self.approx = gather, gbuf, approx
        self.allreduce, self.opts, self.n, self.average = allreduce, opts, n, average

    cdef void _reduce(self, t) except *:
        self.allreduce([t], self.opts).wait()
        if self.average:
            t.div_(self.n)

    def __call__(self):
        if self.take_idx is not None:
            _take(self.tensor, self.take_idx, out=self.first_plain)
        else:
            for src, dst in self.plain:
                dst.copy_(src)
        if self.gather is not None:
            _take(self.tensor, self.gather, out=self.gbuf)
            _add(self.res_flat, self.gbuf, out=self.m_flat)
        for m, res, grad, p, _m_t, q, _qn, _qnt, _out, _qq, _rr in self.mats:
            if self.gather is None:
                _add(res, grad, out=m)
            _matmul(m, q, out=p)
        self._reduce(self.first)
        if self.take_idx is not None:
            self.tensor.put_(self.take_idx, self.first_plain)
        else:
            for dst, src in self.plain:
                dst.copy_(src)
        if not self.mats:
            return
        for _m, _res, _grad, p, m_t, _q, q_new, _qnt, _out, qq, rr in self.mats:
            if qq is None:
                _normalise(p)
                qq = p
            else:
                _qr(p, out=(qq, rr))
            _matmul(m_t, qq, out=q_new)
        self._reduce(self.second)
        for m, _res, _grad, p, _m_t, _q, _qn, q_new_t, out, qq, _rr in self.mats:
            _matmul(p if qq is None else qq, q_new_t, out=out)       # M̂
            if self.gather is None:
                m.sub_(out)
        if self.gather is not None:
            self.m_flat.sub_(self.approx)
            self.tensor.put_(self.gather, self.approx)
        # an overflow on any rank reached every rank: residuals and Q stay as they were
        ok = _norm(self.second, _INF) < _INF
        _where(ok, self.m_flat, self.res_flat, out=self.res_flat)
        _where(ok, self.second, self.q_flat, out=self.q_flat)


cdef _normalise(p):
    """``low_rank.orthogonalize`` of one column: the same torch operations."""
    norm = _norm(p)
    p.mul_(_where(norm > 0, _reciprocal(norm) * 1, _zeros_like(norm)))
