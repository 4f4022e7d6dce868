"""``LengthGroupedDistributedBatchSampler``: low-padding batches, equal cost on every rank."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from ._complexity import ComplexitySource, compute_complexities
from ._grouping import CostFn, CostModel, Planner, check_positive_int
from ._progress import Progress
from ._resume import check_consumed, check_rows, check_state, make_state, unseen
from ._world import resolve_world


class LengthGroupedDistributedBatchSampler(Sampler[list[int]]):
    """Batches of similar lengths (little padding), dealt so that every step's batches cost
    alike on every rank (no rank waits at the gradient synchronisation).

    Each epoch (``seed + epoch``) the samples are shuffled and cut into buckets of
    ``bucket_size`` batches per rank.  Each bucket is sorted by length and cut into batches of
    neighbours: ``batch_size`` samples, or as many as keep the batch's cost within
    ``max_cost`` (both may be given).  ``num_replicas`` neighbouring batches form a step;
    when it lowers the step's costliest batch, the step's samples are re-dealt across its
    batches longest-first in snake order, so the ranks' batches cost near the same under
    ``cost``.  The steps are shuffled; rank ``r`` takes batch ``r`` of every step, so every
    rank has the same number of batches.

    Args:
        dataset: a map-style dataset (anything with ``len``).
        lengths: each sample's length (tokens, frames): a sequence with one number per sample
            (a lengths column, array, tensor), or ``lengths(sample) -> number`` called once per
            sample here.  Finite and ``>= 0``.
        batch_size: samples per batch (an upper bound when ``max_cost`` is also given).
        max_cost: the most a batch may cost under ``cost``, e.g. 4096 padded tokens.
            At least one of ``batch_size`` and ``max_cost`` is required.
        cost: what a batch costs your model, given its samples' lengths ``l``:
            ``"padded"`` (default) ``len(l) * max(l)``, a padded batch's tokens;
            ``"sum"`` ``sum(l)``, packed or unpadded tokens; ``"attention"``
            ``len(l) * max(l)**2``, a padded batch's attention scores; or a callable
            ``cost(l: list[float]) -> float`` (finite, ``>= 0``, not decreasing when a sample
            is added).
        bucket_size: batches per rank sorted together (default 50, the size of Hugging Face's
            ``group_by_length`` mega-batches).  Larger buckets pad less and randomise less.
            With ``max_cost`` alone a batch is counted as the median-length samples it holds.
        num_replicas, rank: default torch.distributed's when initialised, else 1 and 0.
        shuffle: shuffle samples and steps each epoch; ``False`` keeps the index order in
            buckets and the steps in order, the same every epoch.
        seed: shared by all ranks; an epoch depends on ``seed + epoch`` only.
        drop_last: drop the epoch's last, incomplete step (fewer than ``num_replicas`` full
            batches) instead of dealing it out.

    Every sample appears exactly once per epoch.  With ``drop_last=False`` the samples left
    over after the full steps form one last step of ``num_replicas`` smaller batches
    (re-dealt, or the largest split in two); only when fewer samples than ranks are left are
    some repeated (the epoch's first ones) so that every rank has a batch.

    Example::

        >>> batches = LengthGroupedDistributedBatchSampler(dataset, lengths, batch_size=32)
        >>> loader = DataLoader(dataset, batch_sampler=batches, collate_fn=pad_collate)
        >>> for epoch in range(epochs):
        ...     batches.set_epoch(epoch)
        ...     for batch in loader:
        ...         ...
    """

    def __init__(self, dataset: Sized, lengths: ComplexitySource, batch_size: int | None = None,
                 max_cost: float | None = None, cost: str | CostFn = "padded",
                 bucket_size: int = 50, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        if batch_size is None and max_cost is None:
            raise ValueError("batch_size or max_cost is required (samples per batch, or the "
                             "most a batch may cost under cost); got neither")
        if batch_size is not None:
            check_positive_int(batch_size, "batch_size", "samples per batch")
        if max_cost is not None:
            if (isinstance(max_cost, bool) or not isinstance(max_cost, (int, float))
                    or not math.isfinite(max_cost) or max_cost <= 0):
                raise ValueError(f"max_cost must be a finite number > 0 (the most a batch may "
                                 f"cost under cost), got {max_cost!r}")
            max_cost = float(max_cost)
        check_positive_int(bucket_size, "bucket_size", "batches per rank sorted together")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int shared by all ranks, got {seed!r}")
        model = CostModel(cost)
        self.num_replicas, self.rank = resolve_world(num_replicas, rank)
        self._lengths = compute_complexities(dataset, lengths, name="lengths")
        if self._lengths.numel() and float(self._lengths.min()) < 0:
            i = int(self._lengths.argmin())
            raise ValueError(f"lengths must be >= 0; sample {i} has {float(self._lengths[i])}")
        if max_cost is not None and self._lengths.numel():
            alone = model.singles(self._lengths)
            i = int(alone.argmax())
            if float(alone[i]) > max_cost:
                raise ValueError(f"max_cost={max_cost:g} cannot be honoured under cost "
                                 f"{model.name!r}: sample {i} (length "
                                 f"{float(self._lengths[i]):g}) costs {float(alone[i]):g} "
                                 f"alone; raise max_cost or leave such samples out")
        self.dataset = dataset
        self.batch_size = batch_size
        self.max_cost = max_cost
        self.cost = cost
        self.bucket_size = bucket_size
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._model = model
        self._planner = Planner(self._lengths, model, batch_size, max_cost, bucket_size,
                                self.drop_last)
        self._progress = Progress()
        # (epoch, history before the current plan) after a resume at another world size
        self._prior: tuple[int, list[list[int]]] | None = None
        self._cache: tuple[tuple, list[list[list[int]]]] | None = None

    @property
    def lengths(self) -> torch.Tensor:
        """The per-sample lengths (float64, indexed like the dataset); do not modify."""
        return self._lengths

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; with ``shuffle=True`` each epoch has its own batches."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.epoch_steps())

    def __iter__(self) -> Iterator[list[int]]:
        mine = [step[self.rank] for step in self.epoch_steps()]
        return self._progress.iterate(self.epoch, mine)

    def batch_cost(self, batch: list[int]) -> float:
        """What ``batch`` (dataset indices) costs under this sampler's ``cost``."""
        return self._model.of([float(self._lengths[i]) for i in batch])

    def epoch_steps(self) -> list[list[list[int]]]:
        """This epoch's steps, the same on every rank: step ``k`` lists ``num_replicas``
        batches, rank ``r`` takes batch ``r``.  After a resume at another world size, the
        steps of the resumed epoch hold the samples still unseen."""
        prior = self._prior_history(self.epoch)
        key = (self.epoch, self.num_replicas, tuple(map(tuple, prior)))
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._plan(self.epoch, prior, self.num_replicas))
        return self._cache[1]

    # -- an epoch's plans ------------------------------------------------------------------
    def _build(self, epoch: int, pool: list[int] | None, world: int,
               salt: int) -> list[list[list[int]]]:
        """Steps over ``pool`` (``None``: the whole dataset, the epoch's own order)."""
        g = torch.Generator()
        if pool is None:
            g.manual_seed(self.seed + epoch)
            n = self._lengths.numel()
            order = torch.randperm(n, generator=g) if self.shuffle else torch.arange(n)
        else:
            g.manual_seed(((self.seed + epoch) * 1_000_003 + salt) % (1 << 63))
            order = torch.tensor(pool, dtype=torch.long)
            if self.shuffle and order.numel():
                order = order[torch.randperm(order.numel(), generator=g)]
        return self._planner.plan(order.tolist(), world, g if self.shuffle else None)

    def _plan(self, epoch: int, prior: list[list[int]], world: int) -> list[list[list[int]]]:
        """The steps that follow ``prior`` ([num_replicas, steps consumed] per earlier plan;
        see ``_resume.py``)."""
        steps = self._build(epoch, None, prior[0][0] if prior else world, 0)
        consumed: set[int] = set()
        for j, (_, rows) in enumerate(prior):
            check_rows(rows, len(steps), "batches")
            consumed.update(i for step in steps[:rows] for b in step for i in b)
            pool = unseen(consumed, (i for step in steps[rows:] for b in step for i in b))
            nxt = prior[j + 1][0] if j + 1 < len(prior) else world
            steps = self._build(epoch, pool, nxt, j + 1)
        return steps

    def _prior_history(self, epoch: int) -> list[list[int]]:
        if self._prior is not None and self._prior[0] == epoch:
            return self._prior[1]
        return []

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The job's position in the current epoch, counted in steps; the same on every rank.

        ``state["history"]`` lists ``[num_replicas, batches per rank]`` of each world size
        the epoch ran at.  ``consumed`` (argument) is the number of batches *this rank's* loop
        has used this epoch; by default the number handed out, exact for
        ``DataLoader(num_workers=0)``.  With worker processes pass ``consumed=steps_done``.
        """
        position = self._progress.position(self.epoch)
        rows = check_consumed(consumed, position, len(self))
        history = [*self._prior_history(self.epoch), [self.num_replicas, rows]]
        state = make_state(self.epoch, history, self._order_settings())
        state["num_batches"] = len(self)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state["epoch"]`` continues where the job stopped.

        At the same ``num_replicas`` every rank continues with its next batch, exactly.  At
        another ``num_replicas`` the samples the epoch has not consumed are grouped and dealt
        anew over the new ranks, each exactly once (plus the repeats or the dropped last
        step of an epoch).  Settings that fix the order (seed, shuffle, drop_last,
        batch_size, max_cost, cost, bucket_size, the lengths) must match: ``ValueError``.
        """
        if not isinstance(state, dict) or not isinstance(state.get("num_batches"), int):
            raise ValueError("state must be a dict from batch_sampler.state_dict() (with an int "
                             "'num_batches')")
        history = check_state(state, self._order_settings(), "length-grouped batch sampler")
        epoch = state["epoch"]
        saved = self._plan(epoch, history[:-1], history[-1][0])
        if state["num_batches"] != len(saved):
            raise ValueError(f"cannot resume: the checkpoint's epoch had {state['num_batches']} "
                             f"batches per rank but this sampler makes {len(saved)}; use the "
                             f"same cost and lengths")
        check_rows(history[-1][1], len(saved), "batches")
        if history[-1][0] == self.num_replicas:
            prior, rows, plan = history[:-1], history[-1][1], saved
        else:
            prior, rows = history, 0
            plan = self._plan(epoch, prior, self.num_replicas)
        self.epoch = epoch
        self._prior = (epoch, prior)
        self._cache = ((epoch, self.num_replicas, tuple(map(tuple, prior))), plan)
        self._progress.restore(epoch, rows)

    def _order_settings(self) -> dict[str, Any]:
        return {"seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "dataset_len": self._lengths.numel(), "batch_size": self.batch_size,
                "max_cost": self.max_cost, "cost": self._model.name,
                "bucket_size": self.bucket_size, "lengths_total": math.fsum(
                    self._lengths.tolist())}
