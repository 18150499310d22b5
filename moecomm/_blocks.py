"""Block layout changes between the phases of the hierarchical all-to-all.

A buffer here is ``[rows, *row_shape]`` made of consecutive *blocks* of rows. The
hierarchical all-to-all needs two kinds of reordering, both done by the ``moecomm_ext``
kernels (native where built, else their torch references; rows move bit for bit, any dtype):

* :func:`permute_blocks` -- an ``A x B`` grid of blocks stored a-major (block ``(a, b)``
  at position ``a * B + b``) rewritten b-major (at ``b * A + a``), or back with
  ``inverse``: ``moecomm_ext.permute_blocks``.
* :func:`reorder_blocks` -- any block order (for node layouts whose ranks are not
  numbered node by node): one ``moecomm_ext.gather_rows`` with a precomputed row index.

Both return ``x`` itself when the order does not change, and never build an autograd
graph (the hierarchical all-to-all has its own backward).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

import moecomm_ext

__all__ = ["permute_blocks", "reorder_blocks", "block_order_index"]


def block_order_index(counts: Sequence[int], order: Sequence[int]) -> np.ndarray:
    """Row index (int64) that lays the blocks out in ``order``.

    ``counts[k]`` is the row count of input block ``k`` (blocks stored in ``k`` order);
    output block ``i`` is input block ``order[i]``.
    """
    c = np.asarray(counts, dtype=np.int64)
    o = np.asarray(order, dtype=np.int64)
    starts = np.cumsum(c) - c
    picked = c[o]
    out_starts = np.cumsum(picked) - picked
    total = int(picked.sum())
    return np.repeat(starts[o] - out_starts, picked) + np.arange(total, dtype=np.int64)


def permute_blocks(x: torch.Tensor, counts: Sequence[Sequence[int]], inverse: bool = False) -> torch.Tensor:
    """Reorder the ``A x B`` blocks of ``x`` from a-major to b-major (``inverse``: back).

    ``counts[a][b]`` is the row count of block ``(a, b)`` (in either order).
    """
    if len(counts) <= 1 or len(counts[0]) <= 1:
        return x
    with torch.no_grad():
        return moecomm_ext.permute_blocks(x, [list(r) for r in counts], inverse=inverse)


def reorder_blocks(x: torch.Tensor, counts: Sequence[int], order: Sequence[int]) -> torch.Tensor:
    """Output block ``i`` is input block ``order[i]`` (``counts`` in input block order)."""
    if list(order) == list(range(len(order))):
        return x
    index = torch.from_numpy(block_order_index(counts, order)).to(x.device, non_blocking=True)
    rows, row_shape = x.shape[0], tuple(x.shape[1:])
    with torch.no_grad():
        out = moecomm_ext.gather_rows(x.reshape(rows, math.prod(row_shape)), index, check=False)
    return out.reshape((index.shape[0],) + row_shape)
