"""GEMMs of bfloat16 operands that accumulate and return float32 (``out_dtype=torch.float32``).

The linear gate's float32 logits from bfloat16 tokens and weights, without a float32 copy.

A float32 gate (``fp32_gate=True``) over bfloat16 tokens would copy the tokens to float32
(twice their size) and run a float32 GEMM on CUDA cores. Every bfloat16 value is exact in
float32 and so is every product of two, so a tensor-core GEMM of the bfloat16 operands that
accumulates and returns float32 (``torch.mm(..., out_dtype=torch.float32)``) computes the
same logits, up to the order of the sums. The backward splits the float32 logit gradient
``g`` into ``hi + lo`` (two bfloat16 parts, together within ``2**-16`` of ``g``) so that its
GEMMs run on bfloat16 operands too; the gradients are then rounded to bfloat16, the
parameters' and tokens' dtype, which is far coarser.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["wide_gemm_available", "wide_linear_applies", "wide_linear"]

_WIDE_GEMM_OK: dict = {}
"""Cache: device type -> whether ``torch.mm`` and ``torch.bmm`` take ``out_dtype=torch.float32``
for bfloat16 operands there (torch >= 2.8 on CUDA; not on the CPU)."""


def wide_gemm_available(device: torch.device) -> bool:
    ok = _WIDE_GEMM_OK.get(device.type)
    if ok is None:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            ok = (torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
                  and torch.bmm(a[None], a[None], out_dtype=torch.float32).dtype == torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _WIDE_GEMM_OK[device.type] = ok
    return ok


def wide_linear_applies(x: Tensor, w: Tensor) -> bool:
    """True where :func:`wide_linear` serves ``x @ w.T``: both bfloat16 on a GPU that has the GEMM."""
    return (x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.is_cuda and w.device == x.device
            and x.dim() == 2 and wide_gemm_available(x.device))


class _WideLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # type: ignore[override]
        x, w = ctx.saved_tensors
        g = g.contiguous()
        hi = g.to(x.dtype)
        parts = torch.cat([hi, (g - hi.float()).to(x.dtype)], dim=1)  # [T, 2E]: g = hi + lo
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = torch.mm(parts, torch.cat([w, w], dim=0))  # float32 sums, rounded once to x's dtype
        if ctx.needs_input_grad[1]:
            both = torch.mm(parts.t(), x, out_dtype=torch.float32)  # [2E, D]
            E = w.shape[0]
            gw = (both[:E] + both[E:]).to(w.dtype)
        return gx, gw


def wide_linear(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w.T`` as float32 ``[T, E]`` from bfloat16 ``x [T, D]`` and ``w [E, D]`` (differentiable)."""
    return _WideLinear.apply(x, w)
