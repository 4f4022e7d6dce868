"""``LoadBalancingDistributedBatchSampler``: variable-size batches, equal batch counts."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.utils.data import Sampler

from ._progress import STATE_VERSION, Progress, check_consumed, check_state
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
        self._cache: tuple[int, list[list[int]]] | None = None
        self._progress = Progress()

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
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        chunks = self.sampler.epoch_chunks()
        per_rank = [self._call_batch_fn(chunks[:, r].tolist(), r)
                    for r in range(self.num_replicas)]
        counts = [len(b) for b in per_rank]
        total = min(counts) if self.drop_last else max(counts)
        if total > 0 and 0 in counts:
            # Only with drop_last=False.  Every rank sees every count, so all raise together.
            raise RuntimeError(f"batch_fn returned no batch for rank {counts.index(0)}'s "
                               f"{int(chunks.shape[0])} samples while another rank has "
                               f"{total}; cannot pad to an equal count (use drop_last=True "
                               f"or give every rank at least one sample)")
        mine = per_rank[self.rank]
        if len(mine) < total:  # repeat this rank's own first batches
            mine = (mine * math.ceil(total / len(mine)))[:total]
        self._cache = (epoch, mine[:total])
        return self._cache[1]

    def _call_batch_fn(self, indices: list[int], rank: int) -> list[list[int]]:
        batches = [list(b) for b in self.batch_fn(indices)]
        for j, batch in enumerate(batches):
            if not batch:
                raise ValueError(f"batch_fn returned an empty batch (batch {j} of rank {rank}'s "
                                 f"order); every batch must hold at least one index")
        return batches

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where this rank is in the current epoch, counted in batches.

        ``consumed`` is the number of batches the training loop has used this epoch; by default
        the number handed out, exact for ``DataLoader(num_workers=0)``.  With worker processes
        pass ``consumed=steps_done`` (the loader prefetches ahead of the loop).
        """
        position = self._progress.position(self.epoch)
        state = {"version": STATE_VERSION, "epoch": self.epoch, "num_batches": len(self),
                 "consumed": check_consumed(consumed, position, len(self))}
        state.update(self.sampler._order_settings())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state["epoch"]`` starts at the first unseen batch.

        Needs the same sampler settings and the same ``batch_fn`` behaviour (checked through
        the epoch's batch count); a mismatch raises ``ValueError``.
        """
        if not isinstance(state, dict) or not isinstance(state.get("num_batches"), int):
            raise ValueError("state must be a dict from batch_sampler.state_dict() (with an int "
                             "'num_batches')")
        check_state(state, self.sampler._order_settings(), state["num_batches"],
                     "batch sampler")
        self.sampler.set_epoch(state["epoch"])
        if state["num_batches"] != len(self):
            raise ValueError(f"cannot resume: the checkpoint's epoch had "
                             f"{state['num_batches']} batches but batch_fn now makes "
                             f"{len(self)}; use the same batch_fn and dataset")
        self._progress.restore(state["epoch"], state["consumed"])
