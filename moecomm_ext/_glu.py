"""Gated linear units in one pass (``csrc/glu.h``): the forward ``f(h[:, :H]) * h[:, H:]``
and its backward, which also gives the forward's output again (the experts' weight gradient
needs it, and recomputing it there costs no extra pass over ``h``)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import reference
from ._loader import module_for

__all__ = ["GLU_CODES", "glu_forward", "glu_backward"]

GLU_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
"""The gate functions the kernels know, by name, with their codes in ``csrc/glu.h``."""

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(name: str, h: Tensor, act: str, grad: Optional[Tensor] = None) -> None:
    if not isinstance(h, Tensor) or h.dim() != 2 or h.shape[1] % 2:
        got = tuple(h.shape) if isinstance(h, Tensor) else type(h).__name__
        raise ValueError(f"{name}: argument 'h' must be a [N, 2H] tensor, got {got}")
    if h.dtype not in _DTYPES:
        raise TypeError(f"{name}: argument 'h' must be float16, bfloat16, float32 or float64, got {h.dtype}")
    if act not in GLU_CODES:
        raise ValueError(f"{name}: argument 'act' must be one of {sorted(GLU_CODES)}, got {act!r}")
    if grad is not None:
        want = (h.shape[0], h.shape[1] // 2)
        if not isinstance(grad, Tensor) or tuple(grad.shape) != want or grad.dtype != h.dtype \
                or grad.device != h.device:
            got = (tuple(grad.shape), grad.dtype, grad.device) if isinstance(grad, Tensor) else type(grad).__name__
            raise ValueError(f"{name}: argument 'grad' must be {list(want)} {h.dtype} on {h.device}, got {got}")


def glu_module(device: torch.device, use_native: Optional[bool] = None):
    """The native module whose ``glu_forward(h, code)`` / ``glu_backward(grad, h, code,
    need_out)`` run on ``device`` (contiguous inputs), or None (then the reference)."""
    mod = module_for(device.type, use_native)
    return mod if mod is not None and hasattr(mod, "glu_forward") else None


def glu_forward(h: Tensor, act: str = "silu", *, use_native: Optional[bool] = None) -> Tensor:
    """``[N, H]``: ``f(h[:, :H]) * h[:, H:]`` for the pre-activation ``h`` ``[N, 2H]`` (the
    gate's projection first), ``f`` named by ``act`` (a key of :data:`GLU_CODES`); float32
    arithmetic (float64 for float64), rounded once. Not differentiable (no autograd graph).

    Raises:
        ValueError: ``h`` is not ``[N, 2H]``, or ``act`` is unknown. TypeError: ``h``'s dtype.
    """
    _check("glu_forward", h, act)
    mod = glu_module(h.device, use_native)
    if mod is None:
        return reference.glu_forward(h.detach(), act)
    return mod.glu_forward(h.detach().contiguous(), GLU_CODES[act])


def glu_backward(grad: Tensor, h: Tensor, act: str = "silu", *, need_out: bool = True,
                 use_native: Optional[bool] = None) -> tuple[Tensor, Optional[Tensor]]:
    """``(grad_h [N, 2H], out [N, H] or None)``: the gradient of :func:`glu_forward` with
    respect to ``h`` for the output's gradient ``grad`` ``[N, H]``, and (``need_out``) the
    forward's output, from the same pass.

    Raises:
        ValueError: shapes, devices or ``act`` as in :func:`glu_forward`; ``grad`` not
        ``[N, H]`` of ``h``'s dtype and device.
    """
    _check("glu_backward", h, act, grad)
    mod = glu_module(h.device, use_native)
    if mod is None:
        return reference.glu_backward(grad.detach(), h.detach(), act, need_out)
    res = mod.glu_backward(grad.detach().contiguous(), h.detach().contiguous(), GLU_CODES[act], bool(need_out))
    return res[0], (res[1] if need_out else None)
