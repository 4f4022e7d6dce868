# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin binding over libnccl, resolved with dlopen/dlsym at first use.

Nothing here includes nccl.h or links NCCL/CUDA: the ABI is restated in _nccl.pxd, the
library is opened by path (see _nccl_loader.py), and every NCCL call runs without the GIL.
"""


from libc.string cimport memcpy


cdef extern from "<dlfcn.h>" nogil:
    void* dlopen(const char*, int)
    void* dlsym(void*, const char*)
    char* dlerror()
    int RTLD_NOW
    int RTLD_GLOBAL

cdef void* _handle = NULL
cdef GetVersion_t _GetVersion = NULL
cdef GetUniqueId_t _GetUniqueId = NULL
cdef GetErrorString_t _GetErrorString = NULL

cdef GetLastError_t _GetLastError = NULL
cdef CommInitRank_t _CommInitRank = NULL
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


class NcclError(RuntimeError):
    """An NCCL call failed: ``status`` is the ncclResult_t, the message NCCL's own."""

    def __init__(self, status, message=None):
        self.status = int(status)
        self.message = message if message is not None else error_string(status)
        super().__init__(f"NCCL error {self.status}: {self.message}")

    def __reduce__(self):
        return (NcclError, (self.status, self.message))


cdef void* _sym(const char* name) except NULL:
    cdef void* p = dlsym(_handle, name)
    if p == NULL:
        raise NcclError(-1, f"symbol {name.decode()} missing from {_path} (NCCL too old?)")
    return p


cdef inline int _check(ncclResult_t status, ncclComm_t comm=NULL) except -1:
    if status != 0:
        raise NcclError(status, _message(status, comm))
    return 0


cdef str _message(ncclResult_t status, ncclComm_t comm):
    """NCCL's string for ``status``, plus its last-error detail when the library has one."""
    msg = error_string(status)
    cdef const char* detail = NULL
    global _GetLastError
    if _GetLastError == NULL and _handle != NULL:
        _GetLastError = <GetLastError_t>dlsym(_handle, b"ncclGetLastError")
    if _GetLastError != NULL:
        with nogil:
            detail = _GetLastError(comm)
        if detail != NULL and detail[0] != 0:
            msg = f"{msg}: {detail.decode(errors='replace')}"
    return msg


def load_library(str path):
    """dlopen ``path`` and resolve the entry points we need eagerly (others on first call)."""
    global _handle, _GetVersion, _GetUniqueId, _GetErrorString, _path
    if _handle != NULL:
        return _path
    cdef bytes bpath = path.encode()
    cdef void* h = dlopen(bpath, RTLD_NOW | RTLD_GLOBAL)
    if h == NULL:
        msg = dlerror()
        raise OSError(msg.decode() if msg != NULL else f"dlopen({path}) failed")
    if dlsym(h, b"ncclGetVersion") == NULL:
        raise OSError(f"{path} is not libnccl: no ncclGetVersion")
    _handle = h
    _path = path
    _GetVersion = <GetVersion_t>_sym(b"ncclGetVersion")
    _GetUniqueId = <GetUniqueId_t>_sym(b"ncclGetUniqueId")
    _GetErrorString = <GetErrorString_t>_sym(b"ncclGetErrorString")
    return path


def library_path():
    return _path


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
    global _GroupStart
    if _GroupStart == NULL:
        _GroupStart = <Group_t>_sym(b"ncclGroupStart")
    cdef ncclResult_t st
    with nogil:
        st = _GroupStart()
    _check(st)


def group_end():
    _require()
    global _GroupEnd
    if _GroupEnd == NULL:
        _GroupEnd = <Group_t>_sym(b"ncclGroupEnd")
    cdef ncclResult_t st
    with nogil:
        st = _GroupEnd()
    _check(st)


cdef class NcclCommunicator:
    """One rank's NCCL communicator, built from a unique id shared by all ranks.

    Buffers and streams are passed as integers (``tensor.data_ptr()``, ``stream.ptr``);
    ``dtype`` and ``op`` are NCCL's enum values.  Every call releases the GIL; a failure raises
    :class:`NcclError` with the status and NCCL's message.
    """

    cdef ncclComm_t _comm
    cdef readonly int nranks
    cdef readonly int rank

    def __cinit__(self):
        self._comm = NULL
        self.nranks = 0
        self.rank = -1

    def __init__(self, int nranks, bytes unique_id, int rank):
        _require()
        global _CommInitRank
        if len(unique_id) != 128:
            raise ValueError(f"unique_id must be 128 bytes, got {len(unique_id)}")
        if not 0 <= rank < nranks:
            raise ValueError(f"rank must be in [0, nranks={nranks}), got {rank}")
        if _CommInitRank == NULL:
            _CommInitRank = <CommInitRank_t>_sym(b"ncclCommInitRank")
        cdef ncclUniqueId uid
        memcpy(uid.internal, <const char*>unique_id, 128)
        cdef ncclComm_t comm = NULL
        cdef ncclResult_t st
        with nogil:
            st = _CommInitRank(&comm, nranks, uid, rank)
        _check(st)
        self._comm = comm
        self.nranks = nranks
        self.rank = rank

    def __dealloc__(self):
        global _CommDestroy
        if self._comm == NULL:
            return
        if _CommDestroy == NULL:
            _CommDestroy = <CommOp_t>dlsym(_handle, b"ncclCommDestroy")
        if _CommDestroy != NULL:
            with nogil:
                _CommDestroy(self._comm)
        self._comm = NULL

    @property
    def ptr(self):
        return <size_t>self._comm

    cdef ncclComm_t _live(self) except? NULL:
        if self._comm == NULL:
            raise RuntimeError("this NCCL communicator was destroyed or aborted")
        return self._comm

    def destroy(self):
        """Free the communicator after its pending work (idempotent)."""
        global _CommDestroy
        if self._comm == NULL:
            return
        if _CommDestroy == NULL:
            _CommDestroy = <CommOp_t>_sym(b"ncclCommDestroy")
        cdef ncclComm_t comm = self._comm
        cdef ncclResult_t st
        self._comm = NULL
        with nogil:
            st = _CommDestroy(comm)
        _check(st)

    def abort(self):
        """Abandon pending work and free the communicator (idempotent)."""
        global _CommAbort
        if self._comm == NULL:
            return
        if _CommAbort == NULL:
            _CommAbort = <CommOp_t>_sym(b"ncclCommAbort")
        cdef ncclComm_t comm = self._comm
        cdef ncclResult_t st
        self._comm = NULL
        with nogil:
            st = _CommAbort(comm)
        _check(st)

    def async_error(self):
        """The communicator's asynchronous error status (0 when healthy)."""
        global _CommGetAsyncError
        if _CommGetAsyncError == NULL:
            _CommGetAsyncError = <CommGetAsyncError_t>_sym(b"ncclCommGetAsyncError")
        cdef ncclComm_t comm = self._live()
        cdef ncclResult_t st, res = 0
        with nogil:
            st = _CommGetAsyncError(comm, &res)
        _check(st, comm)
        return res

    def count(self):
        global _CommCount
        if _CommCount == NULL:
            _CommCount = <CommInfo_t>_sym(b"ncclCommCount")
        cdef ncclComm_t comm = self._live()
        cdef int n = 0
        cdef ncclResult_t st
        with nogil:
            st = _CommCount(comm, &n)
        _check(st, comm)
        return n

    def user_rank(self):
        global _CommUserRank
        if _CommUserRank == NULL:
            _CommUserRank = <CommInfo_t>_sym(b"ncclCommUserRank")
        cdef ncclComm_t comm = self._live()
        cdef int r = -1
        cdef ncclResult_t st
        with nogil:
            st = _CommUserRank(comm, &r)
        _check(st, comm)
        return r

    def allreduce(self, size_t sendbuf, size_t recvbuf, size_t count, int dtype, int op,
                  size_t stream):
        global _AllReduce
        if _AllReduce == NULL:
            _AllReduce = <AllReduce_t>_sym(b"ncclAllReduce")
        cdef ncclComm_t comm = self._live()
        cdef ncclResult_t st
        with nogil:
            st = _AllReduce(<const void*>sendbuf, <void*>recvbuf, count, dtype, op, comm,
                            <cudaStream_t>stream)
        _check(st, comm)

    def reduce(self, size_t sendbuf, size_t recvbuf, size_t count, int dtype, int op, int root,
               size_t stream):
        global _Reduce
        if _Reduce == NULL:
            _Reduce = <Reduce_t>_sym(b"ncclReduce")
        cdef ncclComm_t comm = self._live()
        cdef ncclResult_t st
        with nogil:
            st = _Reduce(<const void*>sendbuf, <void*>recvbuf, count, dtype, op, root, comm,
                         <cudaStream_t>stream)
        _check(st, comm)

    def broadcast(self, size_t sendbuf, size_t recvbuf, size_t count, int dtype, int root,
                  size_t stream):
        global _Broadcast
        if _Broadcast == NULL:
            _Broadcast = <Broadcast_t>_sym(b"ncclBroadcast")
        cdef ncclComm_t comm = self._live()
        cdef ncclResult_t st
        with nogil:
            st = _Broadcast(<const void*>sendbuf, <void*>recvbuf, count, dtype, root, comm,
                            <cudaStream_t>stream)
        _check(st, comm)

    def allgather(self, size_t sendbuf, size_t recvbuf, size_t count, int dtype,
                  size_t stream):
        """``count`` elements from each rank."""
        global _AllGather
        if _AllGather == NULL:
            _AllGather = <AllGather_t>_sym(b"ncclAllGather")
        cdef ncclComm_t comm = self._live()
        cdef ncclResult_t st
        with nogil:
            st = _AllGather(<const void*>sendbuf, <void*>recvbuf, count, dtype, comm,
                            <cudaStream_t>stream)
        _check(st, comm)

    def reduce_scatter(self, size_t sendbuf, size_t recvbuf, size_t count, int dtype, int op,
                       size_t stream):
        """``count`` elements to each rank."""
        global _ReduceScatter
        if _ReduceScatter == NULL:
            _ReduceScatter = <ReduceScatter_t>_sym(b"ncclReduceScatter")
        cdef ncclComm_t comm = self._live()
        cdef ncclResult_t st
        with nogil:
            st = _ReduceScatter(<const void*>sendbuf, <void*>recvbuf, count, dtype, op, comm,
                                <cudaStream_t>stream)
        _check(st, comm)

    def send(self, size_t buf, size_t count, int dtype, int peer, size_t stream):
        global _Send
        if _Send == NULL:
            _Send = <SendRecv_t>_sym(b"ncclSend")
        cdef ncclComm_t comm = self._live()
        cdef ncclResult_t st
        with nogil:
            st = _Send(<void*>buf, count, dtype, peer, comm, <cudaStream_t>stream)
        _check(st, comm)

    def recv(self, size_t buf, size_t count, int dtype, int peer, size_t stream):
        global _Recv
        if _Recv == NULL:
            _Recv = <SendRecv_t>_sym(b"ncclRecv")
        cdef ncclComm_t comm = self._live()
        cdef ncclResult_t st
        with nogil:
            st = _Recv(<void*>buf, count, dtype, peer, comm, <cudaStream_t>stream)
        _check(st, comm)
