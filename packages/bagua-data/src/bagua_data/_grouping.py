"""Length-grouped, cost-balanced steps: the planning behind
``LengthGroupedDistributedBatchSampler``.

A *step* is one batch per rank, all taken together by a synchronous training step.  An
epoch's (or a resumed remainder's) samples are cut into buckets of consecutive samples of the
shuffled order, each bucket is sorted by length and cut into batches of neighbouring lengths
(low padding), and neighbouring batches form a step, whose samples are re-dealt across the
ranks when that lowers the step's largest batch cost (so its batches cost alike).  Steps are
then shuffled; the epoch's one incomplete step, if any, comes last.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

CostFn = Callable[[list[float]], float]
COSTS = ("sum", "padded", "attention")


class CostModel:
    """A batch's cost from its samples' lengths: a built-in name or a callable."""

    def __init__(self, cost: str | CostFn) -> None:
        if isinstance(cost, str):
            if cost not in COSTS:
                raise ValueError(f"cost must be one of {', '.join(map(repr, COSTS))} or a "
                                 f"callable cost(lengths) -> number, got {cost!r}")
            self.name, self.fn = cost, None
        elif callable(cost):
            self.name = "callable:" + getattr(cost, "__qualname__", type(cost).__name__)
            self.fn = cost
            self.of([1.0])    # refuse at construction a callable that cannot be used
        else:
            raise ValueError(f"cost must be one of {', '.join(map(repr, COSTS))} or a callable "
                             f"cost(lengths) -> number, got {type(cost).__name__} {cost!r:.60}")

    def of(self, lengths: Sequence[float]) -> float:
        """The cost of one batch, given its samples' lengths (any order)."""
        if self.fn is None:
            return self._builtin(len(lengths), max(lengths, default=0.0), math.fsum(lengths))
        try:
            value = float(self.fn(list(lengths)))
        except Exception as err:  # any failure means this cost is unusable
            raise ValueError(f"cost {self.name} cannot be used: cost({list(lengths)[:8]!r}"
                             f"{'...' if len(lengths) > 8 else ''}) raised "
                             f"{type(err).__name__}: {err}; it must take a list of lengths "
                             f"and return a finite number >= 0") from err
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"cost {self.name} cannot be used: it returned {value} for "
                             f"lengths {list(lengths)[:8]!r}; a batch's cost must be a finite "
                             f"number >= 0")
        return value

    def _builtin(self, count: int, longest: float, total: float) -> float:
        if self.name == "sum":
            return total
        if self.name == "padded":
            return count * longest
        return count * longest * longest           # "attention": padded score matrices

    def singles(self, lengths: torch.Tensor) -> torch.Tensor:
        """Every sample's cost alone in a batch (float64, like ``lengths``)."""
        if self.fn is None:
            return lengths * lengths if self.name == "attention" else lengths.clone()
        values = lengths.tolist()
        memo = {v: self.of([v]) for v in set(values)}
        return torch.tensor([memo[v] for v in values], dtype=torch.float64)


class Planner:
    """Cuts a list of sample indices into steps of ``world`` batches."""

    def __init__(self, lengths: torch.Tensor, cost: CostModel, batch_size: int | None,
                 max_cost: float | None, bucket_size: int, drop_last: bool) -> None:
        self.lengths = lengths
        self.cost = cost
        self.batch_size = batch_size
        self.max_cost = max_cost
        self.bucket_size = bucket_size
        self.drop_last = drop_last
        self.per_batch = self._samples_per_batch()

    def _samples_per_batch(self) -> int:
        """Samples in a typical batch: ``batch_size``, or as many median-length samples as
        ``max_cost`` holds (capped by ``batch_size``); it only sizes the buckets."""
        if self.max_cost is None:
            return int(self.batch_size)
        n = self.lengths.numel()
        median = float(self.lengths.median()) if n else 1.0
        cap = min(self.batch_size or n or 1, 1 << 20)

        def fits(k: int) -> bool:
            return self.cost.of([median] * k) <= self.max_cost

        lo, hi = 1, 1          # fits(lo); find the largest such lo <= cap
        while hi < cap and fits(min(hi * 2, cap)):
            lo = hi = min(hi * 2, cap)
        hi = min(hi * 2, cap + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def plan(self, order: list[int], world: int,
             g: torch.Generator | None) -> list[list[list[int]]]:
        """Steps over ``order`` (each sample once, plus repeats only to give every rank a
        batch in a final step with fewer samples than ranks); ``g`` shuffles the full steps
        (``None``: kept in order)."""
        bucket = self.bucket_size * world * self.per_batch
        full: list[list[list[int]]] = []
        loose: list[list[int]] = []
        for start in range(0, len(order), bucket):
            batches = self._cut(self._sorted(order[start:start + bucket]))
            whole = len(batches) // world * world
            full.extend(self._balance(batches[j:j + world])
                        for j in range(0, whole, world))
            loose.extend(batches[whole:])
        # Batches left over by the buckets: grouped by length with their like.
        loose.sort(key=lambda b: self.lengths[b[-1]].item())
        whole = len(loose) // world * world
        full.extend(self._balance(loose[j:j + world]) for j in range(0, whole, world))
        if g is not None and len(full) > 1:
            full = [full[i] for i in torch.randperm(len(full), generator=g).tolist()]
        rest = loose[whole:]
        if rest and not self.drop_last:
            full.append(self._last_step(rest, world, order))
        return full

    def _sorted(self, indices: list[int]) -> list[int]:
        keys = self.lengths[torch.tensor(indices, dtype=torch.long)]
        # Stable: equal lengths keep the shuffled order, so ties are broken anew each epoch.
        return [indices[i] for i in torch.sort(keys, stable=True).indices.tolist()]

    def _cut(self, indices: list[int]) -> list[list[int]]:
        """Greedy batches of neighbours (``indices`` sorted by length): a batch closes when
        one more sample would pass ``batch_size`` or ``max_cost``."""
        lens = self.lengths[torch.tensor(indices, dtype=torch.long)].tolist()
        cap = self.batch_size or len(indices) or 1
        batches, start, total = [], 0, 0.0
        for j, length in enumerate(lens):
            count = j - start + 1
            if count > 1 and (count > cap or (
                    self.max_cost is not None
                    and self._cost_with(lens, start, j, total) > self.max_cost)):
                batches.append(indices[start:j])
                start, total = j, 0.0
            total += length
        if indices:
            batches.append(indices[start:])
        return batches

    def _cost_with(self, lens: list[float], start: int, j: int, total: float) -> float:
        """Cost of ``lens[start:j + 1]`` (ascending); ``total`` is the sum of ``lens[start:j]``."""
        if self.cost.fn is None:
            return self.cost._builtin(j - start + 1, lens[j], total + lens[j])
        return self.cost.of(lens[start:j + 1])

    def _batch_cost(self, batch: list[int]) -> float:
        return self.cost.of(self.lengths[torch.tensor(batch, dtype=torch.long)].tolist())

    def _fits(self, batch: list[int]) -> bool:
        return ((self.batch_size is None or len(batch) <= self.batch_size)
                and (self.max_cost is None or len(batch) == 1
                     or self._batch_cost(batch) <= self.max_cost))

    def _balance(self, step: list[list[int]]) -> list[list[int]]:
        """The step's samples dealt across its batches in snake order (the longest ones to
        different ranks), if that keeps every limit and lowers or keeps the step's largest
        batch cost; else the batches as cut."""
        world = len(step)
        samples = self._sorted([i for b in step for i in b])
        if len(samples) < world:
            return step
        dealt: list[list[int]] = [[] for _ in range(world)]
        for k, i in enumerate(samples):
            lap, pos = divmod(k, world)
            dealt[pos if lap % 2 == 0 else world - 1 - pos].append(i)
        if not all(self._fits(b) for b in dealt):
            return step
        if max(map(self._batch_cost, dealt)) > max(map(self._batch_cost, step)):
            return step
        return dealt

    def _last_step(self, rest: list[list[int]], world: int,
                   order: list[int]) -> list[list[int]]:
        """Fewer than ``world`` batches made into ``world``: re-dealt, or the largest batches
        split in two; below ``world`` samples, padded with the first samples of ``order``."""
        samples = [i for b in rest for i in b]
        if len(samples) >= world:
            dealt = self._balance(self._chunk(self._sorted(samples), world))
            if all(self._fits(b) for b in dealt):
                return dealt
        batches = [list(b) for b in rest]
        while len(batches) < world:
            big = max(range(len(batches)), key=lambda k: len(batches[k]))
            if len(batches[big]) < 2:
                break
            b = batches.pop(big)
            batches[big:big] = [b[:len(b) // 2], b[len(b) // 2:]]
        pad = world - len(batches)
        batches.extend([order[k % len(order)]] for k in range(pad))
        return batches

    @staticmethod
    def _chunk(samples: list[int], world: int) -> list[list[int]]:
        """``samples`` in ``world`` contiguous runs of near-equal size."""
        q, r = divmod(len(samples), world)
        out, start = [], 0
        for k in range(world):
            size = q + (1 if k < r else 0)
            out.append(samples[start:start + size])
            start += size
        return out


def check_positive_int(value: Any, name: str, rule: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 ({rule}), got {value!r}")
    return value
