"""Start a torchft Lighthouse in this process (tests, single-machine runs; on a cluster run
``torchft_lighthouse`` instead, see docs/fault-tolerance.md)."""

from __future__ import annotations

import socket
import urllib.parse


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


def _answers(address: str, timeout: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at ``address`` (``http://host:port``)."""
    hostport = urllib.parse.urlsplit(address if "//" in address else f"//{address}")
    try:
        with socket.create_connection((hostport.hostname, hostport.port or 80), timeout):
            return True
    except (OSError, ValueError):
        return False


def no_quorum_error(lighthouse: str, quorum_timeout, err: BaseException) -> RuntimeError:
    """The error for a step that got no quorum within quorum_timeout: the Lighthouse
    lost (its host died: nothing answers at its address) or too few replicas alive."""
    if _answers(lighthouse):
        why = ("the Lighthouse answers but formed no quorum with this replica (fewer than "
               "its min_replicas replicas alive, or fewer than half of those it hears "
               "from?)")
    else:
        why = ("nothing answers at that address: the Lighthouse (or its host) is lost. A "
               "Lighthouse restarted at the same address within quorum_timeout is "
               "reconnected to; after that, torchft's Manager cannot go on: restart the "
               "Lighthouse and the replicas (from a checkpoint)")
    return RuntimeError(f"bagua_algos.ft: no quorum from the torchft Lighthouse at "
                        f"{lighthouse!r} within quorum_timeout="
                        f"{quorum_timeout}: {why} ({type(err).__name__}: {err})")
