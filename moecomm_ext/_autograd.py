"""The differentiable MoE dispatch and combine: autograd Functions whose forward and
backward passes are all gathers (no atomics), given both slot maps."""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_ndim, floating, index_arg, same_device, shape_is, shape_str, tensor_arg
from ._kernels import opmath, run_gather_reduce_rows, run_gather_rowdot, run_gather_rows
from ._slots import check_slot_pair

__all__ = ["dispatch", "dispatch_backward", "combine"]


class _Dispatch(torch.autograd.Function):
    """Forward a gather of token rows into slots; backward a gather-reduce over each token's
    slots (``grad_x``) and row dot products (``grad_scale``)."""

    @staticmethod
    def forward(ctx, x, slot_token, token_slots, slot_scale, use_native):  # type: ignore[override]
        ctx.use_native = use_native
        ctx.save_for_backward(x, slot_token, token_slots, slot_scale)
        return run_gather_rows(x, slot_token, slot_scale, use_native)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        x, slot_token, token_slots, slot_scale = ctx.saved_tensors
        grad_x, grad_scale = dispatch_backward(grad_out, x, slot_token, token_slots, slot_scale,
                                               need_x=ctx.needs_input_grad[0], need_scale=ctx.needs_input_grad[3],
                                               use_native=ctx.use_native)
        return grad_x, None, None, grad_scale, None


def dispatch_backward(
    grad: Tensor,
    x: Tensor,
    slot_token: Tensor,
    token_slots: Tensor,
    slot_scale: Tensor | None = None,
    *,
    need_x: bool = True,
    need_scale: bool = True,
    use_native: bool | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """The backward of :func:`dispatch`, for callers that fuse its forward gather with
    something else (``moecomm.quant.gather_pack_rows``: the gather and the FP8 packing in one
    pass) and so cannot use its autograd. No validation (the arguments of :func:`dispatch`,
    already checked, and ``grad`` ``[M, D]`` of ``x``'s dtype).

    Returns:
        ``(grad_x, grad_scale)``: ``grad_x[t] = sum_j slot_scale[token_slots[t, j]] *
        grad[token_slots[t, j]]`` (``[T, D]``, None unless ``need_x``); ``grad_scale[m] =
        dot(grad[m], x[slot_token[m]])`` in ``slot_scale.dtype`` (``[M]``, None unless
        ``need_scale`` and ``slot_scale`` is given). The same bits as :func:`dispatch`'s.
    """
    grad = grad.contiguous()
    T, K = token_slots.shape
    grad_x = grad_scale = None
    if need_x:
        token_scale = None
        if slot_scale is not None:
            # weight of copy (t, j) = scale of the slot it went to
            token_scale = run_gather_rows(
                opmath(slot_scale, x.dtype).unsqueeze(1), token_slots.reshape(-1), None, use_native
            ).reshape(T, K)
        grad_x = run_gather_reduce_rows(grad, token_slots, token_scale, use_native)
    if slot_scale is not None and need_scale:
        g = run_gather_rowdot(grad, x.contiguous(), slot_token.unsqueeze(1), use_native)
        grad_scale = g.reshape(-1).to(slot_scale.dtype)
    return grad_x, grad_scale


class _Combine(torch.autograd.Function):
    """Forward a weighted gather-reduce of slot rows into tokens; backward a scaled gather of
    the token gradients into slots (``grad_y``) and row dot products (``grad_w``)."""

    @staticmethod
    def forward(ctx, y, token_slots, token_weight, slot_token, use_native, slot_route=None):  # type: ignore[override]
        ctx.use_native = use_native
        ctx.save_for_backward(y, token_slots, token_weight, slot_token, slot_route)
        return run_gather_reduce_rows(y, token_slots, token_weight, use_native)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        y, token_slots, token_weight, slot_token, slot_route = ctx.saved_tensors
        use_native = ctx.use_native
        grad_out = grad_out.contiguous()
        M = slot_token.shape[0]
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            slot_weight = None
            if token_weight is not None and slot_route is not None:
                # weight of slot m = the flat token_weight entry of its route (0 for an empty slot)
                flat_w = opmath(token_weight, y.dtype).reshape(-1, 1)
                slot_weight = run_gather_rows(flat_w, slot_route, None, use_native).reshape(M)
            elif token_weight is not None:
                # weight of slot m = token_weight[t, j] for the (t, j) with
                # token_slots[t, j] == m and t = slot_token[m]: gather the
                # token's K slots and weights, keep the matching column.
                rows = run_gather_rows(token_slots, slot_token, None, use_native)  # [M, K]
                wts = run_gather_rows(opmath(token_weight, y.dtype), slot_token, None, use_native)
                mine = rows == torch.arange(M, device=rows.device).unsqueeze(1)
                slot_weight = (wts * mine).sum(dim=1)
            grad_y = run_gather_rows(grad_out, slot_token, slot_weight, use_native)
        if token_weight is not None and ctx.needs_input_grad[2]:
            grad_w = run_gather_rowdot(grad_out, y.contiguous(), token_slots, use_native).to(token_weight.dtype)
        return grad_y, None, grad_w, None, None, None


def dispatch(
    x: Tensor,
    slot_token: Tensor,
    token_slots: Tensor,
    slot_scale: Tensor | None = None,
    *,
    check: bool = True,
    use_native: bool | None = None,
) -> Tensor:
    """MoE dispatch (differentiable): copy each token to its expert slots.

    ``out[m] = x[slot_token[m]] * slot_scale[m]`` and a zero row where
    ``slot_token[m] == -1`` (forward = :func:`gather_rows`).

    Args:
        x: ``[T, D]`` float16, bfloat16, float32 or float64 token rows.
        slot_token: ``[M]`` int64 slot -> token map, entries in ``[-1, T)``.
        token_slots: ``[T, K]`` int64 token -> slot map, entries in ``[-1, M)``;
            the inverse of ``slot_token`` (see :func:`invert_slots`).  Used by
            the backward pass, which is then a gather-reduce (no atomics):
            ``grad_x[t] = sum_j slot_scale[token_slots[t, j]] * grad[token_slots[t, j]]``.
        slot_scale: ``[M]`` floating per-slot factors, or None.  Its gradient is
            ``grad_scale[m] = dot(grad[m], x[slot_token[m]])`` (gather_rowdot),
            returned in ``slot_scale.dtype``.
        check: verify index ranges and that the two maps are inverse (host
            sync on CUDA).  Inconsistent maps give wrong gradients.
        use_native: as in :func:`gather_rows`.

    Returns:
        ``[M, D]`` tensor of ``x.dtype``.

    Raises:
        TypeError: an argument is not a tensor, a map is not int64, or ``x`` / ``slot_scale``
            is not floating.
        ValueError: a wrong number of dimensions or shape, tensors on different devices, or
            (``check``) an entry out of range or maps that are not inverse of each other.
    """
    fn = "dispatch"
    x = tensor_arg(fn, "x", x, "shape [T, D]")
    check_ndim(fn, "x", x, 2, "[T, D]")
    floating(fn, "x", x, "dispatch")
    slot_token = index_arg(fn, "slot_token", slot_token, 1, "[M]")
    token_slots = index_arg(fn, "token_slots", token_slots, 2, "[T, K]")
    if token_slots.shape[0] != x.shape[0]:
        raise ValueError(
            f"{fn}: argument 'token_slots' must have shape [T, K] with T = x.shape[0] = {x.shape[0]}; "
            f"got shape {shape_str(token_slots)}"
        )
    if slot_scale is not None:
        slot_scale = tensor_arg(fn, "slot_scale", slot_scale, "floating of shape [M]")
        floating(fn, "slot_scale", slot_scale, "per-slot scale factors")
        shape_is(fn, "slot_scale", slot_scale, (slot_token.shape[0],), "[M] (M = len(slot_token))")
    same_device(fn, "x", x, slot_token=slot_token, token_slots=token_slots, slot_scale=slot_scale)
    if check:
        check_slot_pair(fn, slot_token, token_slots)
    return _Dispatch.apply(x, slot_token.contiguous(), token_slots.contiguous(), slot_scale, use_native)


def combine(
    y: Tensor,
    token_slots: Tensor,
    token_weight: Tensor | None,
    slot_token: Tensor,
    *,
    check: bool = True,
    use_native: bool | None = None,
    slot_route: Tensor | None = None,
) -> Tensor:
    """MoE combine (differentiable): weighted sum of each token's expert outputs.

    ``out[t] = sum_j token_weight[t, j] * y[token_slots[t, j]]`` over entries
    ``!= -1`` (forward = :func:`gather_reduce_rows`).

    Args:
        y: ``[M, D]`` float16, bfloat16, float32 or float64 expert outputs.
        token_slots: ``[T, K]`` int64 token -> slot map, entries in ``[-1, M)``.
        token_weight: ``[T, K]`` floating gate weights, or None (all ones).
            Its gradient ``grad_w[t, j] = dot(grad[t], y[token_slots[t, j]])``
            (gather_rowdot) is returned in ``token_weight.dtype``.
        slot_token: ``[M]`` int64 slot -> token map, the inverse of
            ``token_slots``; the backward w.r.t. ``y`` is
            ``gather_rows(grad, slot_token, scale=weight of the slot)``.
        check: verify index ranges and that the two maps are inverse.
        use_native: as in :func:`gather_rows`.
        slot_route: ``[M]`` int64 flat index ``t * K + j`` of the route each slot holds
            (``-1``: empty), if at hand: the backward then gathers each slot's weight with
            it (one gather) instead of finding it among the token's ``K`` slots. The
            caller promises it matches the maps (not checked).

    Returns:
        ``[T, D]`` tensor of ``y.dtype`` (accumulated in float32, or float64).

    Raises:
        TypeError, ValueError: as :func:`dispatch` (for ``y``, ``token_weight`` and the maps).
    """
    fn = "combine"
    y = tensor_arg(fn, "y", y, "shape [M, D]")
    check_ndim(fn, "y", y, 2, "[M, D]")
    floating(fn, "y", y, "combine")
    token_slots = index_arg(fn, "token_slots", token_slots, 2, "[T, K]")
    slot_token = index_arg(fn, "slot_token", slot_token, 1, "[M]")
    if slot_token.shape[0] != y.shape[0]:
        raise ValueError(
            f"{fn}: argument 'slot_token' must have shape [M] with M = y.shape[0] = {y.shape[0]}; "
            f"got shape {shape_str(slot_token)}"
        )
    if token_weight is not None:
        token_weight = tensor_arg(fn, "token_weight", token_weight, "floating of shape [T, K]")
        floating(fn, "token_weight", token_weight, "combine weights")
        shape_is(fn, "token_weight", token_weight, tuple(token_slots.shape), "[T, K] (= token_slots.shape)")
    same_device(fn, "y", y, token_slots=token_slots, token_weight=token_weight, slot_token=slot_token)
    if slot_route is not None:
        slot_route = index_arg(fn, "slot_route", slot_route, 1, "[M]")
        shape_is(fn, "slot_route", slot_route, (slot_token.shape[0],), "[M] (= slot_token.shape)")
        same_device(fn, "y", y, slot_route=slot_route)
        slot_route = slot_route.contiguous()
    if check:
        check_slot_pair(fn, slot_token, token_slots)
    return _Combine.apply(y, token_slots.contiguous(), token_weight, slot_token.contiguous(), use_native, slot_route)
