"""The dtypes every collective moves, and the small codes ranks compare them by."""

from __future__ import annotations

import torch

__all__ = ["SUPPORTED_DTYPES", "DTYPE_CODES", "float8_dtypes"]


def float8_dtypes() -> tuple:
    """The FP8 dtypes this torch build has (they differ between torch versions)."""
    names = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    return tuple(getattr(torch, n) for n in names if hasattr(torch, n))


SUPPORTED_DTYPES: frozenset = frozenset(
    (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
     torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool) + float8_dtypes()
)
"""Dtypes every collective moves (as raw bytes, so bit for bit)."""

DTYPE_CODES = {dt: i for i, dt in enumerate(sorted(SUPPORTED_DTYPES, key=str))}
"""A code per supported dtype, the same in every process of one torch build."""
