"""Batches from a load-balanced sampler whose position follows the committed steps.

A step that is not committed (a peer died in it) gives its samples back; when the quorum
changes size, the samples of the epoch not yet consumed by a committed step, the dead
rank's included, are dealt anew over the new ranks, each exactly once (bagua_data's
``state_dict``/``load_state_dict`` at another world size).
"""

from __future__ import annotations

import torch
from torch.utils.data import default_collate


class CommittedBatches:
    """``next()`` gives this rank's next batch; ``commit()`` makes it consumed.

    ``sampler`` is a ``bagua_data.LoadBalancingDistributedSampler``; it is rebuilt (same
    settings, same complexities) for each quorum by :meth:`rebind`.
    """

    def __init__(self, dataset, sampler, batch_size: int, collate_fn=None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        for attr in ("epoch_chunks", "state_dict", "load_state_dict", "complexities"):
            if not hasattr(sampler, attr):
                raise ValueError("sampler must be a bagua_data.LoadBalancingDistributedSampler "
                                 f"(it has no {attr!r}), got {type(sampler).__name__}")
        self.dataset = dataset
        self.sampler = sampler
        self.batch_size = batch_size
        self.collate_fn = collate_fn or default_collate
        self.rows = 0                  # rows of the current plan consumed by committed steps
        self._taken = None             # (epoch, rows) the uncommitted batch would reach
        self.indices: list[int] = []   # the last batch's dataset indices
        self._mask = None              # (table, its first-appearance mask)

    def _table(self):
        return self.sampler.epoch_chunks()

    def _fresh(self, table):
        """Which entries of ``table`` are a sample's first appearance, rows in order (then
        ranks): the sampler pads a table to a whole number of rows by repeating samples
        (DistributedSampler's rule), and a re-deal over another number of replicas pads
        again; a repeat is not dealt, so that no sample is used twice."""
        if self._mask is None or self._mask[0] is not table:
            flat = table.reshape(-1)
            _, inverse = torch.unique(flat, return_inverse=True)
            where = torch.arange(flat.numel())
            first = torch.full((int(inverse.max()) + 1 if flat.numel() else 0,), flat.numel(),
                               dtype=torch.long).scatter_reduce(0, inverse, where, "amin")
            self._mask = (table, (first[inverse] == where).view_as(table))
        return self._mask[1]

    def next(self):
        table = self._table()
        epoch, rows = self.sampler.epoch, self.rows
        if rows >= table.shape[0]:                   # the epoch is over: the next one
            epoch, rows = epoch + 1, 0
            self.sampler.set_epoch(epoch)
            self.rows = 0
            table = self._table()
        end = min(rows + self.batch_size, int(table.shape[0]))
        column = table[rows:end, self.sampler.rank]
        fresh = column[self._fresh(table)[rows:end, self.sampler.rank]]
        # a batch of repeats only (the table's last row, a batch of one row): kept, so that
        # every rank has a batch to step on
        self.indices = (fresh if fresh.numel() else column).tolist()
        self._taken = end
        return self.collate_fn([self.dataset[i] for i in self.indices])

    def commit(self) -> None:
        if self._taken is not None:
            self.rows, self._taken = self._taken, None

    def rollback(self) -> None:
        self._taken = None

    def state_dict(self) -> dict:
        """The job's committed position (the same on every rank)."""
        return self.sampler.state_dict(consumed=self.rows)

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        last_world, last_rows = state["history"][-1]
        self.rows = last_rows if last_world == self.sampler.num_replicas else 0
        self._taken = None

    def rebind(self, num_replicas: int, rank: int, state: dict | None = None) -> None:
        """Serve rank ``rank`` of ``num_replicas`` from the committed position (``state``,
        by default this one's own): the unconsumed samples are re-dealt if the size changed."""
        state = self.state_dict() if state is None else state
        old = self.sampler
        if (old.num_replicas, old.rank) != (num_replicas, rank):
            self.sampler = type(old)(old.dataset, old.complexities, num_replicas=num_replicas,
                                     rank=rank, shuffle=old.shuffle, seed=old.seed,
                                     drop_last=old.drop_last, random_level=old.random_level)
        self.load_state_dict(state)
