"""``LoadBalancingDistributedSampler``: DistributedSampler's contract, Bagua's balancing."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from ._complexity import ComplexitySource, compute_complexities, noise_scale
from ._progress import Progress
from ._resume import check_consumed, check_rows, check_state, make_state, unseen_of
from ._world import resolve_world


class LoadBalancingDistributedSampler(Sampler[int]):
    """Give every rank a share of the dataset such that all ranks' i-th samples cost alike.

    A drop-in replacement for :class:`torch.utils.data.DistributedSampler` (same ``len``,
    same padding when ``drop_last=False``, same dropping when ``True``, ``set_epoch``,
    deterministic for a given ``seed + epoch``) for datasets whose samples differ in cost
    (sequence lengths in NLP or speech).  Each epoch it takes the same multiset of indices as
    DistributedSampler would, sorts them by complexity (plus optional uniform noise of width
    ``random_level * (max - min)``), cuts the sorted list into chunks of ``num_replicas``
    neighbours, shuffles the chunks with ``seed + epoch``, and gives rank ``r`` element ``r`` of
    every chunk.  So the ranks' i-th samples have near-equal complexity and, with a fixed batch
    size, no rank waits for a slower one at each gradient synchronisation.

    Args:
        dataset: a map-style dataset (anything with ``len``).
        complexity_fn: ``complexity_fn(sample) -> number``, called once per sample here, or a
            precomputed sequence (list, numpy array, tensor) with one number per sample, e.g.
            a lengths column, so that large datasets need no pass through ``__getitem__``.
        num_replicas: number of ranks; default torch.distributed's world size when
            initialised, else 1.
        rank: this process's rank; default torch.distributed's rank when initialised, else 0.
        shuffle: shuffle chunks (and which samples pad or are dropped) each epoch.  With
            ``False`` the order is ascending complexity, the same every epoch.
        seed: shared by all ranks; the epoch's order depends on ``seed + epoch`` only.
        drop_last: drop the tail to make the dataset divisible by ``num_replicas`` instead
            of padding it with repeated samples.
        random_level: in ``[0, 1]``; 0 balances best, 1 mixes samples across a whole range
            of complexities (more randomness in which samples share a step).

    Call :meth:`set_epoch` before each epoch, as with DistributedSampler.  For mid-epoch
    resumption see :meth:`state_dict` and :meth:`load_state_dict`.

    Example::

        >>> sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lengths)
        >>> loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        >>> for epoch in range(epochs):
        ...     sampler.set_epoch(epoch)
        ...     for batch in loader:
        ...         ...
    """

    def __init__(self, dataset: Sized, complexity_fn: ComplexitySource,
                 num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 random_level: float = 0.0) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int shared by all ranks, got {seed!r}")
        if (isinstance(random_level, bool) or not isinstance(random_level, (int, float))
                or not 0.0 <= random_level <= 1.0):
            raise ValueError(f"random_level must be a number in [0, 1] (0: best balance), got "
                             f"{random_level!r}")
        self.num_replicas, self.rank = resolve_world(num_replicas, rank)
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.random_level = float(random_level)
        self.epoch = 0
        self._complexities = compute_complexities(dataset, complexity_fn)
        self._noise = noise_scale(self._complexities, self.random_level)
        self.num_samples = self._rows(self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self._progress = Progress()
        # (epoch, history before the current plan) after a resume at another world size
        self._prior: tuple[int, list[list[int]]] | None = None
        self._table: tuple[tuple, torch.Tensor] | None = None

    @property
    def complexities(self) -> torch.Tensor:
        """The per-sample complexities (float64, indexed like the dataset); do not modify."""
        return self._complexities

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; with ``shuffle=True`` each epoch has its own order."""
        self.epoch = epoch

    def __len__(self) -> int:
        if self._prior_history(self.epoch):
            return int(self.epoch_chunks().shape[0])
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        order = self.epoch_chunks()[:, self.rank].tolist()
        return self._progress.iterate(self.epoch, order)

    def epoch_chunks(self) -> torch.Tensor:
        """This epoch's ``(num_samples, num_replicas)`` index table: row i holds every rank's
        i-th sample (column r is rank r's order), a row's samples having neighbouring
        complexities.  The same on every rank.  After a resume at another world size, the
        table of the resumed epoch holds the samples still unseen, re-balanced."""
        prior = self._prior_history(self.epoch)
        key = (self.epoch, self.num_replicas, tuple(map(tuple, prior)))
        if self._table is None or self._table[0] != key:
            self._table = (key, self._plan(self.epoch, prior, self.num_replicas))
        return self._table[1]

    # -- an epoch's plans ------------------------------------------------------------------
    def _rows(self, world: int) -> int:
        """Rows of an epoch's table at ``world`` ranks: DistributedSampler's arithmetic."""
        n = self._complexities.numel()
        if self.drop_last and n % world != 0:
            return math.ceil((n - world) / world)
        return math.ceil(n / world)

    def _base_chunks(self, epoch: int, world: int) -> torch.Tensor:
        """The epoch's table at ``world`` ranks, from its start."""
        n = self._complexities.numel()
        rows = self._rows(world)
        total = rows * world
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        if self.shuffle:
            indices = torch.randperm(n, generator=g)
        else:
            indices = torch.arange(n)
        if self.drop_last or n == 0:
            indices = indices[:total]
        elif total > n:  # pad by repeating from the start, like DistributedSampler
            pad = total - n
            indices = torch.cat([indices, indices.repeat(math.ceil(pad / n))[:pad]])
        return self._deal(indices, rows, world, g)

    def _deal(self, indices: torch.Tensor, rows: int, world: int,
              g: torch.Generator) -> torch.Tensor:
        """Sort ``indices`` by complexity, cut into rows of ``world`` neighbours, shuffle rows."""
        keys = self._complexities[indices]
        if self.shuffle and self._noise > 0.0:
            keys = keys + torch.rand(keys.numel(), generator=g, dtype=torch.float64) * self._noise
        # Stable sort: equal keys keep the shuffled order, so ties are broken anew each epoch.
        chunks = indices[torch.sort(keys, stable=True).indices].view(rows, world)
        if self.shuffle:
            chunks = chunks[torch.randperm(rows, generator=g)]
        return chunks

    def _rebalance(self, epoch: int, pool, world: int, salt: int) -> torch.Tensor:
        """A table over ``pool`` (unseen samples, once each) at ``world`` ranks: padded with
        repeats of its first samples to a multiple of ``world`` (``drop_last=True``: the last
        ``len(pool) % world`` are dropped instead), then dealt like an epoch."""
        g = torch.Generator()
        g.manual_seed(((self.seed + epoch) * 1_000_003 + salt) % (1 << 63))
        indices = torch.as_tensor(pool, dtype=torch.long)     # a list or a tensor
        m = indices.numel()
        if self.shuffle and m:
            indices = indices[torch.randperm(m, generator=g)]
        rows = m // world if self.drop_last else math.ceil(m / world)
        total = rows * world
        if total <= m:
            indices = indices[:total]
        else:
            pad = total - m
            indices = torch.cat([indices, indices.repeat(math.ceil(pad / m))[:pad]])
        return self._deal(indices, rows, world, g)

    def _plan(self, epoch: int, prior: list[list[int]], world: int) -> torch.Tensor:
        """The table that follows ``prior`` ([num_replicas, rows consumed] per earlier plan)."""
        first = 0
        if prior and self._table is not None and self._table[0] == (
                epoch, prior[-1][0], tuple(map(tuple, prior[:-1]))):
            # the last earlier plan is the one held (a sampler resized from the one that ran
            # it): only the last change is planned.  A plan after the first holds samples no
            # earlier plan dealt (its repeats are its own), so no earlier row is needed.
            table, first = self._table[1], len(prior) - 1
        else:
            table = self._base_chunks(epoch, prior[0][0] if prior else world)
        # which dataset indices a committed row of an earlier plan holds (a mask: a
        # membership change under FaultTolerant re-plans on the survivors' critical path)
        consumed = torch.zeros(self._complexities.numel(), dtype=torch.bool)
        for j, (_, rows) in enumerate(prior[first:], start=first):
            check_rows(rows, int(table.shape[0]), "samples")
            consumed[table[:rows].reshape(-1)] = True
            pool = unseen_of(consumed, table[rows:].reshape(-1))
            nxt = prior[j + 1][0] if j + 1 < len(prior) else world
            table = self._rebalance(epoch, pool, nxt, j + 1)
        return table

    def resized(self, num_replicas: int, rank: int) -> LoadBalancingDistributedSampler:
        """This sampler for ``rank`` of ``num_replicas``: the same dataset, complexities
        (not computed again) and settings, holding this one's current plan, so that
        ``load_state_dict(state)`` of a position in that plan deals the unseen samples over
        the new world without replaying the epoch's earlier plans (what the survivors of a
        membership change do under ``bagua_algos.ft``: at a million samples each replayed
        plan is a sort of the epoch)."""
        new = type(self)(self.dataset, self._complexities, num_replicas=num_replicas,
                         rank=rank, shuffle=self.shuffle, seed=self.seed,
                         drop_last=self.drop_last, random_level=self.random_level)
        new._table = self._table
        return new

    def _prior_history(self, epoch: int) -> list[list[int]]:
        if self._prior is not None and self._prior[0] == epoch:
            return self._prior[1]
        return []

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The job's position in the current epoch, the same on every rank.

        ``state["consumed"]`` counts the samples all ranks together have consumed this epoch
        (padding included); ``state["history"]`` lists ``[num_replicas, samples per rank]``
        of each world size the epoch ran at, which :meth:`load_state_dict` needs to resume
        at any world size.  ``consumed`` (argument) is the number of samples *this rank's*
        training loop has used this epoch; by default the number this sampler has handed
        out.  The default is exact for a ``DataLoader`` with ``num_workers=0``; with worker
        processes the loader prefetches ahead of the loop, so pass
        ``consumed=steps_done * batch_size``.
        """
        position = self._progress.position(self.epoch)
        rows = check_consumed(consumed, position, len(self))
        history = [*self._prior_history(self.epoch), [self.num_replicas, rows]]
        return make_state(self.epoch, history, self._order_settings())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state["epoch"]`` continues where the job stopped.

        At the same ``num_replicas`` every rank continues its own order exactly (as if
        uninterrupted).  At another ``num_replicas`` the samples the epoch has not yet
        consumed are dealt out anew over the new ranks, balanced, each exactly once (plus
        the padding the new world needs, or minus fewer than ``num_replicas`` samples with
        ``drop_last=True``).  The other settings (seed, shuffle, drop_last, random_level,
        dataset length) must match; a mismatch raises ``ValueError``.  Calling
        ``set_epoch`` with the saved epoch afterwards keeps the position.
        """
        history = check_state(state, self._order_settings(), "sampler")
        epoch = state["epoch"]
        if history[-1][0] == self.num_replicas:
            prior, rows = history[:-1], history[-1][1]
        else:
            prior, rows = history, 0
        table = self._plan(epoch, prior, self.num_replicas)    # validates every entry
        check_rows(rows, int(table.shape[0]), "samples")
        self.epoch = epoch
        self._prior = (epoch, prior)
        self._table = ((epoch, self.num_replicas, tuple(map(tuple, prior))), table)
        self._progress.restore(epoch, rows)

    def _order_settings(self) -> dict[str, Any]:
        return {"seed": self.seed, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "random_level": self.random_level,
                "dataset_len": self._complexities.numel()}
