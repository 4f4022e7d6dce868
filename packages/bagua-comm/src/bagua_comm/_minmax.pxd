# The MinMaxUInt8 kernels other Cython modules call without Python (``_worker.pyx``'s compiled
# compressed allreduce): the same code as ``compress_records_at`` / ``decode_reduce_at``, with
# the caller vouching for the sizes those check.
from libc.stdint cimport uint8_t

cdef void compress_any(const void* src, Py_ssize_t m, int kind, const float* tab,
                       Py_ssize_t chunks, uint8_t* payload, Py_ssize_t record) noexcept nogil
cdef void decode_reduce_any(const uint8_t* payload, Py_ssize_t record, Py_ssize_t k,
                            Py_ssize_t rows, int kind, const float* tab, float* out,
                            Py_ssize_t n, int op) noexcept nogil
