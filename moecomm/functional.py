"""Differentiable collectives: gradients flow back along the reversed exchange."""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import hierarchical, wire
from .engine import tags as _tags
from .communicator import Communicator
from .engine.notices import run_collective
from .init import default_communicator
from .quant import WIRE_DTYPES, check_grad_wire_dtype
from .splits import Splits, normalize_splits

__all__ = ["all_to_all_v", "all_to_all_v_backward"]


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
        grad_input = run_collective(ctx.comm.engine, "all_to_all_v backward", lambda: _send_back(
            ctx.comm, grad_output, ctx.recv, ctx.send, "flat", ctx.grad_wire_dtype, ctx.plan))
        return grad_input, None, None, None, None, None, None, None


def _send_back(comm: Communicator, grad: torch.Tensor, send: list[int], recv: list[int], algorithm: str,
               grad_wire_dtype: Optional[torch.dtype], plan: Any) -> torch.Tensor:
    """``grad`` exchanged with ``send``/``recv`` splits (a forward's, reversed) in
    ``grad_wire_dtype``: FP8 block-scaled, another floating dtype cast there and back, None as
    it is; along the reversed phases of a 2DH forward's ``plan`` where there is one. The
    forward's quantization counts as the identity (straight-through). Its tags say "backward",
    so it never pairs with a peer's next forward (a skipped backward, see moecomm.engine.tags)."""
    with _tags.labelled("all_to_all_v backward"):
        return _send_back_as_labelled(comm, grad, send, recv, algorithm, grad_wire_dtype, plan)


def _send_back_as_labelled(comm: Communicator, grad: torch.Tensor, send: list[int], recv: list[int], algorithm: str,
                           grad_wire_dtype: Optional[torch.dtype], plan: Any) -> torch.Tensor:
    gw = grad_wire_dtype
    if gw in WIRE_DTYPES:
        if plan is not None:
            return wire.reverse_rows(comm.engine, comm.topology, plan, grad, gw)
        return wire.exchange_rows(comm.engine, comm.topology, grad.contiguous(), send, recv, algorithm, gw)
    if gw is not None and gw != grad.dtype:
        return _send_back_as_labelled(comm, grad.to(gw), send, recv, algorithm, None, plan).to(grad.dtype)
    if plan is not None:
        return hierarchical.reverse_all_to_all_v(comm.engine, comm.topology, plan, grad)
    out, _ = comm.all_to_all_v(grad.contiguous(), send, recv, algorithm=algorithm)
    return out


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
        TimeoutError, PeerFailedError: as :meth:`Communicator.all_to_all_v` (its backward too).
    """
    if comm is not None and not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a moecomm.Communicator or None (the default communicator), "
                        f"got {comm!r} ({type(comm).__name__})")
    comm = default_communicator() if comm is None else comm

    def call() -> tuple[torch.Tensor, list[int]]:
        check_grad_wire_dtype(grad_wire_dtype)
        counts: list[list[int]] = []
        output = _AllToAllV.apply(input, comm, send_splits, recv_splits, counts, algorithm, wire_dtype,
                                  grad_wire_dtype)
        return output, counts[0]
    return run_collective(comm.engine, "all_to_all_v", call)


def all_to_all_v_backward(
    grad_output: torch.Tensor,
    send_splits: Splits,
    recv_splits: Splits,
    *,
    comm: Optional[Communicator] = None,
    algorithm: str = "flat",
    grad_wire_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """What :func:`all_to_all_v`'s backward does, for autograd Functions that run their own
    forward exchange (of packed FP8 rows, say): ``grad_output`` (``[sum(recv_splits), *row_shape]``,
    the gradient of the forward's output) sent back along the forward's ``send_splits`` /
    ``recv_splits`` reversed, in ``grad_wire_dtype`` by the same rule. Returns
    ``[sum(send_splits), *row_shape]`` in ``grad_output``'s dtype. Collective.

    Raises:
        TypeError: ``comm`` is not a Communicator (or None).
        TypeError, ValueError: ``grad_wire_dtype`` not None or one of
            :data:`moecomm.quant.GRAD_WIRE_DTYPES`; otherwise as :meth:`Communicator.all_to_all_v`.
        CountMismatchError, TimeoutError, PeerFailedError: as :meth:`Communicator.all_to_all_v`.
    """
    if comm is not None and not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a moecomm.Communicator or None (the default communicator), "
                        f"got {comm!r} ({type(comm).__name__})")
    comm = default_communicator() if comm is None else comm

    def call() -> torch.Tensor:
        check_grad_wire_dtype(grad_wire_dtype)
        send = normalize_splits(send_splits, "send_splits", comm.size)
        recv = normalize_splits(recv_splits, "recv_splits", comm.size)
        return _send_back(comm, grad_output, recv, send, algorithm, grad_wire_dtype, None)
    return run_collective(comm.engine, "all_to_all_v_backward", call)
