"""Differentiable collectives: gradients flow back along the reversed exchange."""

from __future__ import annotations

from typing import Optional

import torch

from . import hierarchical, wire
from .communicator import Communicator
from .init import default_communicator
from .quant import WIRE_DTYPES, check_grad_wire_dtype
from .splits import Splits

__all__ = ["all_to_all_v"]


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, comm, send_splits, recv_splits, counts_out, algorithm="flat",  # type: ignore[override]
                wire_dtype=None, grad_wire_dtype=None):
        engine, topology = comm.engine, comm.topology
        if wire_dtype is None:
            output, send, recv, request = hierarchical.start_all_to_all_v(engine, topology, input, send_splits,
                                                                          recv_splits, algorithm)
            plan = getattr(request, "plan", None)
        else:
            output, send, recv, request, plan = wire.start_all_to_all_v(engine, topology, input, send_splits,
                                                                        recv_splits, algorithm, wire_dtype)
        engine.complete(request, "all_to_all_v", None)
        ctx.comm, ctx.send, ctx.recv = comm, send, recv
        ctx.plan = plan  # a 2DH exchange: its backward runs the phases reversed
        ctx.algorithm, ctx.grad_wire_dtype = algorithm, grad_wire_dtype
        counts_out.append(recv)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):  # type: ignore[override]
        # What arrived goes back where it came from; both sides' counts are known already.
        # The quantization of the forward is treated as the identity (straight-through).
        gw = ctx.grad_wire_dtype
        if gw in WIRE_DTYPES:
            engine, topology = ctx.comm.engine, ctx.comm.topology
            if ctx.plan is not None:
                grad_input = wire.reverse_rows(engine, topology, ctx.plan, grad_output, gw)
            else:
                grad_input = wire.exchange_rows(engine, topology, grad_output.contiguous(), ctx.recv, ctx.send, "flat",
                                                gw)
        elif gw is not None and gw != grad_output.dtype:
            grad_input = _send_back(ctx, grad_output.to(gw)).to(grad_output.dtype)
        else:
            grad_input = _send_back(ctx, grad_output)
        return grad_input, None, None, None, None, None, None, None


def _send_back(ctx, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` exchanged along the forward's reversed splits, as it is (the reversed phases
    of a 2DH forward)."""
    if ctx.plan is not None:
        return hierarchical.reverse_all_to_all_v(ctx.comm.engine, ctx.comm.topology, ctx.plan, grad)
    grad_input, _ = ctx.comm.all_to_all_v(grad.contiguous(), ctx.recv, ctx.send)
    return grad_input


def all_to_all_v(
    input: torch.Tensor,
    send_splits: Splits,
    recv_splits: Optional[Splits] = None,
    *,
    comm: Optional[Communicator] = None,
    algorithm: str = "flat",
    wire_dtype: Optional[torch.dtype] = None,
    grad_wire_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, list[int]]:
    """Differentiable :meth:`Communicator.all_to_all_v` (the default communicator if ``comm`` is None).

    Returns ``(output, recv_splits)``. The backward pass sends ``grad_output`` back along the
    reversed splits (no count exchange), so each input row's gradient is that of the row it became.
    ``algorithm`` as in :meth:`Communicator.all_to_all_v`; the backward of a 2DH exchange is
    itself hierarchical (the forward's phases reversed).

    ``wire_dtype``: the forward's rows travel in that FP8 dtype (as in
    :meth:`Communicator.all_to_all_v`). ``grad_wire_dtype``: the dtype the backward's
    gradient rows travel in: an FP8 dtype (block-scaled, the rule of ``wire_dtype``), or
    ``torch.bfloat16``/``float16``/``float32`` (the gradient is cast to it for the exchange
    and back to its own dtype: half the bytes of a float32 gradient in bf16), or None (its own
    dtype, exactly). The gradient with respect to ``input`` is the straight-through one: the
    quantization counts as the identity.

    Raises:
        TypeError: ``comm`` is not a Communicator (or None).
        TypeError, ValueError: as :meth:`Communicator.all_to_all_v`; ``grad_wire_dtype`` not
            None or one of :data:`moecomm.quant.GRAD_WIRE_DTYPES` (checked before the forward
            exchange).
        CountMismatchError: ranks disagree on counts, dtype or row shape.
    """
    if comm is not None and not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a moecomm.Communicator or None (the default communicator), "
                        f"got {comm!r} ({type(comm).__name__})")
    comm = default_communicator() if comm is None else comm
    check_grad_wire_dtype(grad_wire_dtype)
    counts: list[list[int]] = []
    output = _AllToAllV.apply(input, comm, send_splits, recv_splits, counts, algorithm, wire_dtype, grad_wire_dtype)
    return output, counts[0]
