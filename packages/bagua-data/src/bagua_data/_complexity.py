"""Per-sample complexities, computed once per sampler.

A complexity is any finite real number that grows with a sample's cost (its length in tokens
or frames, say).  It comes either from a callable applied to every ``dataset[i]`` once, or from
a precomputed sequence (a lengths column, a numpy array, a tensor) so that a large dataset
needs no pass through ``__getitem__``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

ComplexitySource = Callable[[Any], float] | Sequence[float] | torch.Tensor


def compute_complexities(dataset: Any, complexity_fn: ComplexitySource,
                         name: str = "complexity_fn") -> torch.Tensor:
    """Return a float64 tensor of ``len(dataset)`` finite complexities.

    ``complexity_fn`` is either called as ``complexity_fn(dataset[i])`` for every ``i``, or is
    a sequence of numbers with one entry per sample.  ``name`` is the argument's name in the
    caller, for error messages.
    """
    try:
        n = len(dataset)
    except TypeError as err:
        raise ValueError(f"dataset must have a length (a map-style Dataset); got "
                         f"{type(dataset).__name__} without __len__") from err
    if callable(complexity_fn):
        floats = []
        for i in range(n):
            value = complexity_fn(dataset[i])
            try:
                floats.append(float(value))
            except (TypeError, ValueError, RuntimeError) as err:
                raise ValueError(f"{name}(dataset[{i}]) must return a real number, got "
                                 f"{type(value).__name__} {value!r:.60}") from err
        values = torch.tensor(floats, dtype=torch.float64)
    else:
        values = _from_sequence(complexity_fn, n, name)
    bad = (~torch.isfinite(values)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"{name} must give finite numbers; sample {i} has {float(values[i])} "
                         f"({bad.numel()} non-finite in all)")
    return values


def _from_sequence(source: Any, n: int, name: str) -> torch.Tensor:
    if isinstance(source, (str, bytes)):
        raise ValueError(f"{name} must be a callable or a sequence of numbers, got a "
                         f"string")
    try:
        values = torch.as_tensor(source, dtype=torch.float64).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{name} must be a callable or a sequence of numbers (one per "
                         f"sample); could not read {type(source).__name__} as numbers: "
                         f"{err}") from err
    if values.dim() != 1 or values.numel() != n:
        raise ValueError(f"a precomputed {name} must be 1-D with one number per sample: "
                         f"len(dataset) is {n}, got shape {tuple(values.shape)}")
    # A private copy: later edits to the caller's array must not change the order.
    return values.clone()


def noise_scale(values: torch.Tensor, random_level: float) -> float:
    """The width of the uniform noise added to complexities before sorting."""
    if values.numel() == 0 or random_level == 0.0:
        return 0.0
    spread = float(values.max() - values.min())
    return random_level * spread if math.isfinite(spread) else 0.0
