"""A host channel for short integer collectives (token counts, metadata tables), so that these
agreements never touch the GPU.

On the NCCL backend an integer agreement through the device (a tensor, an allreduce, then
``.item()``) makes the host wait for *all* GPU work queued before it: the host could never run
ahead of the GPU. A :class:`HostChannel` runs the same agreement between the processes alone:

- :class:`MpiHostChannel`: mpi4py non-blocking collectives, polled until a deadline, on a
  communicator of its own (duplicated with ``MPI_Comm_idup``, so that user code or the exit
  hook on ``COMM_WORLD`` never interleaves with it), or on the MPI backend's own communicator;
- :class:`GlooHostChannel`: a CPU torch.distributed group (gloo), ``async_op`` work waited on
  with a timeout.

:func:`moecomm.backends._select.make_backend` makes one where the launch provides one, and the
engine (:mod:`moecomm.engine.engine`) owns it; where there is none (an NCCL-only process group) the
engine's integer agreements keep going through the device.
"""

from __future__ import annotations

import datetime
import operator
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ._deadline import poll_yielding

__all__ = ["HostChannel", "MpiHostChannel", "GlooHostChannel", "OPS", "int_list", "gloo_capable"]

OPS = ("max", "min", "sum")
"""The reductions :meth:`HostChannel.allreduce` offers."""

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def int_list(values: Any, name: str) -> list[int]:
    """``values`` (a sequence of ints, numpy ints included, bools not) as a list of Python
    ints in int64's range; ``TypeError``/``ValueError`` naming ``name`` otherwise."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) and not isinstance(values, np.ndarray):
        raise TypeError(f"{name} must be a sequence of ints (a list or tuple), got {type(values).__name__}")
    if type(values) is list and values and all(type(v) is int for v in values) \
            and _INT64_MIN <= min(values) and max(values) <= _INT64_MAX:
        return list(values)  # (the hot path: the backends' own records, already plain ints; a copy, as below)
    out: list[int] = []
    for i, v in enumerate(values):
        if isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{name}[{i}] must be an int, got a bool ({v!r})")
        try:
            iv = operator.index(v)
        except TypeError:
            raise TypeError(f"{name}[{i}] must be an int, got {v!r} ({type(v).__name__})") from None
        if not _INT64_MIN <= iv <= _INT64_MAX:
            raise ValueError(f"{name}[{i}] = {iv} is outside int64's range [-2**63, 2**63 - 1]")
        out.append(iv)
    return out


def _check_op(op: Any) -> str:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return op


class HostChannel:
    """Short integer collectives between the processes of a communicator, on the host.

    Every call is collective (every rank, the same order, the same number of values) and
    blocks the host until done, at most ``timeout`` seconds (default: the channel's
    ``timeout_s``). After a timeout the channel is unusable (a collective is left in flight):
    its owner aborts it.
    """

    kind = "?"
    rank: int
    size: int

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self._failure: Optional[BaseException] = None
        self._abandoned: list = []  # requests in flight after a timeout, with their buffers

    def allreduce(self, values: Sequence[int], op: str = "max", *, timeout: Optional[float] = None,
                  what: str = "allreduce", watch: Optional[Callable[[], None]] = None) -> list[int]:
        """Element-wise ``op`` ("max", "min" or "sum", in int64) of every rank's ``values``.
        ``watch``: called now and then while the channel polls (MPI: every 64 polls); what it
        raises ends the wait (the collective is left in flight, its buffers referenced).

        Raises:
            TypeError, ValueError: bad ``values`` or ``op`` (named), before anything is sent.
            TimeoutError: some rank did not take part within ``timeout`` seconds (names ``what``).
            RuntimeError: the channel is unusable (an earlier call timed out) or closed.
        """
        vals = int_list(values, "values")
        op = _check_op(op)
        self._check_usable(what)
        if self.size == 1 or not vals:
            return vals
        return self._allreduce(vals, op, self._limit(timeout), what, watch)

    def allgather(self, values: Sequence[int], *, timeout: Optional[float] = None,
                  what: str = "allgather", watch: Optional[Callable[[], None]] = None) -> list[list[int]]:
        """Every rank's ``values`` (the same length on every rank), in rank order; ``watch``:
        as in :meth:`allreduce`.

        Raises:
            TypeError, ValueError: bad ``values`` (named), before anything is sent.
            TimeoutError: some rank did not take part within ``timeout`` seconds (names ``what``).
            RuntimeError: the channel is unusable (an earlier call timed out) or closed.
        """
        vals = int_list(values, "values")
        self._check_usable(what)
        if self.size == 1:
            return [vals]
        if not vals:
            return [[] for _ in range(self.size)]
        return self._allgather(vals, self._limit(timeout), what, watch)

    def split(self, color: Optional[int], key: int, *, timeout: Optional[float] = None) -> Optional["HostChannel"]:
        """Collective: a channel over the ranks that pass ``color`` (None: none), ordered by
        ``key`` then rank, as :meth:`moecomm.Communicator.split` orders them; None where this
        kind of channel cannot be split (the sub-communicator's agreements then go through
        its device)."""
        return None

    def close(self) -> None:
        """Release what the channel owns. Idempotent."""

    def abort(self) -> None:
        """Give the channel up without waiting (collectives in flight stay referenced)."""
        if self._failure is None:
            self._failure = RuntimeError("moecomm: the host channel was aborted")

    # -- for the implementations ---------------------------------------------------------

    def _allreduce(self, values: list[int], op: str, timeout_s: float, what: str,
                   watch: Optional[Callable[[], None]] = None) -> list[int]:
        raise NotImplementedError

    def _allgather(self, values: list[int], timeout_s: float, what: str,
                   watch: Optional[Callable[[], None]] = None) -> list[list[int]]:
        raise NotImplementedError

    def _limit(self, timeout: Optional[float]) -> float:
        limit = self.timeout_s if timeout is None else float(timeout)
        if not limit > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        return limit

    def _check_usable(self, what: str) -> None:
        if self._failure is not None:
            raise RuntimeError(f"moecomm: cannot run {what} on the host channel: {self._failure}")

    def _timed_out(self, request: Any, keep: Any, what: str, timeout_s: float) -> TimeoutError:
        self._abandoned.append((request, keep))
        exc = TimeoutError(f"moecomm: {what} did not complete within {timeout_s:g} s on rank {self.rank}: "
                           f"some rank has not reached it (host channel, {self.kind})")
        self._failure = exc
        return exc


class MpiHostChannel(HostChannel):
    """Over an MPI communicator: a duplicate of ``comm`` made here (``duplicate``, the default:
    ``MPI_Comm_idup`` polled until ``timeout_s``, then ``TimeoutError``), else ``comm`` itself,
    freed by :meth:`close` when ``owned``."""

    kind = "mpi"

    def __init__(self, comm: Any, timeout_s: float, *, duplicate: bool = True, owned: bool = True) -> None:
        super().__init__(timeout_s)
        from mpi4py import MPI

        self._MPI = MPI
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        if duplicate:
            dup, req = comm.Idup()
            self._poll(req, (), "MPI_Comm_idup (the host channel of moecomm.init)", self.timeout_s)
            comm, owned = dup, True
        self._comm = comm
        self._owned = owned

    @property
    def mpi_comm(self) -> Any:
        return self._comm

    def _poll(self, req: Any, keep: Any, what: str, timeout_s: float,
              watch: Optional[Callable[[], None]] = None) -> None:
        if req.Test():
            return
        every = None
        if watch is not None:
            def every() -> None:
                try:
                    watch()
                except BaseException:
                    self._abandoned.append((req, keep))
                    raise
        if not poll_yielding(req.Test, time.monotonic() + timeout_s, every):
            raise self._timed_out(req, keep, what, timeout_s)

    def _allreduce(self, values: list[int], op: str, timeout_s: float, what: str,
                   watch: Optional[Callable[[], None]] = None) -> list[int]:
        MPI = self._MPI
        buf = np.array(values, dtype=np.int64)
        mop = {"max": MPI.MAX, "min": MPI.MIN, "sum": MPI.SUM}[op]
        req = self._comm.Iallreduce(MPI.IN_PLACE, [buf, MPI.INT64_T], mop)
        self._poll(req, buf, what, timeout_s, watch)
        return buf.tolist()

    def _allgather(self, values: list[int], timeout_s: float, what: str,
                   watch: Optional[Callable[[], None]] = None) -> list[list[int]]:
        MPI = self._MPI
        mine = np.array(values, dtype=np.int64)
        table = np.empty((self.size, len(values)), dtype=np.int64)
        req = self._comm.Iallgather([mine, MPI.INT64_T], [table, MPI.INT64_T])
        self._poll(req, (mine, table), what, timeout_s, watch)
        return table.tolist()

    def split(self, color: Optional[int], key: int, *, timeout: Optional[float] = None) -> Optional["HostChannel"]:
        """``MPI_Comm_split`` (blocking in MPI) on a thread of its own under the deadline, as
        :meth:`moecomm.backends.mpi.MpiBackend.split` runs it; the sub-channel owns its
        communicator."""
        from ._deadline import call_before_deadline

        self._check_usable("split")
        MPI = self._MPI
        limit = self._limit(timeout)

        def split() -> Any:
            return self._comm.Split(MPI.UNDEFINED if color is None else color, key)

        if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            try:
                sub = call_before_deadline(split, limit, "MPI_Comm_split (host channel)", self.rank,
                                           afterwards="the host channel is unusable")
            except TimeoutError as exc:
                self._failure = exc
                from ._exit import note_abort

                note_abort(stuck=True)
                raise
        else:  # the caller agreed on the colors first, under its deadline
            sub = split()
        if sub == MPI.COMM_NULL:
            return None
        return MpiHostChannel(sub, self.timeout_s, duplicate=False, owned=True)

    def close(self) -> None:
        if self._comm == self._MPI.COMM_NULL:
            return
        if self._owned and self._failure is None and not self._MPI.Is_finalized():
            self._comm.Free()
        self._comm = self._MPI.COMM_NULL
        if self._failure is None:
            self._failure = RuntimeError("moecomm: the host channel is closed")


class GlooHostChannel(HostChannel):
    """Over a torch.distributed group with a CPU backend (gloo): ``async_op`` work on int64 CPU
    tensors, waited on with the deadline. The group is the caller's (never destroyed here);
    it cannot be split (a new torch group needs every rank of the default group)."""

    kind = "gloo"

    def __init__(self, group: Any, timeout_s: float) -> None:
        super().__init__(timeout_s)
        import torch.distributed as dist

        self._group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def _wait(self, work: Any, keep: Any, what: str, timeout_s: float) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError:
            if work.is_completed():
                raise  # the work failed (a peer went away): gloo's own error
            raise self._timed_out(work, keep, what, timeout_s) from None

    def _allreduce(self, values: list[int], op: str, timeout_s: float, what: str,
                   watch: Optional[Callable[[], None]] = None) -> list[int]:  # (a gloo wait cannot be polled)
        import torch

        from .torch_dist import _OPS, _all_reduce

        t = torch.tensor(values, dtype=torch.int64)
        work = _all_reduce(t, _OPS[op], group=self._group, async_op=True)
        self._wait(work, t, what, timeout_s)
        return t.tolist()

    def _allgather(self, values: list[int], timeout_s: float, what: str,
                   watch: Optional[Callable[[], None]] = None) -> list[list[int]]:
        import torch

        from .torch_dist import _all_gather_single

        n = len(values)
        mine = torch.tensor(values, dtype=torch.int64)
        table = torch.empty(self.size * n, dtype=torch.int64)
        work = _all_gather_single(table, mine, group=self._group, async_op=True)
        self._wait(work, (mine, table), what, timeout_s)
        flat = table.tolist()
        return [flat[r * n:(r + 1) * n] for r in range(self.size)]

    def close(self) -> None:
        if self._failure is None:
            self._failure = RuntimeError("moecomm: the host channel is closed")


def gloo_capable(group: Any) -> bool:
    """Whether ``group`` runs collectives on CPU tensors through gloo (``"gloo"``, or a
    ``"cpu:gloo,cuda:nccl"`` group)."""
    import torch.distributed as dist

    try:
        name = str(dist.get_backend(group)).lower()
    except Exception:  # noqa: BLE001 - not a group torch knows
        return False
    return "gloo" in name
