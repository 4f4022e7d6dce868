"""``LoadBalancingDistributedSampler``: DistributedSampler's contract, Bagua's balancing."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from ._complexity import ComplexitySource, compute_complexities, noise_scale
from ._progress import STATE_VERSION, Progress, check_consumed, check_state
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
        n = self._complexities.numel()
        # DistributedSampler's arithmetic, to the letter.
        if self.drop_last and n % self.num_replicas != 0:
            self.num_samples = math.ceil((n - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self._progress = Progress()

    @property
    def complexities(self) -> torch.Tensor:
        """The per-sample complexities (float64, indexed like the dataset); do not modify."""
        return self._complexities

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; with ``shuffle=True`` each epoch has its own order."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        order = self.epoch_chunks()[:, self.rank].tolist()
        return self._progress.iterate(self.epoch, order)

    def epoch_chunks(self) -> torch.Tensor:
        """This epoch's ``(num_samples, num_replicas)`` index table: row i holds every rank's
        i-th sample (column r is rank r's order), a row's samples having neighbouring
        complexities.  The same on every rank."""
        n = self._complexities.numel()
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        if self.shuffle:
            indices = torch.randperm(n, generator=g)
        else:
            indices = torch.arange(n)
        if self.drop_last or n == 0:
            indices = indices[: self.total_size]
        elif self.total_size > n:  # pad by repeating from the start, like DistributedSampler
            pad = self.total_size - n
            indices = torch.cat([indices, indices.repeat(math.ceil(pad / n))[:pad]])
        keys = self._complexities[indices]
        if self.shuffle and self._noise > 0.0:
            keys = keys + torch.rand(keys.numel(), generator=g, dtype=torch.float64) * self._noise
        # Stable sort: equal keys keep the shuffled order, so ties are broken anew each epoch.
        chunks = indices[torch.sort(keys, stable=True).indices].view(self.num_samples,
                                                                     self.num_replicas)
        if self.shuffle:
            chunks = chunks[torch.randperm(self.num_samples, generator=g)]
        return chunks

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where this rank is in the current epoch, to resume after a restart.

        ``consumed`` is the number of samples the training loop has used this epoch; by
        default the number this sampler has handed out.  The default is exact for a
        ``DataLoader`` with ``num_workers=0``; with worker processes the loader prefetches
        ahead of the loop, so pass ``consumed=steps_done * batch_size``.
        """
        position = self._progress.position(self.epoch)
        state = {"version": STATE_VERSION, "epoch": self.epoch,
                 "consumed": check_consumed(consumed, position, self.num_samples)}
        state.update(self._order_settings())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state["epoch"]`` starts at the first unseen sample.

        The sampler must have been built with the same settings (seed, world size, shuffle,
        drop_last, random_level, dataset length); a mismatch raises ``ValueError``.  Calling
        ``set_epoch`` with the saved epoch afterwards keeps the position.
        """
        check_state(state, self._order_settings(), self.num_samples, "sampler")
        self.epoch = state["epoch"]
        self._progress.restore(self.epoch, state["consumed"])

    def _order_settings(self) -> dict[str, Any]:
        return {"seed": self.seed, "num_replicas": self.num_replicas, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "random_level": self.random_level,
                "dataset_len": self._complexities.numel()}
