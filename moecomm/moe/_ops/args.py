"""Argument checks shared by the MoE layer's modules."""

from __future__ import annotations

import math
from typing import Any, Optional


def int_arg(name: str, value: Any, lo: int, hi: Optional[int] = None, what: str = "") -> int:
    """``value`` as an int in ``[lo, hi]``; TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}{what}, got {value}")
    return value


def float_arg(name: str, value: Any) -> float:
    """``value`` as a finite float; TypeError (not a number) or ValueError (inf, nan) naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value
