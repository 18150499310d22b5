"""Pure-torch reference implementations of the moecomm_ext kernels.

These define the semantics that the native kernels must reproduce, run on any
device and dtype torch supports, and are differentiable through ordinary torch
autograd (the tests use that as an independent check of the hand-written
backward passes).  They do no argument validation: call them through the
public API, or with inputs that already satisfy its contracts.

Conventions shared with the native kernels:

* an index entry of ``-1`` means "no row": a zero row in :func:`gather_rows`,
  a skipped term in :func:`gather_reduce_rows`, a ``0`` in :func:`gather_rowdot`;
* arithmetic happens in the *opmath* dtype (:func:`opmath_dtype`): float32 for
  float16/bfloat16/float32 inputs, float64 for float64 inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "opmath_dtype",
    "gather_rows",
    "gather_reduce_rows",
    "gather_rowdot",
    "dispatch",
    "combine",
    "invert_slots",
    "slot_positions",
]


def opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64, float32 for every other dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _take_rows(src: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """``src[index]`` with ``-1`` entries pointing at row 0 (or an empty
    source), plus the validity mask.  Shape ``[*index.shape, *src.shape[1:]]``."""
    valid = index >= 0
    flat = index.reshape(-1)
    if src.shape[0] == 0:
        rows = src.new_zeros((flat.numel(), *src.shape[1:]))
    else:
        rows = src.index_select(0, flat.clamp(min=0))
    return rows.reshape(*index.shape, *src.shape[1:]), valid


def gather_rows(x: Tensor, index: Tensor, scale: Tensor | None = None) -> Tensor:
    """``out[i] = x[index[i]] * scale[i]`` (zero row where ``index[i] == -1``).

    x: ``[N, D]`` any dtype (floating when ``scale`` is given); index: ``[M]``
    int64; scale: ``[M]`` floating or None.  Returns ``[M, D]`` in ``x.dtype``.
    """
    rows, valid = _take_rows(x, index)
    mask = valid.unsqueeze(-1)
    if scale is None:
        return torch.where(mask, rows, torch.zeros((), dtype=x.dtype, device=x.device))
    op = opmath_dtype(x.dtype)
    out = rows.to(op) * scale.to(op).unsqueeze(-1)
    return torch.where(mask, out, torch.zeros((), dtype=op, device=x.device)).to(x.dtype)


def gather_reduce_rows(y: Tensor, index: Tensor, weight: Tensor | None = None) -> Tensor:
    """``out[t] = sum_j weight[t, j] * y[index[t, j]]`` over ``index[t, j] != -1``.

    y: ``[M, D]`` floating; index: ``[T, K]`` int64; weight: ``[T, K]`` floating
    or None (all ones).  Accumulates in opmath; returns ``[T, D]`` in ``y.dtype``.
    """
    op = opmath_dtype(y.dtype)
    rows, valid = _take_rows(y, index)  # [T, K, D]
    rows = torch.where(valid.unsqueeze(-1), rows.to(op), torch.zeros((), dtype=op, device=y.device))
    if weight is not None:
        rows = rows * weight.to(op).unsqueeze(-1)
    return rows.sum(dim=1).to(y.dtype)


def gather_rowdot(a: Tensor, b: Tensor, index: Tensor) -> Tensor:
    """``out[t, j] = dot(a[t], b[index[t, j]])`` (0 where ``index[t, j] == -1``).

    a: ``[T, D]``, b: ``[M, D]`` of one floating dtype; index: ``[T, K]`` int64.
    Returns ``[T, K]`` in opmath (float32, or float64 for float64 inputs).
    """
    op = opmath_dtype(a.dtype)
    rows, valid = _take_rows(b, index)  # [T, K, D]
    rows = torch.where(valid.unsqueeze(-1), rows.to(op), torch.zeros((), dtype=op, device=b.device))
    return torch.einsum("td,tkd->tk", a.to(op), rows)


def dispatch(
    x: Tensor, slot_token: Tensor, token_slots: Tensor, slot_scale: Tensor | None = None
) -> Tensor:
    """MoE dispatch: ``out[m] = x[slot_token[m]] * slot_scale[m]``; ``[M, D]``.
    ``token_slots`` is unused here (torch autograd needs no inverse map)."""
    del token_slots
    return gather_rows(x, slot_token, slot_scale)


def combine(
    y: Tensor, token_slots: Tensor, token_weight: Tensor | None, slot_token: Tensor
) -> Tensor:
    """MoE combine: ``out[t] = sum_j token_weight[t, j] * y[token_slots[t, j]]``;
    ``[T, D]``.  ``slot_token`` is unused here."""
    del slot_token
    return gather_reduce_rows(y, token_slots, token_weight)


def invert_slots(token_slots: Tensor, num_slots: int) -> Tensor:
    """slot -> token map (``-1`` for empty slots) of a ``[T, K]`` token -> slot map."""
    T, K = token_slots.shape
    out = torch.full((num_slots,), -1, dtype=torch.int64, device=token_slots.device)
    valid = token_slots >= 0
    tokens = torch.arange(T, device=token_slots.device).unsqueeze(1).expand(T, K)
    out[token_slots[valid]] = tokens[valid]
    return out


def slot_positions(token_slots: Tensor, num_slots: int) -> Tensor:
    """slot -> flat position ``t * K + j`` in ``token_slots`` (``-1`` if empty)."""
    out = torch.full((num_slots,), -1, dtype=torch.int64, device=token_slots.device)
    flat = token_slots.reshape(-1)
    valid = flat >= 0
    out[flat[valid]] = torch.arange(flat.numel(), device=token_slots.device)[valid]
    return out
