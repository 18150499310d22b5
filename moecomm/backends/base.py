"""What every backend provides: byte-level collectives that return a pollable request."""

from __future__ import annotations

import abc
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["Request", "DoneRequest", "NoticeChannel", "Backend", "REDUCE_OPS", "NOTICE_BYTES", "reduce_op_name"]

REDUCE_OPS = ("sum", "max", "min", "prod")


def reduce_op_name(op: Any) -> str:
    """``op`` (a name or a ``torch.distributed.ReduceOp``) as one of :data:`REDUCE_OPS`.

    Raises:
        ValueError: another value.
    """
    if isinstance(op, str):
        if op.lower() in REDUCE_OPS:
            return op.lower()
        raise ValueError(f"op must be one of {REDUCE_OPS} or a torch.distributed.ReduceOp, got {op!r}")
    import torch.distributed as dist

    table = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min", dist.ReduceOp.PRODUCT: "prod"}
    for k, v in table.items():
        if op == k:
            return v
    raise ValueError(f"op must be one of {REDUCE_OPS} or a torch.distributed.ReduceOp, got {op!r}")


NOTICE_BYTES = 1024
"""The longest failure notice a :class:`NoticeChannel` carries, in bytes (longer ones are cut)."""


class NoticeChannel(abc.ABC):
    """A side channel of one communicator's ranks for short failure notices
    (:mod:`moecomm.engine.notices`): a rank whose collective call failed tells its peers why,
    so that a peer waiting for it raises that instead of timing out. Nothing travels on it
    while no rank fails; it stays open after the backend is aborted (notices still leave and
    arrive), and is released by the backend's ``close``."""

    reader: Any = None
    """What keeps the notices that arrive (:class:`moecomm.engine.notices.Notices`): set by the
    first engine made over the backend, shared by every engine over it, so that they count
    their calls together and none reads a notice meant for another."""

    @abc.abstractmethod
    def send(self, payload: bytes) -> None:
        """Send ``payload`` (cut to :data:`NOTICE_BYTES`) to every other rank; never blocks."""

    @abc.abstractmethod
    def poll(self) -> Sequence[tuple[int, bytes]]:
        """The notices that arrived since the last poll, ``(source rank, payload)`` in order
        of arrival; empty when none did (the common case: one test of a posted receive).
        Never blocks."""

    @abc.abstractmethod
    def agree(self) -> "Request":
        """Start a barrier of the channel's ranks (non-blocking; collective among those that
        call it): the ranks that failed the same call meet there, to learn that none of them
        is waiting for another."""


class Request(abc.ABC):
    """One operation in flight. ``test`` never blocks."""

    @abc.abstractmethod
    def test(self) -> bool:
        """True once the operation has completed (on the host for CPU, on the GPU for NCCL)."""

    def join(self) -> None:
        """Order the caller's current CUDA stream after the operation (no-op on CPU)."""


class DoneRequest(Request):
    """A request that completed when it was made (for example, nothing to send)."""

    def test(self) -> bool:
        return True


class Backend(abc.ABC):
    """The transport under a :class:`moecomm.Communicator`.

    Tensors handed to a backend are contiguous and already validated. Row counts are in
    rows of ``row_bytes`` bytes each. A backend must keep every tensor of a request alive
    until the request completes.
    """

    name: str
    rank: int
    size: int
    device: torch.device
    stream_ordered: bool = False
    """True where completion is ordered on a CUDA stream (NCCL): ``join`` suffices to use results."""
    progress_on_test: bool = False
    """True where operations advance only while the host polls them (MPI's progress engine)."""

    mismatched_rows_complete: bool = False
    """True where an exchange whose ranks disagree on counts still completes on every rank
    (MPI: a short message is truncated, a long receive left partly unwritten), so that a
    disagreement can be reported after the rows moved; elsewhere (gloo aborts the process,
    NCCL may hang) the per-peer count records are compared before any row moves."""

    collective_exchanges: bool = False
    """True where every rank must take part in every exchange, also one in which it moves no
    row (the peer backend's rounds); elsewhere an exchange is point to point, and a rank with
    nothing to send or receive may skip it."""

    supports_displacements: bool = False
    """True where :meth:`alltoallv` takes ``send_displs``/``recv_displs``."""

    tagged: bool = False
    """True where :meth:`exchange_tagged` exists: one tagged message per peer (MPI; see
    :mod:`moecomm.engine.tags`). Elsewhere row exchanges carry no description of themselves."""

    carries_meta: bool = False
    """True where :meth:`alltoallv` takes ``meta=`` (a :class:`moecomm.engine.tags.ExchangeMeta`)
    and compares it between the ranks before any row moves (the peer backend's records)."""

    counts_in_one_host_round: bool = False
    """True where ``all_to_all_v`` with counts on the GPU takes the backend's one host round
    (:meth:`moecomm.backends.peer.PeerBackend.counts_round`: ranks that share a GPU without MPS,
    where it is switched on)."""

    timeout_s: float = 600.0
    """Seconds any wait of this backend may last: the communicator's ``timeout``, kept here
    only (the engine reads and sets it), so that the backend's own waits (NCCL's watchdog,
    blocking splits) use the same value."""

    @abc.abstractmethod
    def alltoallv(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        recv: torch.Tensor,
        recv_counts: Sequence[int],
        row_bytes: int,
        send_displs: Optional[Sequence[int]] = None,
        recv_displs: Optional[Sequence[int]] = None,
    ) -> Request:
        """Send ``send_counts[p]`` rows to each peer ``p``, receive ``recv_counts[p]`` from each.

        Blocks are consecutive in peer order, or start at row ``send_displs[p]`` /
        ``recv_displs[p]`` where the backend :attr:`supports_displacements`.
        """

    def alltoall_equal(self, send: torch.Tensor, recv: torch.Tensor, rows: int, row_bytes: int, meta: Any = None,
                       op: str = "all_to_all_single") -> Optional[Request]:
        """An all-to-all of ``rows`` rows of ``row_bytes`` to and from every rank, every rank
        passing the same ``rows`` (torch's equal split), issued with no agreement first where
        the backend checks it where the rows land; None where it has no such path (the
        caller then takes :meth:`alltoallv` with its usual checks)."""
        return None

    def exchange_tagged(self, send: torch.Tensor, send_counts: Sequence[int], send_displs: Sequence[int],
                        recv: torch.Tensor, recv_counts: Sequence[int], recv_displs: Sequence[int], row_bytes: int,
                        tags: Sequence[int]) -> Request:
        """:meth:`alltoallv` at displacements as one message per peer with tag ``tags[p]``;
        the request's ``arrived[p]`` is then (tag, bytes or None) of what ``p`` sent. Only
        where :attr:`tagged`."""
        raise NotImplementedError(f"the {self.name} backend has no tagged exchange")

    @abc.abstractmethod
    def alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> Request:
        """Equal blocks of ``send.numel() // size`` elements to each peer (used for counts)."""

    @abc.abstractmethod
    def allgatherv(self, send: torch.Tensor, recv: torch.Tensor, recv_counts: Sequence[int], row_bytes: int) -> Request:
        """``recv`` holds every rank's ``send`` rows in rank order, ``recv_counts[p]`` rows from ``p``."""

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Request:
        """Copy ``src`` (on :attr:`device`) into host tensor ``dst`` after the operations issued so far."""
        dst.copy_(src)
        return DoneRequest()

    def exchange_counts(self, send: Optional[torch.Tensor], dev: torch.Tensor, host: torch.Tensor) -> Request:
        """Stream-ordered backends only: an all-to-all of ``n = host.numel() // 2`` int64s
        (equal blocks per peer) whose results land in ``host[n:]``.

        The values sent are ``send`` (a contiguous int64 device tensor of ``n``), or, when
        ``send`` is None, ``host[:n]``. ``dev`` is ``2n`` int64s of device staging. When the
        request completes, ``host`` holds the values sent, then the values received.
        """
        raise NotImplementedError(f"the {self.name} backend is not stream-ordered")

    @abc.abstractmethod
    def allgather(self, send: torch.Tensor, recv: torch.Tensor) -> Request:
        """``recv`` holds ``size`` copies of ``send``'s shape, in rank order."""

    @abc.abstractmethod
    def allreduce(self, tensor: torch.Tensor, op: str) -> Request:
        """In-place reduction over all ranks; ``op`` is one of :data:`REDUCE_OPS`."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int) -> Request:
        """In-place broadcast from ``root``."""

    @abc.abstractmethod
    def barrier(self) -> Request:
        """Completes once every rank has entered the barrier."""

    @abc.abstractmethod
    def split(self, color: Optional[int], key: int, table: Sequence[Sequence[int]]) -> Optional["Backend"]:
        """Collective: a backend over the ranks that passed the same ``color`` (None: no group).

        ``table[r]`` is rank ``r``'s ``(color or -1, key)``, already gathered by the
        communicator (a backend that needs it uses it instead of gathering it again).
        """

    def check_health(self) -> None:
        """Raise if the backend has failed asynchronously (a watchdog timeout, say)."""

    def notice_channel(self) -> Optional[NoticeChannel]:
        """The backend's :class:`NoticeChannel`, or None where it has none (the default: NCCL,
        gloo, the peer backend, one rank). Collective the first time it is asked for (MPI:
        a duplicate communicator is made); later calls return the same channel."""
        return None

    def watch_stream(self, op: str, timeout_s: float,
                     problem: Optional[Callable[[], Optional[BaseException]]] = None) -> None:
        """Abort if the work issued so far on the caller's current stream is not done within
        ``timeout_s``, or if ``problem()`` reports a failure once it is (GPU backends; a
        host-waiting backend times out every wait itself)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources; the caller guarantees nothing is in flight."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Tear down at once, abandoning operations in flight (their buffers stay referenced)."""
