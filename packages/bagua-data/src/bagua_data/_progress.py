"""How far into an epoch a sampler has got, for ``state_dict``/``load_state_dict``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


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
