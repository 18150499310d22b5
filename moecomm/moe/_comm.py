"""The layer's view of the communicator: only the public :class:`moecomm.Communicator` API
of the core it ships with."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

import moecomm
from moecomm.hierarchical import ALGORITHMS

__all__ = ["resolve_comm", "AllToAll", "all_to_all", "allreduce_max", "allreduce_sum_", "ALGORITHMS"]


def resolve_comm(comm: Any) -> "moecomm.Communicator":
    """``None`` (the default communicator, made by :func:`moecomm.init` if there is none),
    a :class:`moecomm.Communicator`, or a torch ``ProcessGroup``."""
    if comm is None:
        try:
            return moecomm.default_communicator()
        except RuntimeError:
            return moecomm.init()
    if isinstance(comm, moecomm.Communicator):
        if comm.closed:
            raise ValueError("comm: the communicator is closed")
        return comm
    try:
        import torch.distributed as dist

        is_pg = isinstance(comm, dist.ProcessGroup)
    except Exception:  # noqa: BLE001 - torch without distributed
        is_pg = False
    if is_pg:
        from moecomm.distributed import communicator_for

        return communicator_for(comm)
    raise TypeError(
        f"comm (group) must be None, a moecomm.Communicator or a torch ProcessGroup, got {type(comm).__name__}"
    )


def _a2a_kwargs(comm: "moecomm.Communicator", algorithm: Optional[str]) -> dict:
    """``algorithm=`` for ``comm.all_to_all_v`` (None: the core's default)."""
    return {} if algorithm is None else {"algorithm": algorithm}


class AllToAll(torch.autograd.Function):
    """Differentiable ``comm.all_to_all_v`` with both sides' counts known (no count exchange);
    the backward sends the gradient back along the reversed splits."""

    @staticmethod
    def forward(ctx, x, comm, send, recv, algorithm):  # type: ignore[override]
        ctx.comm, ctx.send, ctx.recv, ctx.algorithm = comm, send, recv, algorithm
        out, _ = comm.all_to_all_v(x.contiguous(), send, recv, **_a2a_kwargs(comm, algorithm))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        comm = ctx.comm
        out, _ = comm.all_to_all_v(grad.contiguous(), ctx.recv, ctx.send, **_a2a_kwargs(comm, ctx.algorithm))
        return out, None, None, None, None


def all_to_all(x: torch.Tensor, comm: "moecomm.Communicator", send: Sequence[int], recv: Sequence[int],
               algorithm: Optional[str] = None) -> torch.Tensor:
    """Differentiable all-to-all of rows (identity on one rank)."""
    if comm.size == 1:
        return x
    return AllToAll.apply(x, comm, list(send), list(recv), algorithm)


def all_to_all_nograd(x: torch.Tensor, comm: "moecomm.Communicator", send: Sequence[int], recv: Sequence[int],
                      algorithm: Optional[str] = None) -> torch.Tensor:
    if comm.size == 1:
        return x
    out, _ = comm.all_to_all_v(x.contiguous(), list(send), list(recv), **_a2a_kwargs(comm, algorithm))
    return out


def allreduce_max(comm: "moecomm.Communicator", values: Sequence[int]) -> list[int]:
    """Element-wise max of small integer lists over all ranks (blocks the host; over the host
    channel where the communicator has one, so without waiting for the GPU)."""
    return comm.allreduce_ints(values, "max")


def allreduce_sum_(comm: "moecomm.Communicator", t: torch.Tensor) -> torch.Tensor:
    if comm.size > 1:
        comm.allreduce(t, "sum")
    return t


def scatter_compute_gather(comm, send, send_splits, recv_splits, fn, degree, algorithm, own_first=False,
                           wire_dtype=None):
    """``comm.scatter_compute_gather`` (all-to-all, ``fn`` per chunk, all-to-all back, pipelined)."""
    kw: dict = {} if wire_dtype is None else {"wire_dtype": wire_dtype}
    if own_first:
        kw["own_first"] = True
        kw["own_split"] = 1.0  # all own rows first: each stage's rows stay whole [experts][capacity] blocks
    return comm.scatter_compute_gather(send, list(send_splits), fn, degree=degree, recv_splits=list(recv_splits),
                                       algorithm=algorithm, **kw)
