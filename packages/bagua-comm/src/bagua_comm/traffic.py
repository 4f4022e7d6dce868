"""Counts the bytes this process sends, per primitive, as the communication layer sees them.

Each primitive records what a bandwidth-optimal implementation sends from this rank
(ring allreduce: ``2 (n-1)/n`` of the buffer; allgather/reduce_scatter/alltoall:
``(n-1)/n``; point-to-point: the buffer), so algorithms can be compared by their traffic
independently of how the backend schedules it.
"""

from __future__ import annotations

import threading
from collections import defaultdict

_lock = threading.Lock()
_bytes: dict[str, int] = defaultdict(int)


def record(primitive: str, nbytes: float) -> None:
    with _lock:
        _bytes[primitive] += int(nbytes)


def bytes_sent(primitive: str | None = None) -> int:
    """Bytes sent since the last :func:`reset`, for one primitive or in total."""
    with _lock:
        return _bytes.get(primitive, 0) if primitive else sum(_bytes.values())


def by_primitive() -> dict[str, int]:
    with _lock:
        return dict(_bytes)


def reset() -> None:
    with _lock:
        _bytes.clear()
