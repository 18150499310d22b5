"""Argument checks shared by the public ops: each raises ``TypeError``/``ValueError`` (or
``RuntimeError`` for a grad-requiring input of a non-differentiable op) with a message that
names the op and the argument, before any kernel runs."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "FLOAT_DTYPES", "shape_str", "tensor_arg", "check_ndim", "index_arg", "floating", "same_device", "shape_is",
    "in_range", "no_grad_inputs",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def shape_str(t: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def tensor_arg(fn: str, name: str, value: object, expect: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{fn}: argument '{name}' must be a torch.Tensor ({expect}); got {type(value).__name__}")
    return value


def check_ndim(fn: str, name: str, t: Tensor, ndim: int, expect: str) -> None:
    if t.dim() != ndim:
        raise ValueError(
            f"{fn}: argument '{name}' must be a {ndim}-D tensor of shape {expect}; got shape {shape_str(t)}"
        )


def index_arg(fn: str, name: str, value: object, ndim: int, expect: str) -> Tensor:
    t = tensor_arg(fn, name, value, f"int64 of shape {expect}")
    if t.dtype != torch.int64:
        raise TypeError(f"{fn}: argument '{name}' must have dtype torch.int64 (shape {expect}); got {t.dtype}")
    check_ndim(fn, name, t, ndim, expect)
    return t


def floating(fn: str, name: str, t: Tensor, expect: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{fn}: argument '{name}' must have a floating dtype (float16, bfloat16, float32 or "
            f"float64) for {expect}; got {t.dtype}"
        )


def same_device(fn: str, ref_name: str, ref: Tensor, **others: Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(
                f"{fn}: argument '{name}' must be on the same device as '{ref_name}' ({ref.device}); got {t.device}"
            )


def shape_is(fn: str, name: str, t: Tensor, shape: tuple[int, ...], expect: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{fn}: argument '{name}' must have shape {expect} = {list(shape)}; got shape {shape_str(t)}"
        )


def in_range(fn: str, name: str, index: Tensor, upper: int, what: str) -> None:
    """Host-side range check: every entry in [-1, upper)."""
    if index.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(index))
    if lo < -1 or hi >= upper:
        raise ValueError(
            f"{fn}: argument '{name}' has entries out of range [-1, {upper}) ({what} = {upper}): "
            f"min = {lo}, max = {hi}"
        )


def no_grad_inputs(fn: str, **tensors: Tensor | None) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise RuntimeError(
                f"{fn}: argument '{name}' requires grad but {fn} is not differentiable; use "
                f"moecomm_ext.dispatch / moecomm_ext.combine (autograd) or run under torch.no_grad()"
            )
