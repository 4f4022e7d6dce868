"""Batches from a load-balanced sampler whose position follows the committed steps.

A step that is not committed (a peer died in it) gives its samples back; when the quorum
changes size, the samples of the epoch not yet consumed by a committed step, the dead
rank's included, are dealt anew over the new ranks, each exactly once (bagua_data's
``state_dict``/``load_state_dict`` at another world size).

An algorithm with local steps (LocalSGD, DiLoCo) keeps a replica's committed local steps in
that replica's parameters only, until the next sync: a replica lost before it (or whose
parameters a rebuild replaced by another's) loses them.  The samples of those steps are
*owed*: :meth:`CommittedBatches.give_back` takes them back from the committed rows, and the
first committed step after the rebuild deals them over the new ranks, in addition to its
batch (``owed[rank::num_replicas]``), each exactly once.
"""

from __future__ import annotations

import torch
from torch.utils.data import default_collate

from ._ahead import Ahead


def _first_seen(table: torch.Tensor, sampler) -> torch.Tensor:
    """The mask of ``table``'s entries (dataset indices) that are a sample's first
    appearance, rows in order: one scatter over the dataset's index space and one gather
    (``torch.unique`` sorts: a few hundred ms at a million samples, on the survivors'
    critical path after a membership change).  bagua_algos does not import bagua_data, whose
    sampler does the same for its own re-deals."""
    flat = table.reshape(-1)
    where = torch.arange(flat.numel())
    first = torch.full((sampler.complexities.numel(),), flat.numel(), dtype=torch.long)
    first.scatter_reduce_(0, flat, where, "amin")
    return (first[flat] == where).view_as(table)


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
        self.synced = 0                # rows of the plan whose steps every replica holds
        self.owed: list[int] = []      # samples given back (lost local steps), dealt next
        self._syncs = [0]              # rows at each fragment's last sync (``synced``: min)
        # a re-deal computed ahead (:meth:`prepare`): (size, position, Ahead)
        self._ahead: tuple | None = None

    def _table(self):
        return self.sampler.epoch_chunks()

    def _fresh(self, table):
        """Which entries of ``table`` are a sample's first appearance, rows in order (then
        ranks): the sampler pads a table to a whole number of rows by repeating samples
        (DistributedSampler's rule), and a re-deal over another number of replicas pads
        again; a repeat is not dealt, so that no sample is used twice."""
        if self._mask is None or self._mask[0] is not table:
            self._mask = (table, _first_seen(table, self.sampler))
        return self._mask[1]

    def next(self):
        table = self._table()
        epoch, rows = self.sampler.epoch, self.rows
        if rows >= table.shape[0]:                   # the epoch is over: the next one
            epoch, rows = epoch + 1, 0
            self.sampler.set_epoch(epoch)
            self._restart_syncs(0)
            table = self._table()
        end = min(rows + self.batch_size, int(table.shape[0]))
        column = table[rows:end, self.sampler.rank]
        fresh = column[self._fresh(table)[rows:end, self.sampler.rank]]
        # a batch of repeats only (the table's last row, a batch of one row): kept, so that
        # every rank has a batch to step on
        self.indices = (fresh if fresh.numel() else column).tolist()
        # samples owed from lost local steps: this step deals them over the ranks, once each
        self.indices = self.owed[self.sampler.rank::self.sampler.num_replicas] + self.indices
        self._taken = end
        return self.collate_fn([self.dataset[i] for i in self.indices])

    def commit(self) -> None:
        if self._taken is not None:
            self.rows, self._taken = self._taken, None
            self.owed = []

    def _restart_syncs(self, rows: int) -> None:
        self.rows = self.synced = rows
        self._syncs = [rows] * len(self._syncs)

    def mark_synced(self, fragments=(0,), count: int = 1) -> None:
        """Fragments ``fragments`` of ``count`` (the whole model by default) hold the
        committed rows so far in every replica's parameters (a sync, or a per-step
        algorithm's committed step); ``synced`` is the oldest fragment's position."""
        if len(self._syncs) != count:
            self._syncs = [self.synced] * count
        for p in fragments:
            self._syncs[p] = self.rows
        self.synced = min(self._syncs)

    def give_back(self, kept: int) -> dict:
        """Every replica goes on from rank ``kept``'s parameters (of the current plan): the
        samples the other ranks trained on since the last sync (their committed local
        steps, lost with their parameters) become owed, dealt again at the next committed
        step after :meth:`rebind`.  Returns the new :meth:`state_dict`."""
        table = self._table()
        rows, fresh = table[self.synced:self.rows], self._fresh(table)[self.synced:self.rows]
        for r in range(self.sampler.num_replicas):
            if r != kept:
                self.owed += rows[:, r][fresh[:, r]].tolist()
        self._restart_syncs(self.rows)
        return self.state_dict()

    def rollback(self) -> None:
        self._taken = None

    def state_dict(self) -> dict:
        """The job's committed position (the same on every rank), with the samples owed."""
        return {**self.sampler.state_dict(consumed=self.rows), "owed": list(self.owed)}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        owed = state.pop("owed", [])
        self.sampler.load_state_dict(state)
        self._loaded(state, owed)

    def _loaded(self, state: dict, owed) -> None:
        last_world, last_rows = state["history"][-1]
        self._restart_syncs(last_rows if last_world == self.sampler.num_replicas else 0)
        self.owed = [int(i) for i in owed]
        self._taken = None

    def _sampler_for(self, num_replicas: int, rank: int, old=None):
        old = old or self.sampler
        if hasattr(old, "resized"):     # holding the current plan: only the change is planned
            return old.resized(num_replicas, rank)
        return type(old)(old.dataset, old.complexities, num_replicas=num_replicas, rank=rank,
                         shuffle=old.shuffle, seed=old.seed, drop_last=old.drop_last,
                         random_level=old.random_level)

    def prepare(self, num_replicas: int) -> None:
        """Start computing, on a thread, the re-deal of the committed position over
        ``num_replicas`` ranks: after a step a peer failed in, the survivors wait for the
        Lighthouse to drop it (the heartbeat timeout, a second by default), and the next
        quorum is most likely this one less that peer.  :meth:`rebind` takes the result
        where the size and the position match (else it deals as before).  At a million
        samples the re-deal (sorts of the unseen samples by complexity) costs a few hundred
        milliseconds of the survivors' stall; here it is off it.  A re-deal still running
        from an earlier guess is left to finish on its own (never waited for)."""
        state = self.sampler.state_dict(consumed=self.rows)
        old = self.sampler

        def work():
            sampler = self._sampler_for(num_replicas, 0, old)
            sampler.load_state_dict(state)
            table = sampler.epoch_chunks()
            return sampler, table, _first_seen(table, sampler)
        self._ahead = (num_replicas, state, Ahead(work, "bagua-ft-redeal"))

    def rebind(self, num_replicas: int, rank: int, state: dict | None = None) -> None:
        """Serve rank ``rank`` of ``num_replicas`` from the committed position (``state``,
        by default this one's own): the unconsumed samples are re-dealt if the size changed."""
        state = dict(self.state_dict() if state is None else state)
        owed = state.pop("owed", [])
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[:2] == (num_replicas, state):
            try:       # started a heartbeat timeout ago: done, or nearly
                sampler, table, mask = ahead[2].result()
            except Exception:       # dealt below, where the error is raised if it must be
                pass
            else:
                sampler.rank = rank        # the table is every rank's: only the column moves
                self.sampler = sampler
                self._mask = (table, mask)
                self._loaded(state, owed)
                return
        if (self.sampler.num_replicas, self.sampler.rank) != (num_replicas, rank):
            self.sampler = self._sampler_for(num_replicas, rank)
        self.sampler.load_state_dict(state)
        self._loaded(state, owed)
