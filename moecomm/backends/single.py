"""The ``self`` backend: one process, CPU tensors, no launcher and no dependency.

A communicator of size 1 exchanges only with itself, so every collective is a byte copy
(or nothing). It is what ``moecomm.init()`` gives a process started without mpirun,
mpiexec or torchrun, so that a single process needs neither mpi4py nor a socket.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .base import Backend, DoneRequest, Request

__all__ = ["SelfBackend"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _copy_rows(send: torch.Tensor, recv: torch.Tensor, send_rows: int, recv_rows: int, row_bytes: int) -> None:
    if send_rows != recv_rows:
        raise ValueError(f"recv_splits: a single rank receives what it sends, {send_rows} rows, "
                         f"but expects {recv_rows}")
    n = send_rows * row_bytes
    if n:
        _bytes(recv)[:n].copy_(_bytes(send)[:n])


class SelfBackend(Backend):
    name = "self"
    supports_displacements = True

    def __init__(self) -> None:
        self.rank = 0
        self.size = 1
        self.device = torch.device("cpu")

    def alltoallv(self, send, send_counts, recv, recv_counts, row_bytes, send_displs=None, recv_displs=None) -> Request:
        (s,), (r,) = list(send_counts), list(recv_counts)
        sd = 0 if send_displs is None else int(list(send_displs)[0])
        rd = 0 if recv_displs is None else int(list(recv_displs)[0])
        if s != r:
            raise ValueError(f"recv_splits: a single rank receives what it sends, {s} rows, but expects {r}")
        n = s * row_bytes
        if n:
            _bytes(recv)[rd * row_bytes:rd * row_bytes + n].copy_(_bytes(send)[sd * row_bytes:sd * row_bytes + n])
        return DoneRequest()

    def alltoall(self, send, recv) -> Request:
        _bytes(recv).copy_(_bytes(send))
        return DoneRequest()

    def allgatherv(self, send, recv, recv_counts, row_bytes) -> Request:
        (r,) = list(recv_counts)
        send_rows = send.numel() * send.element_size() // row_bytes if row_bytes else 0
        _copy_rows(send, recv, send_rows, r, row_bytes)
        return DoneRequest()

    def allgather(self, send, recv) -> Request:
        _bytes(recv).copy_(_bytes(send))
        return DoneRequest()

    def allreduce(self, tensor, op) -> Request:
        return DoneRequest()

    def broadcast(self, tensor, root) -> Request:
        return DoneRequest()

    def barrier(self) -> Request:
        return DoneRequest()

    def split(self, color: Optional[int], key: int, table: Sequence[Sequence[int]]) -> Optional["SelfBackend"]:
        return None if color is None else SelfBackend()

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass
