"""The layer's view of the communicator: only the public :class:`moecomm.Communicator` API
of the core it ships with."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

import moecomm
from moecomm import functional
from moecomm.hierarchical import ALGORITHMS

__all__ = ["resolve_comm", "exchange", "exchange_counts", "check_received_counts", "allreduce_max", "allreduce_sum_", "scatter_compute_gather",
           "ALGORITHMS"]


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


def exchange(x: torch.Tensor, comm: "moecomm.Communicator", send: Sequence[int], recv: Sequence[int],
             algorithm: Optional[str] = None, wire_dtype: Optional[torch.dtype] = None,
             grad_wire_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The layer's differentiable exchange of rows, both sides' counts known (no count
    exchange): :func:`moecomm.functional.all_to_all_v`, ``algorithm`` None meaning ``"flat"``
    (the core's default). The identity on one rank: nothing travels, so nothing is quantized."""
    if comm.size == 1:
        return x
    out, _ = functional.all_to_all_v(x.contiguous(), list(send), list(recv), comm=comm, algorithm=algorithm or "flat",
                                     wire_dtype=wire_dtype, grad_wire_dtype=grad_wire_dtype)
    return out


def exchange_counts(counts: torch.Tensor, comm: "moecomm.Communicator", per_rank: int) -> torch.Tensor:
    """``per_rank`` integers to every rank and as many from each (not differentiable; the
    identity on one rank)."""
    if comm.size == 1:
        return counts
    out, _ = comm.all_to_all_v(counts.contiguous(), [per_rank] * comm.size, [per_rank] * comm.size)
    return out


def check_received_counts(got: Sequence[int], comm: "moecomm.Communicator", per_rank: int) -> None:
    """Refuse the expert row counts of :func:`exchange_counts` (``got``: ``per_rank`` from
    each rank, on the host) where one is negative: its sender was in another collective (its
    layer's settings differ), and a negative count would size buffers wrongly.

    Raises:
        moecomm.errors.CountMismatchError: naming the sending ranks and their counts.
    """
    bad = [(r, list(got[r * per_rank:(r + 1) * per_rank])) for r in range(len(got) // max(per_rank, 1))
           if min(got[r * per_rank:(r + 1) * per_rank], default=0) < 0]
    if bad:
        from moecomm.errors import CountMismatchError

        raise CountMismatchError(
            f"moecomm.moe: rank {comm.rank} received negative expert row counts from "
            + ", ".join(f"rank {r} ({c})" for r, c in bad)
            + ": the ranks are not in the same step (do their layers' settings differ?)")


def allreduce_max(comm: "moecomm.Communicator", values: Sequence[int]) -> list[int]:
    """Element-wise max of small integer lists over all ranks (blocks the host; over the host
    channel where the communicator has one, so without waiting for the GPU)."""
    return comm.allreduce_ints(values, "max")


def allreduce_sum_(comm: "moecomm.Communicator", t: torch.Tensor) -> torch.Tensor:
    if comm.size > 1:
        comm.allreduce(t, "sum")
    return t


def scatter_compute_gather(comm, send, send_splits, recv_splits, fn, degree, algorithm, own_first=False,
                           wire_dtype=None, packed=None):
    """``comm.scatter_compute_gather`` (all-to-all, ``fn`` per chunk, all-to-all back, pipelined;
    ``packed``: the rows of ``send`` already packed in ``wire_dtype``)."""
    kw: dict = {} if wire_dtype is None else {"wire_dtype": wire_dtype, "packed": packed}
    if own_first:
        kw["own_first"] = True
        kw["own_split"] = 1.0  # all own rows first: each stage's rows stay whole [experts][capacity] blocks
    return comm.scatter_compute_gather(send, list(send_splits), fn, degree=degree, recv_splits=list(recv_splits),
                                       algorithm=algorithm, **kw)
