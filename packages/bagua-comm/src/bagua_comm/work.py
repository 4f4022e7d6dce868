"""Work handles returned by primitives called with ``async_op=True``."""

from __future__ import annotations

from collections.abc import Callable


class Work:
    """Completion handle of an asynchronous primitive.

    Wraps zero or more backend handles and an optional finisher that runs exactly once,
    after they complete (e.g. the division of an AVG reduction on gloo).
    """

    def __init__(self, handles=(), then: Callable[[], None] | None = None):
        self._handles = [h for h in handles if h is not None]
        self._then = then
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        for h in self._handles:
            h.wait()
        if self._then is not None:
            self._then()
        self._done = True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if all(h.is_completed() for h in self._handles):
            self.wait()
            return True
        return False


def finish(handles, then=None, async_op=False) -> Work | None:
    """Return a handle when ``async_op``; otherwise complete the work now and return None."""
    if async_op:
        return Work(handles, then)
    for h in handles:
        h.wait()
    if then is not None:
        then()
    return None
