"""How far into an epoch a sampler has got, for ``state_dict``/``load_state_dict``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

STATE_VERSION = 1
# Settings that fix an epoch's order: a checkpoint only resumes into a sampler that shares them.
ORDER_KEYS = ("seed", "num_replicas", "shuffle", "drop_last", "random_level", "dataset_len")


class Progress:
    """Counts the items the current epoch's iterator has handed out, and where to resume.

    A restored position applies to the epoch it was saved in only: iterating any other epoch
    starts from its beginning.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.yielded = 0
        self._resume: tuple[int, int] | None = None  # (epoch, first item to yield)

    def position(self, epoch: int) -> int:
        """Items of ``epoch`` already handed out (or restored as handed out)."""
        if self._resume is not None and self._resume[0] == epoch:
            return self._resume[1]
        return self.yielded if self.epoch == epoch else 0

    def restore(self, epoch: int, offset: int) -> None:
        self._resume = (epoch, offset)

    def iterate(self, epoch: int, items: Sequence[T]) -> Iterator[T]:
        """Start ``epoch`` (from the restored offset if there is one) and count as it goes."""
        resume, self._resume = self._resume, None
        start = resume[1] if resume is not None and resume[0] == epoch else 0
        self.epoch, self.yielded = epoch, start
        return self._count(items, start)

    def _count(self, items: Sequence[T], start: int) -> Iterator[T]:
        for i in range(start, len(items)):
            self.yielded = i + 1
            yield items[i]


def check_consumed(consumed: int | None, default: int, length: int) -> int:
    if consumed is None:
        return default
    if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= length:
        raise ValueError(f"consumed must be an int in [0, {length}] (this epoch's length), "
                         f"got {consumed!r}")
    return consumed


def check_state(state: Any, settings: dict[str, Any], length: int, what: str) -> None:
    """Validate a saved state against this sampler's order settings and epoch length."""
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict from {what}.state_dict(), got "
                         f"{type(state).__name__}")
    missing = [k for k in ("version", "epoch", "consumed", *ORDER_KEYS) if k not in state]
    if missing:
        raise ValueError(f"state is missing {missing}: pass a dict from {what}.state_dict()")
    if state["version"] != STATE_VERSION:
        raise ValueError(f"state version {state['version']!r} is not supported (expected "
                         f"{STATE_VERSION})")
    for key in ORDER_KEYS:
        if state[key] != settings[key]:
            raise ValueError(f"cannot resume: the checkpoint was saved with {key}="
                             f"{state[key]!r} but this {what} has {key}={settings[key]!r}; "
                             f"build it with the same settings (or start a new epoch instead)")
    epoch, consumed = state["epoch"], state["consumed"]
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        raise ValueError(f"state['epoch'] must be an int, got {epoch!r}")
    if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= length:
        raise ValueError(f"state['consumed'] must be an int in [0, {length}], got {consumed!r}")
