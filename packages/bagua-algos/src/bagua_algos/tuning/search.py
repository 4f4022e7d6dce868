"""The autotuner's search, free of torch and communication so it can be tested on simulated
cost functions.

Configurations are dicts such as ``{"bucket_size": 4194304, "hierarchical": False}``.  A score
is seconds per step (lower is better).  The search is deterministic: given the same scores it
asks for the same configurations in the same order, which is what keeps every rank on the
same configuration (every rank feeds it the same, reduced scores).

Plan, for ``sizes`` sorted ascending and spaced evenly in log space:

1. the starting configuration (the user's bucket size): the baseline to beat;
2. every other value of each categorical knob (e.g. hierarchical) at the starting size;
   the best value is kept from here on;
3. a coarse bracket: up to ``coarse`` sizes spread evenly over the (log-spaced) candidates;
4. refinement: halve the gaps next to the best size measured so far until its neighbours
   are measured (a discrete golden-section / bisection step: bucket size is close to
   unimodal in log space);
5. a final: the best ``confirm - 1`` configurations and the start (or the best ``confirm``
   if the start is among them) are measured again, in the order A B C C B A so that a slow
   drift of the machine's load weighs on each of them equally; only these measurements
   decide.  The lowest mean wins, but the start stays unless beaten by more than ``tie``
   (relative) or by more than the run-to-run spread of the finalists, whichever is larger,
   so noise does not move the result away from what the user had.
"""

from __future__ import annotations

import math
from collections.abc import Generator


def log_spaced_sizes(lo: int, hi: int, factor: float = 2.0) -> list[int]:
    """Bucket sizes ``lo, lo*factor, ...`` up to the first one >= ``hi`` (integers, bytes)."""
    if lo <= 0 or hi < lo or factor <= 1:
        raise ValueError(f"need 0 < lo <= hi and factor > 1, got lo={lo}, hi={hi}, "
                         f"factor={factor}")
    n = max(0, math.ceil(math.log(hi / lo, factor) - 1e-9))
    return sorted({round(lo * factor ** i) for i in range(n + 1)})


def _key(config: dict) -> tuple:
    return tuple(sorted(config.items()))


class Search:
    """Ask/tell driver of the plan above, bounded by ``max_trials``.

    ``ask()`` returns the next configuration to measure (``None`` once done); ``tell(score)``
    reports the score of the configuration ``ask()`` returned last.  ``best`` is the lowest
    mean score measured so far; ``trials`` the history.
    """

    def __init__(self, sizes: list[int], start: dict, categorical: dict[str, list] | None = None,
                 *, max_trials: int = 24, coarse: int = 5, confirm: int = 3,
                 tie: float = 0.01):
        if not sizes or sorted(set(sizes)) != list(sizes):
            raise ValueError(f"sizes must be distinct and ascending, got {sizes}")
        if "bucket_size" not in start or start["bucket_size"] not in sizes:
            raise ValueError("start must hold a bucket_size that is one of sizes")
        if max_trials < 1:
            raise ValueError(f"max_trials must be >= 1, got {max_trials}")
        self.sizes = list(sizes)
        self.start = dict(start)
        self.categorical = {k: list(v) for k, v in (categorical or {}).items()}
        self.max_trials = max_trials
        self.coarse = coarse
        self.confirm = confirm
        self.tie = tie
        self.trials: list[dict] = []
        self._scores: dict[tuple, list[float]] = {}
        self._configs: dict[tuple, dict] = {}
        self._final: dict[tuple, list[float]] | None = None    # the final's scores
        self._gen = self._plan()
        self._pending: dict | None = None
        self._done = False
        self._advance(None)

    # -- ask / tell -----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done

    def ask(self) -> dict | None:
        return None if self._done else dict(self._pending)

    def tell(self, score: float) -> None:
        if self._done or self._pending is None:
            raise RuntimeError("tell() without a pending ask()")
        config = self._pending
        score = float(score)
        self.trials.append({"config": dict(config), "score": score})
        k = _key(config)
        self._scores.setdefault(k, []).append(score)
        if self._final is not None:
            self._final.setdefault(k, []).append(score)
        self._configs[k] = dict(config)
        if len(self.trials) >= self.max_trials:
            self._finish()
            return
        self._advance(score)

    def mean(self, config: dict) -> float | None:
        s = self._scores.get(_key(config))
        return sum(s) / len(s) if s else None

    @property
    def best(self) -> dict:
        """The chosen configuration: lowest mean score, the start winning near-ties."""
        scores = self._final or self._scores
        if not scores:
            return dict(self.start)

        def mean(k):
            return sum(scores[k]) / len(scores[k])

        k = min(scores, key=lambda k: (mean(k), k))
        start = _key(self.start)
        if start in scores and mean(start) <= mean(k) * (1 + self.margin()):
            return dict(self.start)
        return dict(self._configs[k])

    def margin(self) -> float:
        """How much faster than the start a configuration must be to replace it: ``tie``, or
        the run-to-run spread seen so far if larger (the median over re-measured
        configurations of (max - min) / mean), so that noise never moves the choice away
        from what the user had."""
        spreads = sorted((max(v) - min(v)) / (sum(v) / len(v))
                         for v in (self._final or self._scores).values() if len(v) > 1)
        noise = spreads[len(spreads) // 2] if spreads else 0.0
        return max(self.tie, noise)

    # -- internals ------------------------------------------------------------------------------
    def _advance(self, score) -> None:
        try:
            self._pending = self._gen.send(score) if self._pending is not None else next(
                self._gen)
        except StopIteration:
            self._finish()

    def _finish(self) -> None:
        self._done = True
        self._pending = None
        self._gen.close()

    def _plan(self) -> Generator[dict, float, None]:
        current = dict(self.start)
        yield current
        # 2. categorical knobs at the starting size, one at a time
        for name, values in self.categorical.items():
            for v in values:
                cand = {**current, name: v}
                if self.mean(cand) is None:
                    yield cand
            current = min(({**current, name: v} for v in values),
                          key=lambda c: self.mean(c) if self.mean(c) is not None else math.inf)
            if self.mean(self.start) <= self.mean(current) * (1 + self.tie):
                current = {**current, name: self.start[name]}

        def at(i: int) -> dict:
            return {**current, "bucket_size": self.sizes[i]}

        def measured() -> list[int]:
            return [i for i in range(len(self.sizes)) if self.mean(at(i)) is not None]

        # 3. coarse bracket over the log-spaced sizes
        n = len(self.sizes)
        k = min(n, self.coarse)
        coarse = sorted({round(j * (n - 1) / (k - 1)) for j in range(k)} if k > 1 else {0})
        for i in coarse:
            if self.mean(at(i)) is None:
                yield at(i)
        # 4. refine around the best: halve the gaps beside it until its neighbours are known
        while True:
            done = measured()
            b = min(done, key=lambda i: (self.mean(at(i)), i))
            left = max((i for i in done if i < b), default=None)
            right = min((i for i in done if i > b), default=None)
            gaps = []
            if left is not None and b - left > 1:
                gaps.append((b - left, (left + b) // 2))
            elif left is None and b > 0:
                gaps.append((b, b // 2))
            if right is not None and right - b > 1:
                gaps.append((right - b, (b + right + 1) // 2))
            elif right is None and b < n - 1:
                gaps.append((n - 1 - b, (b + n) // 2))
            if not gaps:
                break
            yield at(max(gaps)[1])
        # 5. the final: the best few and the start, measured again in the order A B C C B A
        ranked = sorted(self._scores, key=lambda k: sum(self._scores[k]) / len(self._scores[k]))
        top = [self._configs[k] for k in ranked[:self.confirm]]
        if all(_key(c) != _key(self.start) for c in top):
            top = [*top[:max(1, self.confirm - 1)], self.start]
        if len(top) < 2:
            return
        self._final = {}
        for c in top + top[::-1]:  # noqa: UP028 (the plan receives each score through send())
            yield c
