"""The ``torch`` backend: collectives through a torch.distributed process group (gloo, ...).

It is what ``moecomm.init(process_group=pg)`` uses for a group that is not NCCL, so that
``torchrun`` on CPU works. Data moves as byte views, so every dtype is exchanged bit for bit.

The collectives it runs are taken from ``torch.distributed.distributed_c10d`` when this module
is imported, never looked up on ``torch.distributed`` at call time. That keeps the zero-edit
migration ``torch.distributed.all_to_all_single = moecomm.distributed.all_to_all_single`` (and
the same for ``all_to_all``) safe: the swapped names are not called from here, so an exchange
on a gloo group cannot route back into moecomm and recurse. Should the functions found at
import already be moecomm's (someone patched ``distributed_c10d`` itself), the import fails
with a ``RuntimeError`` rather than recursing later.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .base import Backend, Request

__all__ = ["TorchBackend"]


def _original(name: str) -> Any:
    """``torch.distributed``'s own ``name``, captured once (see the module docstring)."""
    from torch.distributed import distributed_c10d

    fn = getattr(distributed_c10d, name)
    if str(getattr(fn, "__module__", "")).split(".")[0] == "moecomm":
        raise RuntimeError(
            f"torch.distributed.distributed_c10d.{name} is moecomm's {fn.__module__}.{fn.__name__}; patch "
            f"torch.distributed.{name} instead (moecomm's torch backend calls the original from distributed_c10d)"
        )
    return fn


_all_to_all_single = _original("all_to_all_single")
# torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns FutureWarning there)
_all_gather_single = _original("all_gather_single" if hasattr(dist.distributed_c10d, "all_gather_single")
                               else "all_gather_into_tensor")
_all_reduce = _original("all_reduce")
_broadcast = _original("broadcast")
_barrier = _original("barrier")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class _WorkRequest(Request):
    __slots__ = ("_work", "_keep")

    def __init__(self, work: Any, keep: tuple) -> None:
        self._work = work
        self._keep = keep

    def test(self) -> bool:
        if self._work is None:
            return True
        if self._work.is_completed():
            self._work.wait()  # surfaces an error the work may hold
            self._work = None
            self._keep = ()
            return True
        return False


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, group: Any, device: torch.device = torch.device("cpu")) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = device
        self._closed = False

    def alltoallv(self, send, send_counts, recv, recv_counts, row_bytes, send_displs=None, recv_displs=None) -> Request:
        if send_displs is not None or recv_displs is not None:
            raise NotImplementedError("the torch backend sends consecutive blocks only")
        work = _all_to_all_single(
            _bytes(recv), _bytes(send),
            [c * row_bytes for c in recv_counts], [c * row_bytes for c in send_counts],
            group=self.group, async_op=True,
        )
        return _WorkRequest(work, (send, recv))

    def alltoall(self, send, recv) -> Request:
        work = _all_to_all_single(_bytes(recv), _bytes(send), group=self.group, async_op=True)
        return _WorkRequest(work, (send, recv))

    def allgatherv(self, send, recv, recv_counts, row_bytes) -> Request:
        # torch.distributed has no all-gather-v: every rank sends its rows to every peer.
        counts = list(recv_counts)
        mine = counts[self.rank] * row_bytes
        src = _bytes(send)
        packed = src.repeat(self.size) if mine else src
        work = _all_to_all_single(
            _bytes(recv), packed, [c * row_bytes for c in counts], [mine] * self.size,
            group=self.group, async_op=True,
        )
        return _WorkRequest(work, (send, recv, packed))

    def allgather(self, send, recv) -> Request:
        work = _all_gather_single(_bytes(recv), _bytes(send), group=self.group, async_op=True)
        return _WorkRequest(work, (send, recv))

    def allreduce(self, tensor, op) -> Request:
        work = _all_reduce(tensor, _OPS[op], group=self.group, async_op=True)
        return _WorkRequest(work, (tensor,))

    def broadcast(self, tensor, root) -> Request:
        src = dist.get_global_rank(self.group, root) if self.group is not None else root
        work = _broadcast(_bytes(tensor), src, group=self.group, async_op=True)
        return _WorkRequest(work, (tensor,))

    def barrier(self) -> Request:
        return _WorkRequest(_barrier(group=self.group, async_op=True), ())

    def split(self, color: Optional[int], key: int, table: Sequence[Sequence[int]]) -> Optional["TorchBackend"]:
        if color is None:
            return None
        members = sorted((k, r) for r, (c, k) in enumerate(table) if c == color)
        if [r for _, r in members] != sorted(r for _, r in members):
            raise ValueError(
                "the torch backend keeps sub-group ranks in parent-rank order: key must not reorder "
                f"ranks, got (key, rank) pairs {members}"
            )
        ranks = [dist.get_global_rank(self.group, r) if self.group is not None else r for _, r in members]
        sub = dist.new_group(ranks=ranks, use_local_synchronization=True)
        return TorchBackend(sub, self.device)

    def close(self) -> None:
        self._closed = True

    def abort(self) -> None:
        self._closed = True
