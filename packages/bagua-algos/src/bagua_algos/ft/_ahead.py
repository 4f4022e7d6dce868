"""Work a rebuild will need, done while the Lighthouse waits (issue 45).

After a step in which a peer failed, the survivors wait for the Lighthouse to drop it: a
quorum without it forms only once its last sign of life is a heartbeat timeout old (a second
by default), and until then nothing of theirs changes: their parameters, optimizer state and
committed position are the step's before it.  What the rebuild then computes from them (the
sampler's re-deal over one replica less, the digests of the state the agreement compares:
a second for a model of 1 GB of state) is started here on a thread of its own, and taken at
the rebuild where it still applies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Ahead:
    """``fn()`` run now on a daemon thread; :meth:`result` waits for it and returns its
    value, or raises its error.  Nothing waits for one that is never asked."""

    def __init__(self, fn: Callable[[], Any], name: str):
        self._box: dict[str, Any] = {}

        def run():
            try:
                self._box["value"] = fn()
            except Exception as err:       # raised where the result is asked for
                self._box["error"] = err
        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def result(self) -> Any:
        self._thread.join()
        if "error" in self._box:
            raise self._box["error"]
        return self._box["value"]
