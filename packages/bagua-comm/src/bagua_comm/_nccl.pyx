# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin binding over libnccl, resolved with dlopen/dlsym at first use.

Nothing here includes nccl.h or links NCCL/CUDA: the ABI is restated in _nccl.pxd, the
library is opened by path (see _nccl_loader.py), and every NCCL call runs without the GIL.
"""


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


cdef inline int _check(ncclResult_t status) except -1:
    if status != 0:
        raise NcclError(status)
    return 0


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
