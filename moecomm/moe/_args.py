"""Argument checks shared by the MoE layer's modules."""

from __future__ import annotations

from typing import Any, Optional


def int_arg(name: str, value: Any, lo: int, hi: Optional[int] = None, what: str = "") -> int:
    """``value`` as an int in ``[lo, hi]``; TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}{what}, got {value}")
    return value
