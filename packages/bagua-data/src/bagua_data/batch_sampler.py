"""``LoadBalancingDistributedBatchSampler``: variable-size batches, equal batch counts."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from ._progress import Progress
from ._resume import check_consumed, check_rows, check_state, make_state, unseen
from .sampler import LoadBalancingDistributedSampler

BatchFn = Callable[[list[int]], Iterable[Iterable[int]]]


class LoadBalancingDistributedBatchSampler(Sampler[list[int]]):
    """Cut each rank's balanced sample order into variable-size batches (a token budget, say)
    and give every rank the same number of batches.

    ``batch_fn(indices) -> batches`` receives one rank's epoch order (a list of dataset
    indices, in order) and returns a list of non-empty lists of indices.  Every rank applies
    it to every rank's order (they are all known locally, no communication), so all ranks
    agree on the batch count: with ``drop_last=False`` ranks that have fewer batches repeat
    their own first ones; with ``True`` ranks drop their last batches down to the smallest
    count.  Because the ranks' orders are balanced element by element, the counts differ by
    little and so does the work in each rank's i-th batch.

    Pass it to ``DataLoader(dataset, batch_sampler=...)`` and call :meth:`set_epoch` (or the
    wrapped sampler's) before each epoch.

    Example (at most 4096 tokens per batch)::

        >>> lengths = [len(s) for s in texts]
        >>> def token_budget(indices, budget=4096):
        ...     batches, batch, longest = [], [], 0
        ...     for i in indices:
        ...         longest2 = max(longest, lengths[i])
        ...         if batch and longest2 * (len(batch) + 1) > budget:
        ...             batches.append(batch); batch, longest2 = [], lengths[i]
        ...         batch.append(i); longest = longest2
        ...     return batches + [batch] if batch else batches
        >>> sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lengths)
        >>> batches = LoadBalancingDistributedBatchSampler(sampler, batch_fn=token_budget)
        >>> loader = DataLoader(dataset, batch_sampler=batches, collate_fn=pad_collate)
    """

    def __init__(self, sampler: LoadBalancingDistributedSampler, batch_fn: BatchFn,
                 drop_last: bool = False) -> None:
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise ValueError(f"sampler must be a LoadBalancingDistributedSampler, got "
                             f"{type(sampler).__name__}")
        if not callable(batch_fn):
            raise ValueError(f"batch_fn must be callable as batch_fn(indices) -> list of "
                             f"batches, got {type(batch_fn).__name__}")
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = bool(drop_last)
        self.num_replicas = sampler.num_replicas
        self.rank = sampler.rank
        self._cache: tuple[tuple, list[list[int]]] | None = None
        self._progress = Progress()
        # (epoch, history before the current plan) after a resume at another world size
        self._prior: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Set the wrapped sampler's epoch (both samplers then agree)."""
        self.sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __len__(self) -> int:
        return len(self._batches())

    def __iter__(self) -> Iterator[list[int]]:
        return self._progress.iterate(self.epoch, self._batches())

    def _batches(self) -> list[list[int]]:
        """This rank's batches for the current epoch (computed once per epoch)."""
        epoch = self.sampler.epoch
        prior = self._prior_history(epoch)
        key = (epoch, tuple(map(tuple, prior)))
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._plan(epoch, prior, self.num_replicas)[self.rank])
        return self._cache[1]

    def _prior_history(self, epoch: int) -> list[list[int]]:
        if self._prior is not None and self._prior[0] == epoch:
            return self._prior[1]
        return []

    def _plan(self, epoch: int, prior: list[list[int]], world: int) -> list[list[list[int]]]:
        """Every rank's batches in the plan that follows ``prior`` (see ``_resume.py``)."""
        sampler = self.sampler
        table = sampler._base_chunks(epoch, prior[0][0] if prior else world)
        consumed: set[int] = set()
        for j, (_, rows) in enumerate(prior):
            per_rank = self._deal(table)
            count = len(per_rank[0])
            check_rows(rows, count, "batches")
            consumed.update(i for b in per_rank for batch in b[:rows] for i in batch)
            pool = unseen(consumed, (i for k in range(rows, count) for b in per_rank
                                     for i in b[k]))
            nxt = prior[j + 1][0] if j + 1 < len(prior) else world
            table = sampler._rebalance(epoch, pool, nxt, j + 1)
        return self._deal(table)

    def _deal(self, chunks: torch.Tensor) -> list[list[list[int]]]:
        """Every rank's batches for a sample table, equal in count."""
        world = int(chunks.shape[1])
        if chunks.shape[0] == 0:
            return [[] for _ in range(world)]
        per_rank = [self._call_batch_fn(chunks[:, r].tolist(), r) for r in range(world)]
        counts = [len(b) for b in per_rank]
        total = min(counts) if self.drop_last else max(counts)
        if total > 0 and 0 in counts:
            # Only with drop_last=False.  Every rank sees every count, so all raise together.
            raise RuntimeError(f"batch_fn returned no batch for rank {counts.index(0)}'s "
                               f"{int(chunks.shape[0])} samples while another rank has "
                               f"{total}; cannot pad to an equal count (use drop_last=True "
                               f"or give every rank at least one sample)")
        out = []
        for mine in per_rank:
            if len(mine) < total:  # repeat this rank's own first batches
                mine = (mine * math.ceil(total / len(mine)))[:total]
            out.append(mine[:total])
        return out

    def _call_batch_fn(self, indices: list[int], rank: int) -> list[list[int]]:
        out = self.batch_fn(indices)
        try:
            batches = [list(b) for b in out]
        except TypeError:
            raise ValueError(f"batch_fn must return a list of batches (lists of dataset "
                             f"indices); for rank {rank}'s order it returned "
                             f"{type(out).__name__} {out!r:.60}") from None
        given = set(indices)
        for j, batch in enumerate(batches):
            if not batch:
                raise ValueError(f"batch_fn returned an empty batch (batch {j} of rank {rank}'s "
                                 f"order); every batch must hold at least one index")
            stray = [i for i in batch if i not in given]
            if stray:
                # another rank's (or no) sample: ranks would train on overlapping data
                raise ValueError(f"batch_fn returned index {stray[0]!r} in batch {j} of rank "
                                 f"{rank}'s order, which is not one of the indices it was "
                                 f"given; batches must be cut from the given order")
        return batches

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The job's position in the current epoch, counted in batches; the same on every rank.

        ``state["consumed"]`` counts the batches all ranks together have consumed this epoch,
        ``state["history"]`` the ``[num_replicas, batches per rank]`` of each world size the
        epoch ran at.  ``consumed`` (argument) is the number of batches *this rank's* loop
        has used this epoch; by default the number handed out, exact for
        ``DataLoader(num_workers=0)``.  With worker processes pass ``consumed=steps_done``
        (the loader prefetches ahead of the loop).
        """
        position = self._progress.position(self.epoch)
        rows = check_consumed(consumed, position, len(self))
        history = [*self._prior_history(self.epoch), [self.num_replicas, rows]]
        state = make_state(self.epoch, history, self.sampler._order_settings())
        state["num_batches"] = len(self)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state["epoch"]`` continues where the job stopped.

        At the same ``num_replicas`` every rank continues with its next batch, exactly as if
        uninterrupted.  At another ``num_replicas`` the samples the epoch has not yet
        consumed are dealt out anew over the new ranks, balanced, each exactly once (plus
        padding, as in an epoch), and ``batch_fn`` cuts them into batches.  Needs the same
        sampler settings and the same ``batch_fn`` behaviour (checked through the saved
        plan's batch count); a mismatch raises ``ValueError``.
        """
        if not isinstance(state, dict) or not isinstance(state.get("num_batches"), int):
            raise ValueError("state must be a dict from batch_sampler.state_dict() (with an int "
                             "'num_batches')")
        history = check_state(state, self.sampler._order_settings(), "batch sampler")
        epoch = state["epoch"]
        saved = self._plan(epoch, history[:-1], history[-1][0])
        if state["num_batches"] != len(saved[0]):
            raise ValueError(f"cannot resume: the checkpoint's epoch had "
                             f"{state['num_batches']} batches but batch_fn now makes "
                             f"{len(saved[0])}; use the same batch_fn and dataset")
        check_rows(history[-1][1], len(saved[0]), "batches")
        if history[-1][0] == self.num_replicas:
            prior, rows, plan = history[:-1], history[-1][1], saved
        else:
            prior, rows = history, 0
            plan = self._plan(epoch, prior, self.num_replicas)
        self.sampler.set_epoch(epoch)
        self._prior = (epoch, prior)
        self._cache = ((epoch, tuple(map(tuple, prior))), plan[self.rank])
        self._progress.restore(epoch, rows)
