"""Deterministic test data every rank can rebuild, and numpy references for the exchanges."""

from __future__ import annotations

import math

import numpy as np
import torch

FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int32,
          torch.int64, torch.uint8, torch.bool, torch.complex64] + FLOAT8
ROW_SHAPES = [(), (1,), (3,), (2, 3), (0,), (5, 1)]


def count_matrix(seed: int, size: int, max_rows: int, zero_fraction: float) -> np.ndarray:
    """``m[src, dst]``: rows rank ``src`` sends to rank ``dst``, with a share of zeros."""
    rng = np.random.default_rng([seed, 7])
    m = rng.integers(0, max_rows + 1, size=(size, size))
    m[rng.random((size, size)) < zero_fraction] = 0
    return m


def rows_bytes(seed: int, src: int, dst: int, n: int, row_shape: tuple, dtype: torch.dtype) -> np.ndarray:
    """The raw bytes of the ``n`` rows ``src`` sends to ``dst`` (random bits; 0/1 for bool)."""
    rng = np.random.default_rng([seed, src, dst])
    elems = n * math.prod(row_shape)
    esize = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool:
        return rng.integers(0, 2, size=elems, dtype=np.uint8)
    return rng.integers(0, 256, size=elems * esize, dtype=np.uint8)


def rows_tensor(seed: int, src: int, dst: int, n: int, row_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    raw = rows_bytes(seed, src, dst, n, row_shape, dtype)
    if raw.size == 0:
        return torch.empty((n,) + tuple(row_shape), dtype=dtype)
    return torch.from_numpy(raw.copy()).view(dtype).reshape((n,) + tuple(row_shape))


def input_for(seed: int, rank: int, m: np.ndarray, row_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    parts = [rows_tensor(seed, rank, dst, int(m[rank, dst]), row_shape, dtype) for dst in range(m.shape[0])]
    return torch.cat(parts) if parts else torch.empty((0,) + tuple(row_shape), dtype=dtype)


def expected_bytes(seed: int, rank: int, m: np.ndarray, row_shape: tuple, dtype: torch.dtype) -> np.ndarray:
    """numpy reference: the bytes rank ``rank`` must hold after the all-to-all."""
    parts = [rows_bytes(seed, src, rank, int(m[src, rank]), row_shape, dtype) for src in range(m.shape[0])]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
