"""The router's choice of experts and their gates in one native pass per token (``csrc/select.h``),
as an autograd Function: :func:`select_experts` (the logits' gradient from the gates' in one
more pass). The reference is :func:`moecomm_ext.reference.select_experts` (torch operations),
which callers run where this returns None."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._loader import module_for

__all__ = ["SELECT_SCORES", "select_experts"]

SELECT_SCORES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
"""The score functions the kernels compute (softmax only before the top-k), with their codes."""

_MAX_K, _MAX_GROUPS = 32, 64


class _Select(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, mod, k, code, normalize, scale, groups, group_topk):  # type: ignore[override]
        gates, idx = mod.select_experts(logits, bias, k, code, normalize, scale, groups, group_topk)
        ctx.mod, ctx.code, ctx.normalize, ctx.scale = mod, code, normalize, scale
        ctx.save_for_backward(logits, idx)
        ctx.mark_non_differentiable(idx)
        return gates, idx

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_gates, _grad_idx):  # type: ignore[override]
        logits, idx = ctx.saved_tensors
        if grad_gates is None:
            return (None,) * 9
        grad = ctx.mod.select_experts_backward(grad_gates.contiguous(), logits, idx, ctx.code, ctx.normalize,
                                               ctx.scale)
        return (grad,) + (None,) * 8


def select_experts(logits: Tensor, k: int, score_function: str, pre_softmax: bool, normalize: bool,
                   scaling_factor: Optional[float], num_groups: Optional[int], group_topk: Optional[int],
                   expert_bias: Optional[Tensor], use_native: Optional[bool] = None) -> Optional[tuple[Tensor, Tensor]]:
    """``(gates [T, k], topk_idx [T, k] int64)`` as ``moecomm.moe.scoring.select_experts`` gives
    them (gates differentiable to ``logits``), from the native kernels; None where they do not
    cover the call (softmax after the top-k, k > 32, more than 64 groups, a dtype other than
    float32/float64, a device without the kernels): the caller then runs the torch operations.
    Ties between equal scores go to the lower expert index; NaN ranks above every value, as in
    ``torch.topk``."""
    code = SELECT_SCORES.get(score_function)
    if code is None or (code == 0 and not pre_softmax) or logits.dim() != 2 or logits.dtype not in (
            torch.float32, torch.float64) or not 1 <= k <= min(_MAX_K, logits.shape[1]):
        return None
    groups = num_groups if num_groups is not None and num_groups > 1 else 0
    if groups:
        E = logits.shape[1]
        # (fewer routes than groups kept, or more than their experts: torch's tie order decides)
        if (groups > _MAX_GROUPS or group_topk is None or E % groups
                or not group_topk <= k <= group_topk * (E // groups)):
            return None
    if expert_bias is not None and (expert_bias.dim() != 1 or expert_bias.numel() != logits.shape[1]):
        return None  # (a broadcastable bias of another shape: the torch operations take it)
    mod = module_for(logits.device.type, use_native)
    if mod is None or not hasattr(mod, "select_experts"):
        return None
    bias = None if expert_bias is None else expert_bias.detach().to(logits.device, logits.dtype).contiguous()
    scale = 1.0 if scaling_factor is None else float(scaling_factor)
    return _Select.apply(logits.contiguous(), bias, mod, int(k), code, bool(normalize), scale, groups,
                         int(group_topk or 0))
