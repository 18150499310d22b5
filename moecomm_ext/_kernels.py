"""The kernels without argument checks (callers have checked): the native module for the
tensors' device type where it is loaded and wanted, else the pure-torch reference."""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from ._loader import module_for

__all__ = ["opmath", "run_gather_rows", "run_gather_reduce_rows", "run_gather_rowdot"]


def opmath(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``t`` in the dtype the kernels compute in for ``dtype`` inputs (float32, or float64)."""
    if t is None:
        return None
    return t.to(reference.opmath_dtype(dtype)).contiguous()


def native_result(fn: str, result, index: Tensor, upper: int) -> Tensor:
    """The CPU kernels return ``(out, bad)`` instead of throwing from their
    parallel loops (bad = flat position of an out-of-range entry, or -1)."""
    if not isinstance(result, tuple):
        return result  # CUDA kernels trap on a bad entry instead
    out, bad = result
    if bad >= 0:
        value = int(index.reshape(-1)[bad])
        raise IndexError(
            f"{fn}: argument 'index' entry {bad} (flat position) = {value} is out of range [-1, {upper})"
        )
    return out


def run_gather_rows(x: Tensor, index: Tensor, scale: Tensor | None, use_native: bool | None) -> Tensor:
    mod = module_for(x.device.type, use_native)
    if mod is None:
        return reference.gather_rows(x, index, scale)
    index = index.contiguous()
    res = mod.gather_rows(x.contiguous(), index, opmath(scale, x.dtype))
    return native_result("gather_rows", res, index, x.shape[0])


def run_gather_reduce_rows(y: Tensor, index: Tensor, weight: Tensor | None, use_native: bool | None) -> Tensor:
    mod = module_for(y.device.type, use_native)
    if mod is None:
        return reference.gather_reduce_rows(y, index, weight)
    index = index.contiguous()
    res = mod.gather_reduce_rows(y.contiguous(), index, opmath(weight, y.dtype))
    return native_result("gather_reduce_rows", res, index, y.shape[0])


def run_gather_rowdot(a: Tensor, b: Tensor, index: Tensor, use_native: bool | None) -> Tensor:
    mod = module_for(a.device.type, use_native)
    if mod is None:
        return reference.gather_rowdot(a, b, index)
    index = index.contiguous()
    res = mod.gather_rowdot(a.contiguous(), b.contiguous(), index)
    return native_result("gather_rowdot", res, index, b.shape[0])
