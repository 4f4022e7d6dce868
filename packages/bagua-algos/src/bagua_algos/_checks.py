"""Argument checks shared by the algorithms' constructors (each names the argument and the rule)."""

from __future__ import annotations


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_int_at_least(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_interval(value) -> None:
    check_int_at_least("communication_interval", value, 1)


def check_bucket_size(bucket_size, name: str = "bucket_size") -> int:
    """``bucket_size`` (bytes) as an int, or ``ValueError`` naming the rule: the one check of
    ``with_bagua``, ``rebucket`` and the autotuner's cached choice."""
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
        raise ValueError(f"{name} must be a positive integer number of bytes (e.g. "
                         f"10 * 1024 * 1024 for 10 MiB), got {bucket_size!r}")
    return bucket_size
