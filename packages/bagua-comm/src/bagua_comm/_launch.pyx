"""A collective started again and again on the same buffer without entering Python.

:class:`Launcher` is what :func:`bagua_comm.allreduce_launcher` returns on the gloo backend
for a reduction gloo runs natively: its call records the traffic, as the primitive does, and
starts ``start(tensors, opts)`` (torch's process group method, C++), returning torch's own
``Work``.  The arguments were validated once, when it was made.
"""

from bagua_comm import traffic


cdef class Launcher:
    """Call it to start the collective; it returns the backend's handle (``wait()``,
    ``is_completed()``)."""

    cdef object start
    cdef object tensors
    cdef object opts
    cdef str primitive
    cdef object nbytes

    def __init__(self, start, tensors, opts, str primitive, nbytes):
        self.start = start
        self.tensors = tensors
        self.opts = opts
        self.primitive = primitive
        self.nbytes = int(nbytes)

    def __call__(self):
        with traffic._lock:
            traffic._bytes[self.primitive] += self.nbytes
        return self.start(self.tensors, self.opts)
