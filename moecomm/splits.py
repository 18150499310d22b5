"""Validation of split sizes: how many rows go to (or come from) each rank."""

from __future__ import annotations

import numbers
from typing import Optional, Sequence, Union

import numpy as np
import torch

__all__ = ["Splits", "normalize_splits", "check_split_total", "check_own_block", "split_offsets", "split_sizes"]

Splits = Union[Sequence[int], torch.Tensor, np.ndarray]
"""Per-rank row counts: a sequence of ints, or a 1-D integer tensor or array (any device)."""


def normalize_splits(splits: Splits, name: str, size: int) -> list[int]:
    """Return ``splits`` as a list of ``size`` non-negative Python ints.

    Raises:
        TypeError: ``splits`` is not a sequence of ints or a 1-D integer tensor/array.
        ValueError: wrong length or a negative entry; the message names ``name``.
    """
    if type(splits) is list or type(splits) is tuple:  # the common case, checked cheaply
        if len(splits) == size and all(type(v) is int and v >= 0 for v in splits):
            return list(splits)
    if isinstance(splits, torch.Tensor):
        if splits.device.type == "meta":
            raise ValueError(f"{name} is a tensor on the meta device, which holds no counts: pass counts on the "
                             f"CPU or the communicator's device")
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got dtype {splits.dtype}")
        if splits.dim() != 1:
            raise ValueError(f"{name} must be 1-D with {size} entries, got shape {tuple(splits.shape)}")
        values = splits.tolist()
    elif isinstance(splits, np.ndarray):
        if not np.issubdtype(splits.dtype, np.integer):
            raise TypeError(f"{name} must be an integer array, got dtype {splits.dtype}")
        if splits.ndim != 1:
            raise ValueError(f"{name} must be 1-D with {size} entries, got shape {splits.shape}")
        values = splits.tolist()
    elif isinstance(splits, (str, bytes)) or not isinstance(splits, Sequence):
        raise TypeError(
            f"{name} must be a sequence of ints or a 1-D integer tensor, got {type(splits).__name__}"
        )
    else:
        values = list(splits)
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{name}[{i}] must be an int, got {v!r} ({type(v).__name__})")
        values = [int(v) for v in values]
    if len(values) != size:
        raise ValueError(f"{name} must have one entry per rank ({size}), got {len(values)}: {values}")
    for i, v in enumerate(values):
        if v < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {v}")
    return values


def check_split_total(splits: list[int], rows: int, name: str, tensor_name: str) -> None:
    """Raise ValueError unless ``sum(splits) == rows``."""
    total = sum(splits)
    if total != rows:
        raise ValueError(
            f"{name} must sum to the {rows} rows of {tensor_name} (dim 0), but sums to {total}: {splits}"
        )


def check_own_block(send: list[int], recv: list[int], rank: int) -> None:
    """Raise ValueError unless ``send[rank] == recv[rank]``: both count the rows a rank sends itself."""
    if send[rank] != recv[rank]:
        raise ValueError(f"send_splits[{rank}] ({send[rank]}) and recv_splits[{rank}] ({recv[rank]}) must be "
                         f"equal: both count the rows rank {rank} sends itself")


def split_offsets(splits: list[int]) -> list[int]:
    """Exclusive prefix sums: the first row of each rank's block."""
    offsets = [0] * len(splits)
    running = 0
    for i, v in enumerate(splits):
        offsets[i] = running
        running += v
    return offsets


def split_sizes(splits: Optional[Splits], rows: int, size: int, name: str, tensor_name: str) -> list[int]:
    """torch.distributed's split sizes: ``splits`` normalized and checked against ``rows``, or
    for None ``size`` equal blocks.

    Raises:
        TypeError, ValueError: as :func:`normalize_splits`; a total other than ``rows``, or for
            None ``rows`` not divisible by ``size``; naming ``name`` and ``tensor_name``.
    """
    if splits is None:
        if rows % size:
            raise ValueError(
                f"{name} is None, so {tensor_name} must split into {size} equal blocks, "
                f"but its dim 0 is {rows}"
            )
        return [rows // size] * size
    values = normalize_splits(splits, name, size)
    check_split_total(values, rows, name, tensor_name)
    return values
