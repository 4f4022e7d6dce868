# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin binding over libnccl, opened with dlopen at first use.

Nothing here includes nccl.h or links NCCL/CUDA: the ABI is restated in _nccl.pxd, the
library is opened by path (see _nccl_loader.py), every entry point is resolved once into a
table when it loads (no per-call dlsym), and every NCCL call runs without the GIL.
"""


import threading
import time

from libc.string cimport memcpy


cdef extern from "<dlfcn.h>" nogil:
    void* dlopen(const char*, int)
    void* dlsym(void*, const char*)
    char* dlerror()
    int RTLD_NOW
    int RTLD_GLOBAL

cdef enum:
    IN_PROGRESS = 7     # ncclInProgress: a non-blocking communicator is still busy

# The symbol table: every entry point we call, resolved once by load_library() (under
# _load_lock) and never looked up again.  An entry an older libnccl lacks stays NULL and the
# function that needs it raises NcclMissingSymbol when called.
cdef void* _handle = NULL
cdef GetVersion_t _GetVersion = NULL
cdef GetUniqueId_t _GetUniqueId = NULL
cdef GetErrorString_t _GetErrorString = NULL
cdef GetLastError_t _GetLastError = NULL
cdef CommInitRank_t _CommInitRank = NULL
cdef CommInitRankConfig_t _CommInitRankConfig = NULL
cdef CommOp_t _CommDestroy = NULL
cdef CommOp_t _CommAbort = NULL
cdef CommGetAsyncError_t _CommGetAsyncError = NULL
cdef CommInfo_t _CommCount = NULL
cdef CommInfo_t _CommUserRank = NULL
cdef AllReduce_t _AllReduce = NULL
cdef Reduce_t _Reduce = NULL
cdef Broadcast_t _Broadcast = NULL
cdef AllGather_t _AllGather = NULL
cdef ReduceScatter_t _ReduceScatter = NULL
cdef SendRecv_t _Send = NULL
cdef SendRecv_t _Recv = NULL
cdef Group_t _GroupStart = NULL
cdef Group_t _GroupEnd = NULL

_path = None
_version = 0
_load_lock = threading.Lock()
_symbols = {}

# Entry points without which the library is not usable as libnccl at all.
REQUIRED = ("ncclGetVersion", "ncclGetErrorString", "ncclGetUniqueId")
# The rest, with the NCCL release that introduced each (for the missing-symbol message).
OPTIONAL = {
    "ncclGetLastError": "2.13", "ncclCommInitRank": "2.0", "ncclCommInitRankConfig": "2.14",
    "ncclCommDestroy": "2.0",
    "ncclCommAbort": "2.4", "ncclCommGetAsyncError": "2.4", "ncclCommCount": "2.0",
    "ncclCommUserRank": "2.0", "ncclAllReduce": "2.0", "ncclReduce": "2.0",
    "ncclBroadcast": "2.0", "ncclAllGather": "2.0", "ncclReduceScatter": "2.0",
    "ncclSend": "2.7", "ncclRecv": "2.7", "ncclGroupStart": "2.0", "ncclGroupEnd": "2.0",
}
SYMBOLS = REQUIRED + tuple(OPTIONAL)


class NcclError(RuntimeError):
    """An NCCL call failed: ``status`` is the ncclResult_t, the message NCCL's own."""

    def __init__(self, status, message=None):
        self.status = int(status)
        self.message = message if message is not None else error_string(status)
        super().__init__(f"NCCL error {self.status}: {self.message}")

    def __reduce__(self):
        return (NcclError, (self.status, self.message))


class NcclMissingSymbol(NcclError):
    """The loaded libnccl lacks an entry point the called function needs (an older NCCL)."""

    def __init__(self, symbol, version=None, path=None):
        self.symbol = symbol
        self.version = version if version is not None else version_string()
        self.path = path if path is not None else _path
        since = OPTIONAL.get(symbol)
        need = f"; it needs NCCL >= {since}" if since else ""
        NcclError.__init__(
            self, -1, f"{symbol} is missing from libnccl {self.version} ({self.path}){need}: "
            "upgrade NCCL (pip install -U nvidia-nccl-cu12 or nvidia-nccl-cu13) or point "
            "BAGUA_NCCL_LIBRARY at a newer libnccl.so.2")

    def __reduce__(self):
        return (NcclMissingSymbol, (self.symbol, self.version, self.path))


def _decode_version(int code):
    """(major, minor, patch) of an NCCL_VERSION_CODE (2.9+: x*10000, older: x*1000)."""
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    minor, patch = divmod(rest, 100)
    return major, minor, patch


def version_string():
    """The loaded library's version as "2.27.3" (or "unknown" before loading)."""
    return ".".join(map(str, _decode_version(_version))) if _version else "unknown"


cdef int _missing(str name) except -1:
    raise NcclMissingSymbol(name)


cdef inline int _check(ncclResult_t status, ncclComm_t comm=NULL) except -1:
    if status != 0:
        raise NcclError(status, _message(status, comm))
    return 0


cdef str _message(ncclResult_t status, ncclComm_t comm):
    """NCCL's string for ``status``, plus its last-error detail when the library has one."""
    msg = error_string(status)
    cdef const char* detail = NULL
    if _GetLastError != NULL:
        with nogil:
            detail = _GetLastError(comm)
        if detail != NULL and detail[0] != 0:
            msg = f"{msg}: {detail.decode(errors='replace')}"
    return msg


cdef void* _resolve(void* h, str name):
    cdef bytes b = name.encode()
    cdef void* p = dlsym(h, b)
    _symbols[name] = p != NULL
    return p


cdef int _fill_table(void* h) except -1:
    global _GetVersion, _GetUniqueId, _GetErrorString, _GetLastError, _CommInitRank
    global _CommInitRankConfig
    global _CommDestroy, _CommAbort, _CommGetAsyncError, _CommCount, _CommUserRank
    global _AllReduce, _Reduce, _Broadcast, _AllGather, _ReduceScatter, _Send, _Recv
    global _GroupStart, _GroupEnd
    _GetVersion = <GetVersion_t>_resolve(h, "ncclGetVersion")
    _GetErrorString = <GetErrorString_t>_resolve(h, "ncclGetErrorString")
    _GetUniqueId = <GetUniqueId_t>_resolve(h, "ncclGetUniqueId")
    _GetLastError = <GetLastError_t>_resolve(h, "ncclGetLastError")
    _CommInitRank = <CommInitRank_t>_resolve(h, "ncclCommInitRank")
    _CommInitRankConfig = <CommInitRankConfig_t>_resolve(h, "ncclCommInitRankConfig")
    _CommDestroy = <CommOp_t>_resolve(h, "ncclCommDestroy")
    _CommAbort = <CommOp_t>_resolve(h, "ncclCommAbort")
    _CommGetAsyncError = <CommGetAsyncError_t>_resolve(h, "ncclCommGetAsyncError")
    _CommCount = <CommInfo_t>_resolve(h, "ncclCommCount")
    _CommUserRank = <CommInfo_t>_resolve(h, "ncclCommUserRank")
    _AllReduce = <AllReduce_t>_resolve(h, "ncclAllReduce")
    _Reduce = <Reduce_t>_resolve(h, "ncclReduce")
    _Broadcast = <Broadcast_t>_resolve(h, "ncclBroadcast")
    _AllGather = <AllGather_t>_resolve(h, "ncclAllGather")
    _ReduceScatter = <ReduceScatter_t>_resolve(h, "ncclReduceScatter")
    _Send = <SendRecv_t>_resolve(h, "ncclSend")
    _Recv = <SendRecv_t>_resolve(h, "ncclRecv")
    _GroupStart = <Group_t>_resolve(h, "ncclGroupStart")
    _GroupEnd = <Group_t>_resolve(h, "ncclGroupEnd")
    return 0


def load_library(str path):
    """dlopen ``path`` and resolve every entry point we use, once (idempotent, thread-safe).

    Raises OSError when the file cannot be opened or is not libnccl (one of REQUIRED
    missing); an entry point that only newer NCCL releases have is recorded as absent and the
    function needing it raises :class:`NcclMissingSymbol` when called.
    """
    global _handle, _path, _version
    cdef bytes bpath = path.encode()
    cdef void* h
    cdef int v = 0
    with _load_lock:
        if _handle != NULL:
            return _path
        h = dlopen(bpath, RTLD_NOW | RTLD_GLOBAL)
        if h == NULL:
            msg = dlerror()
            raise OSError(msg.decode() if msg != NULL else f"dlopen({path}) failed")
        absent = [name for name in REQUIRED if dlsym(h, name.encode()) == NULL]
        if absent:
            raise OSError(f"{path} is not libnccl: no {', '.join(absent)}")
        _symbols.clear()
        _fill_table(h)
        with nogil:
            _GetVersion(&v)
        _version = v
        _path = path
        _handle = h  # published last: a thread that sees it sees the whole table
        return path


def library_path():
    return _path


def symbols():
    """{entry point: resolved?} for the loaded library (empty before loading)."""
    return dict(_symbols)


cdef int _require() except -1:
    if _handle == NULL:
        raise RuntimeError("libnccl is not loaded; use bagua_comm._nccl_loader.load()")
    return 0


def error_string(int status):
    """NCCL's message for a status code."""
    if _handle == NULL or _GetErrorString == NULL:
        return f"status {status}"
    cdef const char* s
    with nogil:
        s = _GetErrorString(<ncclResult_t>status)
    return s.decode() if s != NULL else f"status {status}"


def get_version():
    """NCCL_VERSION_CODE of the loaded library (e.g. 22703 for 2.27.3)."""
    _require()
    cdef int v = 0
    cdef ncclResult_t st
    with nogil:
        st = _GetVersion(&v)
    _check(st)
    return v


def get_unique_id():
    """A fresh ncclUniqueId as 128 bytes (to send to peers through the store)."""
    _require()
    cdef ncclUniqueId uid
    cdef ncclResult_t st
    with nogil:
        st = _GetUniqueId(&uid)
    _check(st)
    return bytes((<char*>uid.internal)[:128])


def group_start():
    """ncclGroupStart: the following point-to-point calls form one operation."""
    _require()
    if _GroupStart == NULL:
        _missing("ncclGroupStart")
    cdef ncclResult_t st
    with nogil:
        st = _GroupStart()
    _check(st)


def group_end(comm=None):
    """ncclGroupEnd; with a non-blocking ``comm``, also waits until the group is enqueued."""
    _require()
    if _GroupEnd == NULL:
        _missing("ncclGroupEnd")
    cdef ncclResult_t st
    with nogil:
        st = _GroupEnd()
    if st == IN_PROGRESS and comm is not None:
        comm._ready()
        return
    _check(st)


cdef class NcclCommunicator:
    """One rank's NCCL communicator, built from a unique id shared by all ranks.

    Buffers and streams are passed as integers (``tensor.data_ptr()``, ``stream.ptr``);
    ``dtype`` and ``op`` are NCCL's enum values.  Every call releases the GIL; a failure raises
    :class:`NcclError` with the status and NCCL's message.  ``abort()``, ``destroy()`` and
    ``async_error()`` are safe to call from another thread (the watchdog's): they serialise on
    a per-communicator lock, so the handle is never used after it was freed.

    The calls (collectives, ``count``...) hold no lock while NCCL runs, so that the watchdog's
    ``abort()`` can end a call that waits for a dead peer; instead they count themselves in
    as readers of the handle.  ``abort()`` marks the communicator closing (no new reader
    starts; a reader polling ``ncclInProgress`` stops at its next poll and raises), waits
    for the readers to leave (a non-blocking communicator's calls return at once), and only
    then frees the handle.  A blocking communicator's call may be stuck inside NCCL: there
    ``ncclCommAbort`` is what unblocks it, so abort does not wait, and the reader, once
    back, raises without touching the handle again.
    """

    cdef ncclComm_t _comm
    cdef readonly int nranks
    cdef readonly int rank
    cdef readonly bint nonblocking
    cdef readonly double timeout
    cdef object _life
    cdef object _left       # Condition on _life: the last reader left
    cdef int _readers       # calls between _enter() and _leave()
    cdef bint _closing      # abort()/destroy() began: no new reader, pollers stop
    cdef public object watch  # the watchdog's record of this communicator, if any

    def __cinit__(self):
        self._comm = NULL
        self.nranks = 0
        self.rank = -1
        self._life = threading.Lock()
        self._left = threading.Condition(self._life)
        self._readers = 0
        self._closing = False
        self.watch = None

    def __init__(self, int nranks, bytes unique_id, int rank, timeout=None):
        """Join the communicator of ``unique_id`` as ``rank`` of ``nranks``.

        With ``timeout`` (seconds) and an NCCL that has ``ncclCommInitRankConfig`` (2.14+),
        the communicator is created non-blocking and polled: a peer that never joins makes
        this raise :class:`NcclError` after ``timeout`` (the half-made communicator is
        aborted) instead of hanging.  Its later calls wait out ``ncclInProgress`` the same
        way.  Otherwise ``ncclCommInitRank`` blocks until every rank has joined."""
        _require()
        if len(unique_id) != 128:
            raise ValueError(f"unique_id must be 128 bytes, got {len(unique_id)}")
        if not 0 <= rank < nranks:
            raise ValueError(f"rank must be in [0, nranks={nranks}), got {rank}")
        if _CommInitRank == NULL:
            _missing("ncclCommInitRank")
        cdef ncclUniqueId uid
        memcpy(uid.internal, <const char*>unique_id, 128)
        cdef ncclComm_t comm = NULL
        cdef ncclResult_t st
        cdef ncclConfig_v21400 config
        self.nranks = nranks
        self.rank = rank
        self.timeout = -1.0 if timeout is None else float(timeout)
        self.nonblocking = (timeout is not None and _CommInitRankConfig != NULL
                            and _CommGetAsyncError != NULL and _CommAbort != NULL)
        if not self.nonblocking:
            with nogil:
                st = _CommInitRank(&comm, nranks, uid, rank)
            _check(st)
            self._comm = comm
            return
        config.size = sizeof(ncclConfig_v21400)
        config.magic = 0xcafebeef
        config.version = 21400            # NCCL_VERSION(2, 14, 0): the fields restated here
        config.blocking = 0
        with nogil:
            st = _CommInitRankConfig(&comm, nranks, uid, rank, &config)
        if st != 0 and st != IN_PROGRESS:
            if comm != NULL:
                with nogil:
                    _CommAbort(comm)
            _check(st)
        self._comm = comm
        self._ready("creating the communicator")

    def __dealloc__(self):
        if self._comm != NULL and _CommDestroy != NULL:
            with nogil:
                _CommDestroy(self._comm)
        self._comm = NULL

    def _ready(self, what="an NCCL call", int inside=0):
        """Wait while a non-blocking communicator reports ``ncclInProgress``, at most
        ``timeout`` seconds; then abort it and raise.  ``inside``: 1 when the caller is a
        reader (it then stops, without touching the handle, once abort() has begun)."""
        cdef ncclResult_t st, res = IN_PROGRESS
        cdef ncclComm_t comm = self._comm
        deadline = time.monotonic() + self.timeout
        while True:
            if inside and self._closing:
                raise self._aborted_error(what)
            with nogil:
                st = _CommGetAsyncError(comm, &res)
            _check(st, comm)
            if res != IN_PROGRESS:
                break
            if time.monotonic() > deadline:
                try:
                    self._abort(inside)
                finally:
                    raise NcclError(IN_PROGRESS, f"{what} did not complete within "
                                    f"{self.timeout:g} s (a peer rank never joined or died); "
                                    "the communicator was aborted")
            time.sleep(0.0005)
        _check(res, comm)

    cdef int _done(self, ncclResult_t st, ncclComm_t comm) except -1:
        """Check a reader's NCCL status, then count the reader out (whatever happens).  An
        error's detail is read from the handle under the lock, never once closing."""
        try:
            if st == 0:
                return 0
            if st == IN_PROGRESS and self.nonblocking:
                self._ready("an NCCL call", 1)
                return 0
            with self._life:
                if self._closing:
                    raise self._aborted_error("an NCCL call")
                return _check(st, comm)
        finally:
            self._leave()

    def _aborted_error(self, what):
        return NcclError(3, f"{what} was ended: the communicator was aborted or destroyed "
                            "by another thread (the watchdog, after a timeout or an error)")

    cdef ncclComm_t _enter(self) except? NULL:
        """Count the caller in as a reader of the handle (raise if closed or closing)."""
        with self._life:
            if self._comm == NULL or self._closing:
                raise RuntimeError("this NCCL communicator was destroyed or aborted")
            self._readers += 1
            return self._comm

    cdef void _leave(self):
        with self._life:
            self._readers -= 1
            if self._readers == 0:
                self._left.notify_all()

    cdef int _close(self, int inside, bint wait) except -1:
        """(lock held) Stop new readers; with ``wait``, wait for the readers other than
        the caller's ``inside`` ones to leave (pollers leave within one poll)."""
        self._closing = True
        if wait:
            while self._readers > inside:
                self._left.wait()
        return 0

    @property
    def ptr(self):
        return <size_t>self._comm

    @property
    def alive(self):
        """False once destroyed or aborted."""
        return self._comm != NULL

    def destroy(self):
        """Free the communicator after its pending work (idempotent)."""
        if _CommDestroy == NULL:
            _missing("ncclCommDestroy")
        cdef ncclComm_t comm
        cdef ncclResult_t st
        with self._life:
            if self._comm == NULL:
                return
            self._close(0, True)     # destroy lets the calls in flight finish
            comm, self._comm = self._comm, NULL
            with nogil:
                st = _CommDestroy(comm)
        _check(st)

    def abort(self):
        """Abandon pending work and free the communicator (idempotent, GIL released)."""
        self._abort(0)

    def _abort(self, int inside):
        if _CommAbort == NULL:
            _missing("ncclCommAbort")
        cdef ncclComm_t comm
        cdef ncclResult_t st
        with self._life:
            if self._comm == NULL:
                return
            # a non-blocking communicator's readers leave at their next poll; a blocking
            # one's may be stuck in NCCL until ncclCommAbort: do not wait for those
            self._close(inside, self.nonblocking)
            comm, self._comm = self._comm, NULL
            with nogil:
                st = _CommAbort(comm)
        _check(st)

    def async_error(self, bint blocking=True):
        """The communicator's asynchronous error status (0 when healthy; GIL released).

        Returns None when the communicator is already destroyed or aborted, or, with
        ``blocking=False``, while another thread is destroying or aborting it.
        """
        if _CommGetAsyncError == NULL:
            _missing("ncclCommGetAsyncError")
        cdef ncclComm_t comm
        cdef ncclResult_t st, res = 0
        if not self._life.acquire(blocking):
            return None
        try:
            if self._comm == NULL:
                return None
            comm = self._comm
            with nogil:
                st = _CommGetAsyncError(comm, &res)
            _check(st, comm)
        finally:
            self._life.release()
        return res

    def count(self):
        if _CommCount == NULL:
            _missing("ncclCommCount")
        cdef int n = 0
        cdef ncclResult_t st
        cdef ncclComm_t comm = self._enter()
        with nogil:
            st = _CommCount(comm, &n)
        self._done(st, comm)
        return n

    def user_rank(self):
        if _CommUserRank == NULL:
            _missing("ncclCommUserRank")
        cdef int r = -1
        cdef ncclResult_t st
        cdef ncclComm_t comm = self._enter()
        with nogil:
            st = _CommUserRank(comm, &r)
        self._done(st, comm)
        return r

    def allreduce(self, size_t sendbuf, size_t recvbuf, size_t count, int dtype, int op,
                  size_t stream):
        if _AllReduce == NULL:
            _missing("ncclAllReduce")
        cdef ncclResult_t st
        cdef ncclComm_t comm = self._enter()
        with nogil:
            st = _AllReduce(<const void*>sendbuf, <void*>recvbuf, count, dtype, op, comm,
                            <cudaStream_t>stream)
        self._done(st, comm)

    def reduce(self, size_t sendbuf, size_t recvbuf, size_t count, int dtype, int op, int root,
               size_t stream):
        if _Reduce == NULL:
            _missing("ncclReduce")
        cdef ncclResult_t st
        cdef ncclComm_t comm = self._enter()
        with nogil:
            st = _Reduce(<const void*>sendbuf, <void*>recvbuf, count, dtype, op, root, comm,
                         <cudaStream_t>stream)
        self._done(st, comm)

    def broadcast(self, size_t sendbuf, size_t recvbuf, size_t count, int dtype, int root,
                  size_t stream):
        if _Broadcast == NULL:
            _missing("ncclBroadcast")
        cdef ncclResult_t st
        cdef ncclComm_t comm = self._enter()
        with nogil:
            st = _Broadcast(<const void*>sendbuf, <void*>recvbuf, count, dtype, root, comm,
                            <cudaStream_t>stream)
        self._done(st, comm)

    def allgather(self, size_t sendbuf, size_t recvbuf, size_t count, int dtype,
                  size_t stream):
        """``count`` elements from each rank."""
        if _AllGather == NULL:
            _missing("ncclAllGather")
        cdef ncclResult_t st
        cdef ncclComm_t comm = self._enter()
        with nogil:
            st = _AllGather(<const void*>sendbuf, <void*>recvbuf, count, dtype, comm,
                            <cudaStream_t>stream)
        self._done(st, comm)

    def reduce_scatter(self, size_t sendbuf, size_t recvbuf, size_t count, int dtype, int op,
                       size_t stream):
        """``count`` elements to each rank."""
        if _ReduceScatter == NULL:
            _missing("ncclReduceScatter")
        cdef ncclResult_t st
        cdef ncclComm_t comm = self._enter()
        with nogil:
            st = _ReduceScatter(<const void*>sendbuf, <void*>recvbuf, count, dtype, op, comm,
                                <cudaStream_t>stream)
        self._done(st, comm)

    def send(self, size_t buf, size_t count, int dtype, int peer, size_t stream):
        if _Send == NULL:
            _missing("ncclSend")
        cdef ncclResult_t st
        cdef ncclComm_t comm = self._enter()
        with nogil:
            st = _Send(<void*>buf, count, dtype, peer, comm, <cudaStream_t>stream)
        self._done(st, comm)

    def recv(self, size_t buf, size_t count, int dtype, int peer, size_t stream):
        if _Recv == NULL:
            _missing("ncclRecv")
        cdef ncclResult_t st
        cdef ncclComm_t comm = self._enter()
        with nogil:
            st = _Recv(<void*>buf, count, dtype, peer, comm, <cudaStream_t>stream)
        self._done(st, comm)
