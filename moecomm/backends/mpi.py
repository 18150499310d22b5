"""The CPU backend: MPI through mpi4py, on CPU tensors, without copies.

Tensors are handed to MPI as byte views of their own storage. Rows travel as one MPI
contiguous datatype of ``row_bytes`` bytes, so counts stay in rows (no 2**31-byte limit)
and every torch dtype (bfloat16, float8, bool) moves bit for bit.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ._exit import note_abort
from ..launch import mpi_wait
from ..splits import split_offsets
from ._deadline import call_before_deadline
from .base import NOTICE_BYTES, Backend, NoticeChannel, Request

__all__ = ["MpiBackend", "MpiNoticeChannel", "MpiRequest", "TaggedRequest", "byte_view"]


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of a contiguous CPU tensor's bytes (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


_NOTICE_TAG = 1
"""The tag of failure notices, on the notice channel's duplicate (nothing else travels there)."""


def _withdraw(posted: list) -> None:
    """Cancel the notice receive held in ``posted`` (``[request or None, buffer]``), if any."""
    req, posted[0] = posted[0], None
    if req is not None:
        req.Cancel()
        req.Wait()


class MpiNoticeChannel(NoticeChannel):
    """Failure notices on a duplicate of the backend's communicator, so that they never match
    a row receive (those take any tag): one receive from any rank of at most
    :data:`NOTICE_BYTES` stays posted on it and is tested by every poll; a notice that arrives
    is read and the receive posted again. Sends are small and leave eagerly; they stay
    referenced until done. The posted receive is cancelled by :meth:`close`, and otherwise
    when the channel is collected or the process exits (before mpi4py finalizes MPI), so that
    MPI never finalizes under it."""

    def __init__(self, comm: Any, timeout_s: float) -> None:
        """Collective over ``comm``: duplicates it (``MPI_Comm_idup``, polled until
        ``timeout_s``, then ``TimeoutError``) and posts the receive."""
        from mpi4py import MPI

        self._MPI = MPI
        dup, req = comm.Idup()
        mpi_wait(req, timeout_s=timeout_s, what="MPI_Comm_idup (moecomm failure notices)", rank=comm.Get_rank())
        self._comm = dup
        self._status = MPI.Status()
        self._sends: list = []  # (request, buffer) of notices (and barriers) not yet known to be done
        self._posted: list = [None, np.zeros(NOTICE_BYTES, dtype=np.uint8)]  # [receive, its buffer]
        self._post()
        self._finalizer = weakref.finalize(self, _withdraw, self._posted)

    def _post(self) -> None:
        MPI = self._MPI
        self._posted[0] = self._comm.Irecv([self._posted[1], MPI.BYTE], source=MPI.ANY_SOURCE, tag=_NOTICE_TAG)

    def send(self, payload: bytes) -> None:
        if self._comm == self._MPI.COMM_NULL:
            return
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]
        data = np.frombuffer(bytes(payload[:NOTICE_BYTES]), dtype=np.uint8).copy()
        rank, size = self._comm.Get_rank(), self._comm.Get_size()
        for k in range(1, size):
            dest = (rank + k) % size
            self._sends.append((self._comm.Isend([data, self._MPI.BYTE], dest=dest, tag=_NOTICE_TAG), data))

    def poll(self) -> Sequence[tuple[int, bytes]]:
        req = self._posted[0]
        if req is None or not req.Test(self._status):
            return ()
        got = []
        while True:
            n = self._status.Get_count(self._MPI.BYTE)
            got.append((self._status.Get_source(), bytes(self._posted[1][:n])))
            self._post()
            if not self._posted[0].Test(self._status):
                return got

    def agree(self) -> Request:
        req = self._comm.Ibarrier()
        self._sends.append((req, None))  # (close frees the duplicate only once it is done)
        return MpiRequest(req, ())

    def close(self) -> None:
        """Cancel the posted receive; free the duplicate once every notice sent has left and
        every barrier is done (else it stays allocated: they still use it)."""
        self._finalizer()
        if self._comm != self._MPI.COMM_NULL and all(r.Test() for r, _ in self._sends):
            self._sends.clear()
            self._comm.Free()
        self._comm = self._MPI.COMM_NULL


class MpiRequest(Request):
    """An mpi4py request and the buffers it uses (kept alive until it completes)."""

    __slots__ = ("_req", "_keep")

    def __init__(self, req: Any, keep: tuple) -> None:
        self._req = req
        self._keep = keep

    def test(self) -> bool:
        if self._req is None:
            return True
        if self._req.Test():
            self._req = None
            self._keep = ()
            return True
        return False


class TaggedRequest(Request):
    """The messages of :meth:`MpiBackend.exchange_tagged`; once done, ``arrived[p]`` is
    ``(tag, bytes)`` of peer ``p``'s message (bytes None: it sent more than was posted)."""

    __slots__ = ("_recvs", "_sends", "_statuses", "_keep", "arrived")

    def __init__(self, recvs: list, sends: list, statuses: list, keep: tuple) -> None:
        self._recvs = recvs
        self._sends = sends
        self._statuses = statuses
        self._keep = keep
        self.arrived: list = [None] * len(recvs)

    def test(self) -> bool:
        pending = False
        for p, req in enumerate(self._recvs):
            if req is None:
                continue
            status = self._statuses[p]
            try:
                done = req.Test(status)
            except Exception:  # MPI_ERR_TRUNCATE: the peer sent more than was posted (the start landed)
                done, status = True, None
            if done:
                self._recvs[p] = None
                self.arrived[p] = (status.Get_tag(), status.Get_count()) if status is not None else \
                    (self._statuses[p].Get_tag(), None)
            else:
                pending = True
        for i, req in enumerate(self._sends):
            if req is not None:
                if req.Test():
                    self._sends[i] = None
                else:
                    pending = True
        if not pending:
            self._keep = ()
        return not pending


class MpiBackend(Backend):
    name = "mpi"
    progress_on_test = True
    supports_displacements = True
    mismatched_rows_complete = True
    tagged = True

    def __init__(self, comm: Any, timeout_s: float, *, adopt: bool = False) -> None:
        """A backend over a duplicate of ``comm`` (made without blocking: ``MPI_Comm_idup``,
        polled until ``timeout_s`` seconds, then ``TimeoutError``), or over ``comm`` itself
        when ``adopt`` (the backend then owns and frees it)."""
        from mpi4py import MPI

        self._MPI = MPI
        self.timeout_s = float(timeout_s)
        self._failure: Optional[BaseException] = None
        if adopt:
            self._comm = comm
        else:
            dup, req = comm.Idup()
            mpi_wait(req, timeout_s=self.timeout_s, what="MPI_Comm_idup (moecomm.init)", rank=comm.Get_rank())
            self._comm = dup
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()
        self.device = torch.device("cpu")
        self._row_types: dict[int, Any] = {}  # explicit cache: row_bytes -> committed datatype
        self._notices: Optional[MpiNoticeChannel] = None  # made by the first notice_channel()

    @property
    def mpi_comm(self) -> Any:
        """The backend's own duplicate of the MPI communicator."""
        return self._comm

    def _row_type(self, row_bytes: int) -> Any:
        dt = self._row_types.get(row_bytes)
        if dt is None:
            dt = self._MPI.BYTE.Create_contiguous(row_bytes).Commit()
            self._row_types[row_bytes] = dt
        return dt

    def _mpi_type(self, dtype: torch.dtype) -> Any:
        MPI = self._MPI
        table = {
            torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE,
            torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T, torch.int16: MPI.INT16_T,
            torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T, torch.bool: MPI.C_BOOL,
        }
        if dtype not in table:
            raise TypeError(f"tensor: the MPI backend cannot reduce dtype {dtype}")
        return table[dtype]

    def alltoallv(self, send, send_counts, recv, recv_counts, row_bytes, send_displs=None, recv_displs=None) -> Request:
        rt = self._row_type(row_bytes)
        sd = split_offsets(list(send_counts)) if send_displs is None else list(send_displs)
        rd = split_offsets(list(recv_counts)) if recv_displs is None else list(recv_displs)
        sb, rb = byte_view(send), byte_view(recv)
        req = self._comm.Ialltoallv([sb, (list(send_counts), sd), rt], [rb, (list(recv_counts), rd), rt])
        return MpiRequest(req, (send, recv, sb, rb))

    def exchange_tagged(self, send, send_counts, send_displs, recv, recv_counts, recv_displs, row_bytes,
                        tags) -> TaggedRequest:
        """One message per peer, empty blocks included: ``send_counts[p]`` rows from row
        ``send_displs[p]`` of ``send`` with tag ``tags[p]``; into row ``recv_displs[p]`` of
        ``recv`` up to ``recv_counts[p]`` rows of any tag. Messages between two ranks match in
        order (MPI's non-overtaking rule), and point-to-point traffic never meets collectives."""
        MPI = self._MPI
        sb, rb = byte_view(send), byte_view(recv)
        rbytes, n = max(int(row_bytes), 0), self.size
        recvs, statuses, sends = [], [], []
        for k in range(n):  # receives first, from the rank whose message comes soonest
            p = (self.rank - k) % n
            start = recv_displs[p] * rbytes
            recvs.append((p, self._comm.Irecv([rb[start:start + recv_counts[p] * rbytes], MPI.BYTE], source=p,
                                              tag=MPI.ANY_TAG)))
        for k in range(n):
            p = (self.rank + k) % n
            start = send_displs[p] * rbytes
            sends.append(self._comm.Isend([sb[start:start + send_counts[p] * rbytes], MPI.BYTE], dest=p,
                                          tag=int(tags[p])))
        by_peer = [None] * n
        for p, req in recvs:
            by_peer[p] = req
        statuses = [MPI.Status() for _ in range(n)]
        return TaggedRequest(by_peer, sends, statuses, (send, recv, sb, rb))

    def alltoall(self, send, recv) -> Request:
        n = send.numel() * send.element_size() // self.size
        rt = self._row_type(max(n, 1))
        cnt = 1 if n else 0
        sb, rb = byte_view(send), byte_view(recv)
        req = self._comm.Ialltoall([sb, cnt, rt], [rb, cnt, rt])
        return MpiRequest(req, (send, recv, sb, rb))

    def allgatherv(self, send, recv, recv_counts, row_bytes) -> Request:
        rt = self._row_type(row_bytes)
        sb, rb = byte_view(send), byte_view(recv)
        counts = list(recv_counts)
        req = self._comm.Iallgatherv([sb, counts[self.rank], rt], [rb, (counts, split_offsets(counts)), rt])
        return MpiRequest(req, (send, recv, sb, rb))

    def allgather(self, send, recv) -> Request:
        n = send.numel() * send.element_size()
        rt = self._row_type(max(n, 1))
        cnt = 1 if n else 0
        sb, rb = byte_view(send), byte_view(recv)
        req = self._comm.Iallgather([sb, cnt, rt], [rb, cnt, rt])
        return MpiRequest(req, (send, recv, sb, rb))

    def allreduce(self, tensor, op) -> Request:
        MPI = self._MPI
        mop = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[op]
        if tensor.dtype == torch.bool:
            mop = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "prod": MPI.LAND}[op]
        mt = self._mpi_type(tensor.dtype)
        buf = byte_view(tensor)
        req = self._comm.Iallreduce(MPI.IN_PLACE, [buf, tensor.numel(), mt], mop)
        return MpiRequest(req, (tensor, buf))

    def broadcast(self, tensor, root) -> Request:
        buf = byte_view(tensor)
        req = self._comm.Ibcast([buf, buf.size, self._MPI.BYTE], root=root)
        return MpiRequest(req, (tensor, buf))

    def barrier(self) -> Request:
        return MpiRequest(self._comm.Ibarrier(), ())

    def split(self, color: Optional[int], key: int, table: Sequence[Sequence[int]]) -> Optional["MpiBackend"]:
        """``MPI_Comm_split`` has no non-blocking form: it runs on a thread of its own (mpi4py
        initializes MPI with ``MPI_THREAD_MULTIPLE``), and ``TimeoutError`` names it when it
        has not returned within the timeout. The call cannot be cancelled, so this backend then
        refuses further work with that error (and the process's exit ends the MPI job with
        ``MPI_Abort``: see :mod:`moecomm.backends._exit`)."""
        self.check_health()
        MPI = self._MPI
        split = functools.partial(self._comm.Split, MPI.UNDEFINED if color is None else color, key)
        if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            try:
                sub = call_before_deadline(split, self.timeout_s, "MPI_Comm_split", self.rank,
                                        afterwards="the communicator was aborted")
            except TimeoutError as exc:
                self._failure = exc
                note_abort(stuck=True)
                raise
        else:  # a thread could not call MPI: the communicator gathered the table first, under its deadline
            sub = split()
        if sub == MPI.COMM_NULL:
            return None
        return MpiBackend(sub, self.timeout_s, adopt=True)

    def check_health(self) -> None:
        if self._failure is not None:
            raise self._failure

    def notice_channel(self) -> Optional[MpiNoticeChannel]:
        """A :class:`MpiNoticeChannel` over this backend's communicator (None on one rank, or
        once closed); made on the first call, which is collective."""
        if self._notices is None and self.size > 1 and self._comm != self._MPI.COMM_NULL:
            self._notices = MpiNoticeChannel(self._comm, self.timeout_s)
        return self._notices

    def close(self) -> None:
        if self._failure is not None:  # a split still runs on the communicator: leave it allocated
            self.abort()
            return
        for dt in self._row_types.values():
            dt.Free()
        self._row_types.clear()
        if self._comm != self._MPI.COMM_NULL:
            self._comm.Free()
            self._comm = self._MPI.COMM_NULL
        if self._notices is not None:
            self._notices.close()

    def abort(self) -> None:
        note_abort()
        # MPI cannot cancel a collective in flight: the communicator is left allocated and
        # its buffers referenced (by the requests the caller abandoned), so that late peers
        # never write into freed memory. The notice channel stays open: notices still leave
        # and arrive on it.
        self._comm = self._MPI.COMM_NULL

