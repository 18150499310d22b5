"""Block layout changes between the phases of the hierarchical all-to-all.

A buffer here is ``[rows, *row_shape]`` made of consecutive *blocks* of rows. The
hierarchical all-to-all needs two kinds of reordering, both done by the ``moecomm_ext``
kernels (native where built, else their torch references; rows move bit for bit, any dtype):

* :func:`permute_blocks` -- an ``A x B`` grid of blocks stored a-major (block ``(a, b)``
  at position ``a * B + b``) rewritten b-major (at ``b * A + a``), or back with
  ``inverse``.
* :func:`reorder_blocks` -- any block order (for node layouts whose ranks are not
  numbered node by node).

Up to :data:`_CAT_MAX_BLOCKS` blocks both are one ``torch.cat`` of block views (one copy
kernel, no index to build); with more blocks, one ``moecomm_ext.gather_rows`` whose row
index is built on the device from the host-known block table (the counts here are host ints
already checked, so nothing is validated again and the host never waits).

Both return ``x`` itself when the order does not change, and never build an autograd
graph (the hierarchical all-to-all has its own backward).
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Sequence

import numpy as np
import torch

import moecomm_ext

from ..engine.device_tables import int64_table

__all__ = ["permute_blocks", "reorder_blocks", "block_order_index"]


def block_order_index(counts: Sequence[int], order: Sequence[int]) -> np.ndarray:
    """Row index (int64) that lays the blocks out in ``order``.

    ``counts[k]`` is the row count of input block ``k`` (blocks stored in ``k`` order);
    output block ``i`` is input block ``order[i]``.
    """
    shift, picked = _block_shifts(counts, order)
    total = int(picked.sum())
    return np.repeat(shift, picked) + np.arange(total, dtype=np.int64)


def _block_shifts(counts: Sequence[int], order: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per output block: (input start - output start, row count)."""
    c = np.asarray(counts, dtype=np.int64)
    o = np.asarray(order, dtype=np.int64)
    starts = np.cumsum(c) - c
    picked = c[o]
    out_starts = np.cumsum(picked) - picked
    return starts[o] - out_starts, picked


def _device_index(counts: Sequence[int], order: Sequence[int], device: torch.device) -> torch.Tensor:
    """:func:`block_order_index` built on ``device`` from the small block table: one copy of
    ``2 * len(order)`` ints to the device, no host synchronisation, no per-row host work."""
    shift, picked = _block_shifts(counts, order)
    if (picked < 0).any():  # repeat_interleave(output_size=total) would write past its output
        raise ValueError(f"block counts must be >= 0, got {list(counts)}")
    total = int(picked.sum())
    table = int64_table(np.concatenate([shift, picked]), device)
    k = len(order)
    rows = torch.arange(total, dtype=torch.int64, device=device)
    return rows + torch.repeat_interleave(table[:k], table[k:], output_size=total)


def permute_blocks(x: torch.Tensor, counts: Sequence[Sequence[int]], inverse: bool = False) -> torch.Tensor:
    """Reorder the ``A x B`` blocks of ``x`` from a-major to b-major (``inverse``: back).

    ``counts[a][b]`` is the row count of block ``(a, b)`` (in either order).
    """
    A = len(counts)
    B = len(counts[0]) if A else 0
    if A <= 1 or B <= 1:
        return x
    if not inverse:  # input a-major; output position b * A + a takes input block a * B + b
        stored = [counts[a][b] for a in range(A) for b in range(B)]
        order = [a * B + b for b in range(B) for a in range(A)]
    else:  # input b-major; output position a * B + b takes input block b * A + a
        stored = [counts[a][b] for b in range(B) for a in range(A)]
        order = [b * A + a for a in range(A) for b in range(B)]
    return reorder_blocks(x, stored, order)


_CAT_MAX_BLOCKS = 64
"""Up to this many blocks a reorder is one ``torch.cat`` of block views; above, one
``moecomm_ext.gather_rows`` with a row index built on the device (where a cat's per-block
host work exceeds building the index: ``bench/layout_copies.py``)."""


def reorder_blocks(x: torch.Tensor, counts: Sequence[int], order: Sequence[int]) -> torch.Tensor:
    """Output block ``i`` is input block ``order[i]`` (``counts`` in input block order)."""
    if list(order) == list(range(len(order))):
        return x
    if len(order) <= _CAT_MAX_BLOCKS:
        # One copy kernel and no index: building one costs more host time a call than the
        # copy of several MiB takes on a GPU (bench/layout_copies.py).
        starts = [0, *accumulate(counts)]
        with torch.no_grad():
            return torch.cat([x[starts[k]:starts[k + 1]] for k in order])
    index = _device_index(counts, order, x.device)
    rows, row_shape = x.shape[0], tuple(x.shape[1:])
    with torch.no_grad():
        out = moecomm_ext.gather_rows(x.reshape(rows, math.prod(row_shape)), index, check=False)
    return out.reshape((index.shape[0],) + row_shape)
