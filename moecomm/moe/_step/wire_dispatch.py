"""The layer's FP8 dispatch, fused: the dispatch gather writes quantized, packed rows
(:func:`moecomm.quant.gather_pack_rows`: the gathered rows are never written out in the
activation dtype) and they travel as they are (:meth:`moecomm.Communicator.all_to_all_v_packed`;
on the pipelined paths ``Communicator.scatter_compute_gather(..., packed=)`` beside
:func:`stand_in`).

Exactly :func:`moecomm_ext.dispatch` followed by :func:`moecomm.functional.all_to_all_v` with
``wire_dtype``, bit for bit, forward and backward: the backward sends the gradient home by the
rule of ``grad_wire_dtype`` (straight-through: the quantization counts as the identity), then
runs the dispatch's backward (:func:`moecomm_ext.dispatch_backward`); the first part is
:func:`moecomm.functional.all_to_all_v_backward`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor

import moecomm_ext
from moecomm import quant
from moecomm.functional import all_to_all_v_backward
from moecomm.wire import WIRE_BLOCK

__all__ = ["pack", "exchange", "stand_in"]


class _PackedDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot_scale, packed, slot_token, token_slots, comm, send, recv, algorithm,  # type: ignore[override]
                wire_dtype, grad_wire_dtype, use_native):
        out, _ = comm.all_to_all_v_packed(packed, send, recv, row_shape=tuple(x.shape[1:]), dtype=x.dtype,
                                          wire_dtype=wire_dtype, algorithm=algorithm)
        ctx.save_for_backward(x, slot_token, token_slots, slot_scale)
        ctx.comm, ctx.send, ctx.recv, ctx.algorithm = comm, send, recv, algorithm
        ctx.grad_wire_dtype, ctx.use_native = grad_wire_dtype, use_native
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        x, slot_token, token_slots, slot_scale = ctx.saved_tensors
        grad_rows = all_to_all_v_backward(grad_out, ctx.send, ctx.recv, comm=ctx.comm, algorithm=ctx.algorithm,
                                          grad_wire_dtype=ctx.grad_wire_dtype)
        grad_x, grad_scale = moecomm_ext.dispatch_backward(
            grad_rows, x, slot_token, token_slots, slot_scale, need_x=ctx.needs_input_grad[0],
            need_scale=ctx.needs_input_grad[1], use_native=ctx.use_native)
        return grad_x, grad_scale, None, None, None, None, None, None, None, None, None, None


class _DispatchStandIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, slot_scale, slot_token, token_slots, use_native):  # type: ignore[override]
        ctx.save_for_backward(x, slot_token, token_slots, slot_scale)
        ctx.use_native = use_native
        row = tuple(x.shape[1:])
        return x.new_zeros((1,) + row).expand((slot_token.shape[0],) + row)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows):  # type: ignore[override]
        x, slot_token, token_slots, slot_scale = ctx.saved_tensors
        grad_x, grad_scale = moecomm_ext.dispatch_backward(
            grad_rows.contiguous(), x, slot_token, token_slots, slot_scale, need_x=ctx.needs_input_grad[0],
            need_scale=ctx.needs_input_grad[1], use_native=ctx.use_native)
        return grad_x, grad_scale, None, None, None


def stand_in(x: Tensor, slot_token: Tensor, token_slots: Tensor, slot_scale: Optional[Tensor],
             use_native: Optional[bool]) -> Tensor:
    """The dispatched rows as autograd sees them, for a pipelined FP8 dispatch whose rows travel
    packed by :func:`pack` (``scatter_compute_gather(..., packed=)``): ``[M, *row]`` zeros of
    stride 0 (no memory; never read), whose gradient goes through the dispatch's backward
    (:func:`moecomm_ext.dispatch_backward`) to ``x`` and ``slot_scale``."""
    return _DispatchStandIn.apply(x.contiguous(), slot_scale, slot_token.contiguous(), token_slots.contiguous(),
                                  use_native)


def pack(x: Tensor, slot_token: Tensor, slot_scale: Optional[Tensor], wire_dtype: torch.dtype,
         use_native: Optional[bool]) -> Tensor:
    """The fused dispatch gather: ``[M, packed_row_bytes(D)]`` uint8 rows of
    ``x[slot_token[m]] * slot_scale[m]`` quantized to ``wire_dtype`` (not differentiable: the
    gradient flows through :func:`exchange`)."""
    if x.dtype not in quant.INPUT_DTYPES:
        raise TypeError(f"input must be float32, bfloat16 or float16 to be sent with wire_dtype={wire_dtype}, "
                        f"got {x.dtype}")
    with torch.no_grad():
        return quant.gather_pack_rows(x.contiguous(), slot_token.contiguous(), wire_dtype, WIRE_BLOCK,
                                      scale=slot_scale, use_native=use_native)


def exchange(packed: Tensor, x: Tensor, slot_token: Tensor, token_slots: Tensor, slot_scale: Optional[Tensor],
             comm: Any, send_splits: Sequence[int], recv_splits: Sequence[int], algorithm: str,
             wire_dtype: torch.dtype, grad_wire_dtype: Optional[torch.dtype], use_native: Optional[bool]) -> Tensor:
    """The rows of ``packed`` (:func:`pack` of the same arguments) exchanged and dequantized:
    ``functional.all_to_all_v(moecomm_ext.dispatch(x, slot_token, token_slots, slot_scale),
    send_splits, recv_splits, wire_dtype=wire_dtype, grad_wire_dtype=grad_wire_dtype)`` without a
    second pass over the rows (differentiable in ``x`` and ``slot_scale``; both sides' counts
    known; the maps are the caller's promise, as with ``dispatch(check=False)``)."""
    quant.check_grad_wire_dtype(grad_wire_dtype)
    return _PackedDispatch.apply(x.contiguous(), slot_scale, packed, slot_token.contiguous(), token_slots.contiguous(),
                                 comm, list(send_splits), list(recv_splits), algorithm, wire_dtype, grad_wire_dtype,
                                 use_native)
