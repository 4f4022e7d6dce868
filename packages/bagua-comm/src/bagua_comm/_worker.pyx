# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""A gloo group's worker thread, and the compressed collectives it runs without Python.

:class:`Worker` runs jobs one after another, in submission order (the same on every rank:
multi-phase collectives stay matched across ranks), on one thread whose loop is compiled: a
job is a Python callable (``GlooBackend.run``) or a compiled :class:`Job` (the compressed
allreduce's :class:`CompressedJob`, LowPrecisionDecentralized's ring round :class:`RingJob`,
Decentralized's exchange :class:`AverageJob`), whose ``run`` calls torch's process-group
methods and the MinMaxUInt8 kernels (``_minmax.pxd``) directly.  Jobs are handed over
through a ``collections.deque`` and a ``_thread`` lock used as the worker's wake-up signal,
and complete a :class:`Done` handle: all C, so a compiled job costs its submitter and the
worker no Python frame.  Every decision that needs Python (argument checks, sizes, buffers,
the torch option objects) was made when the job was built (``bagua_comm._compressed._job``,
``bagua_comm._ring``, ``bagua_comm._peer_average``).
"""

from collections import deque
from _thread import allocate_lock
import threading
import weakref

from libc.stdint cimport uint8_t
from libc.string cimport memcpy, memset

import torch

from bagua_comm cimport _minmax
from bagua_comm import traffic

_set_result = torch._C.Future.set_result
_set_unwrap = torch._C.Future._set_unwrap_func

cdef Py_ssize_t _handed = 0            # jobs handed to a worker thread, ever (benchmarks)
_workers = weakref.WeakSet()           # live workers (benchmarks: a no-op job reaches each)


def handed_over():
    """How many jobs have been handed to a worker thread in this process."""
    return _handed


def workers():
    """The live workers (their threads started or not)."""
    return list(_workers)


def _raise(error):
    raise error


cdef class Done:
    """A job's completion: ``wait()`` blocks until it ran and raises its exception;
    ``is_completed()``; ``value`` is a callable job's return value."""

    cdef object _lock               # held until the job completes
    cdef bint _done
    cdef object _error
    cdef public object value
    cdef object fut                 # a torch future completed with ``fut_value``, or None
    cdef object fut_value

    def wait(self):
        if not self._done:
            self._lock.acquire()
            self._lock.release()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        return self._done

    cdef void _finish(self, error) except *:
        self._error = error
        self._done = True
        self._lock.release()
        fut, self.fut = self.fut, None
        if fut is None:
            return
        try:                        # as torch.futures.Future.set_exception / set_result
            if error is not None:
                _set_unwrap(fut, _raise)
                _set_result(fut, error)
            else:
                _set_result(fut, self.fut_value)
        except BaseException:       # completed elsewhere already: the worker carries on
            pass
        self.fut_value = None


cdef class Worker:
    """One thread running jobs in submission order (started when the worker is made, so that
    two first submissions cannot both start one; a daemon thread, as the old executor's
    threads were joined only by ``close``)."""

    cdef object jobs                # deque of (Done, job); None stops the thread
    cdef object wake                # locked while the worker sleeps on an empty queue
    cdef bint sleeping
    cdef public bint closed
    cdef object thread
    cdef str name
    cdef object __weakref__

    def __init__(self, str name):
        self.jobs = deque()
        self.wake = allocate_lock()
        self.wake.acquire()
        self.sleeping = False
        self.closed = False
        self.name = name
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()
        _workers.add(self)

    cpdef Done submit(self, job, fut=None, value=None):
        """Run ``job`` (a compiled :class:`Job` or a no-argument callable) after those
        submitted before; then complete ``fut`` (a ``torch._C.Future``, if given) with
        ``value``, or with the job's exception, from the worker thread."""
        global _handed
        if self.closed:
            raise RuntimeError("bagua_comm: this group's worker was closed (the group was "
                               "destroyed)")
        cdef Done done = Done.__new__(Done)
        done._lock = allocate_lock()
        done._lock.acquire()
        done.fut, done.fut_value = fut, value
        # Under the GIL, with nothing between that can release it: the worker either sees
        # the job before it sleeps or is asleep and woken here.
        self.jobs.append((done, job))
        _handed += 1
        if self.sleeping:
            self.sleeping = False
            self.wake.release()
        return done

    def _loop(self):
        cdef Done done
        while True:
            if not self.jobs:
                self.sleeping = True
                self.wake.acquire()
                continue
            item = self.jobs.popleft()
            if item is None:
                return
            done, job = item
            item = None
            error = None
            try:
                if isinstance(job, Job):
                    (<Job>job).run()
                else:
                    done.value = job()
            except BaseException as err:        # handed to whoever waits
                error = err
            job = None
            done._finish(error)
            done = None
            error = None

    def close(self, bint wait=True):
        """Stop the thread after the jobs submitted so far (waiting for them with
        ``wait``); later submissions raise."""
        if self.closed:
            return
        self.closed = True
        self.jobs.append(None)
        if self.sleeping:
            self.sleeping = False
            self.wake.release()
        if wait and self.thread is not threading.current_thread():
            self.thread.join()


cdef class Job:
    """A job the worker runs without a Python frame: its ``run`` is C."""

    cpdef run(self):
        pass


cdef class CompressedJob(Job):
    """``compressed_allreduce(send, recv, op, MinMaxUInt8(n * k))`` on gloo CPU tensors, its four
    phases in one compiled call (see ``bagua_comm._compressed``): compress the (padded) input
    into ``n * k`` records, exchange rank ``j``'s ``k`` with it, decode-and-reduce the ``n``
    received rows into this rank's float32 segment, re-compress it, exchange it with every
    rank, decode all.  Built by ``bagua_comm._compressed._job``: the buffers, sizes and torch
    objects below are checked and made there, once."""

    cdef object send, recv              # the caller's flat tensors
    cdef object padded                  # send's dtype, ``n * seg`` elements, or None
    cdef object payload, received, mine, own_in, own, gathered, dec, dec_head
    cdef object tail                    # float32 values summed exactly in phase 3, or None
    cdef list recv1, send1, recv3, send3    # per peer: [row] for torch's recv / send
    cdef list peers
    cdef object a_recv, a_send          # the auxiliary torch group's recv / send
    cdef object lut                     # keeps the float16 table alive (``tab``)
    cdef const float* tab
    cdef Py_ssize_t n, me, numel, live, seg, k, rec, esize, tb
    cdef int kind, op

    def __init__(self, send, recv, padded, payload, received, mine, own_in, own, gathered,
                 dec, list payload_rows, list received_rows, list gathered_rows, aux,
                 Py_ssize_t me, Py_ssize_t k, Py_ssize_t rec, int kind, lut, int op,
                 Py_ssize_t live, tail=None):
        cdef Py_ssize_t j
        cdef const float[::1] table = lut
        self.send, self.recv, self.padded = send, recv, padded
        self.payload, self.received, self.mine = payload, received, mine
        self.own_in, self.own, self.gathered, self.dec = own_in, own, gathered, dec
        self.n = len(received_rows)
        self.me, self.k, self.rec, self.kind, self.op = me, k, rec, kind, op
        self.numel = send.numel()
        self.live = live          # elements of send before its zero padding
        self.seg = mine.numel()
        self.esize = send.element_size()
        self.peers = [j for j in range(self.n) if j != me]
        self.recv1 = [[received_rows[j]] for j in self.peers]
        self.send1 = [[payload_rows[j]] for j in self.peers]
        self.recv3 = [[gathered_rows[j]] for j in self.peers]
        self.send3 = [[own] for _ in self.peers]
        self.a_recv, self.a_send = aux.recv, aux.send
        self.lut = lut
        self.tab = &table[0] if table.shape[0] else NULL
        self.dec_head = dec[:self.numel] if dec is not None else None
        # the exact tail: ``own`` and each gathered row end with ``tb`` bytes of this rank's
        # (and each rank's) float32 ``tail``, reduced (op SUM or AVG) into ``tail``
        self.tail = tail
        self.tb = tail.numel() * 4 if tail is not None else 0

    cdef void _exchange(self, list recvs, list sends, const uint8_t* mine_src,
                        uint8_t* mine_dst, Py_ssize_t row) except *:
        """Every receive posted before the first send (``GlooBackend.exchange``), this rank's
        own row copied, then all waited."""
        cdef Py_ssize_t i
        works = [self.a_recv(recvs[i], self.peers[i], 0) for i in range(len(self.peers))]
        for i in range(len(self.peers)):
            works.append(self.a_send(sends[i], self.peers[i], 0))
        with nogil:
            memcpy(mine_dst, mine_src, row)
        for w in works:
            w.wait()

    cpdef run(self):
        cdef Py_ssize_t n = self.n, seg = self.seg, k = self.k, rec = self.rec
        cdef Py_ssize_t chunks = n * k, padded = n * seg
        cdef int kind = self.kind, op = self.op
        cdef const float* tab = self.tab
        cdef char* x = <char*><Py_ssize_t>self.send.data_ptr()
        cdef char* pad
        cdef uint8_t* payload = <uint8_t*><Py_ssize_t>self.payload.data_ptr()
        cdef uint8_t* received = <uint8_t*><Py_ssize_t>self.received.data_ptr()
        cdef float* mine = <float*><Py_ssize_t>self.mine.data_ptr()
        cdef uint8_t* own = <uint8_t*><Py_ssize_t>self.own.data_ptr()
        cdef uint8_t* gathered = <uint8_t*><Py_ssize_t>self.gathered.data_ptr()
        cdef const void* own_src = mine
        cdef float* out
        cdef Py_ssize_t row = k * rec
        cdef Py_ssize_t tb = self.tb, row3 = row + tb, j
        cdef float* tail = NULL
        if self.padded is not None:         # zero-padded to the compressor's alignment
            pad = <char*><Py_ssize_t>self.padded.data_ptr()
            with nogil:
                memcpy(pad, x, self.live * self.esize)
                memset(pad + self.live * self.esize, 0, (padded - self.live) * self.esize)
            x = pad
        elif self.live < self.numel:        # send's own padding (a bucket's), zeroed
            with nogil:
                memset(x + self.live * self.esize, 0, (self.numel - self.live) * self.esize)
        # 1. my records for rank j go to rank j
        with nogil:
            _minmax.compress_any(x, padded // chunks, kind, tab, chunks, payload, rec)
        self._exchange(self.recv1, self.send1, payload + self.me * row,
                       received + self.me * row, row)
        # 2. the n rows of my segment decoded and reduced in float32
        with nogil:
            _minmax.decode_reduce_any(received, rec, k, n, kind, tab, mine, seg, op)
        # 3. my segment re-compressed (in the input's type) and gathered by every rank
        if self.own_in is not None:
            self.own_in.copy_(self.mine)
            own_src = <const void*><Py_ssize_t>self.own_in.data_ptr()
        if tb:
            tail = <float*><Py_ssize_t>self.tail.data_ptr()
        with nogil:
            _minmax.compress_any(own_src, seg // k, kind, tab, k, own, rec)
            if tb:
                memcpy(own + row, tail, tb)
        self._exchange(self.recv3, self.send3, own, gathered + self.me * row3, row3)
        # 4. everything decoded (16-bit: into float32, then rounded by torch's copy, as
        # ``MinMaxUInt8.decompress`` does; float32 with padding: into the padded buffer,
        # which phase 1 was the last to read)
        if self.dec is not None:
            out = <float*><Py_ssize_t>self.dec.data_ptr()
        elif self.padded is not None:
            out = <float*><Py_ssize_t>self.padded.data_ptr()
        else:
            out = <float*><Py_ssize_t>self.recv.data_ptr()
        with nogil:
            if not tb:
                _minmax.decode_reduce_any(gathered, rec, chunks, 1, kind, tab, out, padded, 0)
            else:       # row by row (each record decodes alone: the same values), then
                for j in range(n):      # the tails, summed in rank order
                    _minmax.decode_reduce_any(gathered + j * row3, rec, k, 1, kind, tab,
                                              out + j * seg, seg, 0)
                _sum_tails(gathered + row, row3, n, tail, tb // 4, op == 1)
        if self.dec is not None:
            self.recv.copy_(self.dec_head)
        elif self.padded is not None:
            x = <char*><Py_ssize_t>self.recv.data_ptr()
            with nogil:
                memcpy(x, out, self.numel * 4)


cdef void _sum_tails(const uint8_t* first, Py_ssize_t stride, Py_ssize_t rows, float* out,
                     Py_ssize_t count, bint average) noexcept nogil:
    """``out[i]`` = the sum over the ``rows`` float32 arrays at ``first + r * stride`` (not
    necessarily aligned) of their ``i``-th value, in row order; divided by ``rows`` with
    ``average``."""
    cdef Py_ssize_t i, r
    cdef float acc, v
    for i in range(count):
        memcpy(&acc, first + i * 4, 4)
        for r in range(1, rows):
            memcpy(&v, first + r * stride + i * 4, 4)
            acc = acc + v
        out[i] = acc / <float>rows if average else acc


cdef void _ring_difference(const float* w, const float* left, const float* right,
                           const float* x, float* d, Py_ssize_t live,
                           Py_ssize_t n) noexcept nogil:
    """``d = w + left/3 + right/3 - 5/3 x`` over ``live`` elements, zero after: the float32
    operations of ``LowPrecisionDecentralizedImpl._ring_step`` (``div``, ``add_``, ``div``,
    ``add_``, ``mul``, ``sub_``) in their order, each rounded as torch rounds it (this module
    is built with ``-ffp-contract=off``: no fused multiply-add)."""
    cdef Py_ssize_t i
    cdef float three = 3.0
    cdef float five_thirds = <float>(5.0 / 3.0)
    for i in range(live):
        d[i] = ((left[i] / three + w[i]) + right[i] / three) - x[i] * five_thirds
    memset(d + live, 0, (n - live) * sizeof(float))


cdef class RingJob(Job):
    """One bucket's LowPrecisionDecentralized round on gloo CPU float32 tensors with
    ``MinMaxUInt8(chunks)``: the difference ``d = w + l/3 + r/3 - 5/3 x`` compressed into
    ``payload``, ``x += decode(payload)``, ``w = x``; ``payload`` sent to the ring neighbours
    (one message when they are the same rank) while theirs are received; each replica
    ``l``, ``r`` moved by the decoding of its owner's payload.  Bit for bit the Python path
    (``_ring_step``).  Built by ``bagua_comm._ring``, which checked every size here."""

    cdef object w, x, left, right, diff, payload, from_left, from_right
    cdef list recvs, sends, recv_peers, send_peers
    cdef object a_recv, a_send
    cdef object lut
    cdef const float* tab
    cdef Py_ssize_t n, live, chunks, rec
    cdef int kind
    cdef bint two

    def __init__(self, w, x, left, right, diff, payload, from_left, from_right,
                 Py_ssize_t live, Py_ssize_t chunks, Py_ssize_t rec, int kind, lut,
                 Py_ssize_t left_rank, Py_ssize_t right_rank, aux):
        cdef const float[::1] table = lut
        self.w, self.x, self.left, self.right, self.diff = w, x, left, right, diff
        self.payload, self.from_left, self.from_right = payload, from_left, from_right
        self.n, self.live, self.chunks, self.rec, self.kind = w.numel(), live, chunks, rec, kind
        self.two = left_rank != right_rank
        # receives first, then sends, in the order of the Python path's grouped exchange
        self.recv_peers = [left_rank, right_rank] if self.two else [left_rank]
        self.recvs = [[from_left], [from_right]] if self.two else [[from_left]]
        self.send_peers = list(self.recv_peers)
        self.sends = [[payload] for _ in self.send_peers]
        self.a_recv, self.a_send = aux.recv, aux.send
        self.lut = lut
        self.tab = &table[0] if table.shape[0] else NULL

    cpdef run(self):
        cdef Py_ssize_t i, n = self.n, chunks = self.chunks, rec = self.rec
        cdef int kind = self.kind
        cdef const float* tab = self.tab
        cdef float* w = <float*><Py_ssize_t>self.w.data_ptr()
        cdef float* x = <float*><Py_ssize_t>self.x.data_ptr()
        cdef float* left = <float*><Py_ssize_t>self.left.data_ptr()
        cdef float* right = <float*><Py_ssize_t>self.right.data_ptr()
        cdef float* d = <float*><Py_ssize_t>self.diff.data_ptr()
        cdef uint8_t* payload = <uint8_t*><Py_ssize_t>self.payload.data_ptr()
        cdef uint8_t* from_left = <uint8_t*><Py_ssize_t>self.from_left.data_ptr()
        cdef uint8_t* from_right = <uint8_t*><Py_ssize_t>self.from_right.data_ptr()
        with nogil:
            _ring_difference(w, left, right, x, d, self.live, n)
            _minmax.compress_any(d, n // chunks, kind, tab, chunks, payload, rec)
            _minmax.decode_reduce_any(payload, rec, chunks, 1, kind, tab, x, n, 4)
            memcpy(w, x, n * sizeof(float))
        works = [self.a_recv(self.recvs[i], self.recv_peers[i], 0)
                 for i in range(len(self.recvs))]
        for i in range(len(self.sends)):
            works.append(self.a_send(self.sends[i], self.send_peers[i], 0))
        for work in works:
            work.wait()
        with nogil:
            _minmax.decode_reduce_any(from_left, rec, chunks, 1, kind, tab, left, n, 4)
            _minmax.decode_reduce_any(from_right, rec, chunks, 1, kind, tab, right, n, 4)


cdef inline float* _f32(t) except NULL:
    return <float*><Py_ssize_t>t.data_ptr()


cdef Py_ssize_t shift_one_peer(Py_ssize_t rank, Py_ssize_t size, Py_ssize_t r) noexcept:
    """Bagua's ``shift_one`` pairing (``bagua_algos.algorithms.decentralized``): a rank of
    the lower half meets one of the upper half, the pairing rotating by one every round."""
    cdef Py_ssize_t half = size // 2
    r = r % half
    if rank < half:
        return (rank + r) % half + half
    return ((rank - half - r) % half + half) % half


cdef class AverageJob(Job):
    """Decentralized's exchange of one round over a layout's buckets, on gloo CPU float32
    tensors: each bucket's buffer (the weights, copied in by :meth:`copy_in`) averaged with
    the peers: ``all``: the buffers' allreduce sum (every one started, then each waited)
    divided by the group's size; ``shift_one``: every buffer received from and sent to this
    round's peer (:attr:`round`), then ``(mine + theirs) / 2``.  Bit for bit the Python path
    (``DecentralizedImpl``: ``allreduce_inplace(AVG)``, ``exchange_shift_one``).
    :meth:`copy_out` writes the averages into the weights (at the end of backward, on the
    training thread).  Built by ``bagua_comm._peer_average``, which checked every size."""

    cdef list weights, bufs, theirs, bufs1, theirs1, sizes
    cdef object a_allreduce, a_recv, a_send, opts
    cdef Py_ssize_t rank, size
    cdef public Py_ssize_t round
    cdef bint shift

    def __init__(self, list weights, list bufs, list theirs, bint shift, Py_ssize_t rank,
                 Py_ssize_t size, aux, opts):
        self.weights, self.bufs, self.theirs = weights, bufs, theirs
        self.bufs1 = [[b] for b in bufs]
        self.theirs1 = [[t] for t in theirs]
        self.sizes = [b.numel() for b in bufs]
        self.shift, self.rank, self.size, self.round = shift, rank, size, 0
        self.a_allreduce, self.a_recv, self.a_send = aux.allreduce, aux.recv, aux.send
        self.opts = opts

    cpdef run(self):
        cdef Py_ssize_t i, j, n, k = len(self.bufs), peer
        cdef float* b
        cdef float* t
        cdef float size = <float>self.size
        cdef float two = 2.0
        if not self.shift:
            works = [self.a_allreduce(self.bufs1[i], self.opts) for i in range(k)]
            for i in range(k):
                works[i].wait()
                b, n = _f32(self.bufs[i]), self.sizes[i]
                with nogil:
                    for j in range(n):
                        b[j] = b[j] / size
            return
        # receives first, then sends, in bucket order (messages between two ranks match in
        # their order), as ``exchange_shift_one`` posts them
        peer = shift_one_peer(self.rank, self.size, self.round)
        works = [self.a_recv(self.theirs1[i], peer, 0) for i in range(k)]
        works += [self.a_send(self.bufs1[i], peer, 0) for i in range(k)]
        for work in works:
            work.wait()
        for i in range(k):
            b, t, n = _f32(self.bufs[i]), _f32(self.theirs[i]), self.sizes[i]
            with nogil:
                for j in range(n):
                    b[j] = (b[j] + t[j]) / two

    cpdef copy_in(self):
        """The weights into the buffers (on the submitting thread, before the job: the
        weights the caller's forward starts from)."""
        cdef Py_ssize_t i, n
        cdef float* b
        cdef float* w
        for i in range(len(self.bufs)):
            w, b, n = _f32(self.weights[i]), _f32(self.bufs[i]), self.sizes[i]
            with nogil:
                memcpy(b, w, n * sizeof(float))

    cpdef copy_out(self):
        """The averaged buffers into the weights."""
        cdef Py_ssize_t i, n
        cdef float* b
        cdef float* w
        for i in range(len(self.bufs)):
            w, b, n = _f32(self.weights[i]), _f32(self.bufs[i]), self.sizes[i]
            with nogil:
                memcpy(w, b, n * sizeof(float))


cdef class RoundLauncher:
    """Call it with a round number to start the :class:`AverageJob` it was built for: the
    weights are copied into the buffers, the traffic is recorded (as ``primitive``) and the
    job handed to the group's worker; returns its :class:`Done`.  :meth:`copy_out` is the
    job's, once that is done."""

    cdef Worker worker
    cdef AverageJob job
    cdef object nbytes
    cdef str primitive

    def __init__(self, Worker worker, AverageJob job, nbytes, str primitive):
        self.worker, self.job = worker, job
        self.nbytes = int(nbytes)
        self.primitive = primitive

    def __call__(self, Py_ssize_t round_):
        self.job.round = round_       # the previous round was waited for: the job is idle
        self.job.copy_in()
        with traffic._lock:
            traffic._bytes[self.primitive] += self.nbytes
        return self.worker.submit(self.job)

    cpdef copy_out(self):
        self.job.copy_out()


cdef class CompressedLauncher:
    """Call it to start the compiled job it was built for (a compressed allreduce, a ring
    round): the traffic is recorded (as ``primitive``) and the job handed to the group's
    worker; returns its :class:`Done`."""

    cdef Worker worker
    cdef Job job
    cdef object nbytes
    cdef str primitive

    def __init__(self, Worker worker, Job job, nbytes, str primitive="compressed_allreduce"):
        self.worker = worker
        self.job = job
        self.nbytes = int(nbytes)
        self.primitive = primitive

    def __call__(self):
        with traffic._lock:
            traffic._bytes[self.primitive] += self.nbytes
        return self.worker.submit(self.job)

    def into_future(self, fut, value):
        """Start it, and have the worker complete the ``torch._C.Future`` ``fut`` with
        ``value`` when it is done (a DDP communication hook's future: no waiter thread)."""
        with traffic._lock:
            traffic._bytes[self.primitive] += self.nbytes
        self.worker.submit(self.job, fut, value)
