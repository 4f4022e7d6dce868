"""Start a torchft Lighthouse in this process (tests, single-machine runs; on a cluster run
``torchft_lighthouse`` instead, see docs/fault-tolerance.md)."""

from __future__ import annotations


def lighthouse(bind: str = "[::]:0", *, min_replicas: int = 1, heartbeat_timeout_ms: int = 1000,
               join_timeout_ms: int = 1000, quorum_tick_ms: int = 50):
    """A running ``torchft`` LighthouseServer (``.address()``, ``.shutdown()``).

    ``heartbeat_timeout_ms``: a replica silent this long is dropped from the next quorum
    (torchft's default is 5000; 1000 keeps live replicas at load 8 on 2 cores, see
    docs/fault-tolerance.md).  ``join_timeout_ms``: how long a quorum waits for replicas that
    are alive but have not asked yet.
    """
    for name, v in (("min_replicas", min_replicas), ("heartbeat_timeout_ms", heartbeat_timeout_ms),
                    ("join_timeout_ms", join_timeout_ms), ("quorum_tick_ms", quorum_tick_ms)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as err:
        raise RuntimeError(f"bagua_algos.ft needs torchft: pip install 'bagua-algos[ft]' ({err})"
                           ) from None
    return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            quorum_tick_ms=quorum_tick_ms,
                            heartbeat_timeout_ms=heartbeat_timeout_ms)
