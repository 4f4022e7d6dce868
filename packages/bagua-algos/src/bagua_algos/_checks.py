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
