"""Ending an MPI job after a failure: process exit never waits forever on a stuck peer.

mpi4py finalizes MPI when the interpreter exits, and ``mpiexec`` returns only once every rank
has ended. After a moecomm wait timed out, the peer it waited for may never end (it sleeps,
or is stuck in a call that cannot be cancelled), so the job would outlive the timeout by as
long as that peer lives. :func:`arm` (called by ``moecomm.init`` under an MPI launcher)
registers an exit hook in every rank; at exit each rank enters a non-blocking barrier on a
private duplicate of ``MPI.COMM_WORLD`` and waits for the others:

- a process leaving with an uncaught ``TimeoutError`` (anywhere in the exception's chain)
  has already waited its timeout for its peers: it waits at most :data:`GRACE_S` (or the
  timeout, if shorter) more;
- any other process waits at most its timeout plus :data:`GRACE_S` (peers still inside a
  wait need up to their timeout to give up and reach the exit).

If every rank arrives, MPI is finalized as usual and the exit status is the process's own.
If not, a process that failed (an uncaught exception, or a communicator it aborted) ends
the whole job with ``MPI_Abort(1)``: ``mpiexec`` returns non-zero; a process that did not
fail finalizes as usual. A process with a thread still blocked in an MPI call it gave up on
(``MPI_Comm_split`` past its deadline) cannot finalize MPI under that call: it always ends
the job with ``MPI_Abort(1)``, after the same wait.
"""

from __future__ import annotations

import atexit
import sys
import time
from typing import Any, Optional

__all__ = ["arm", "note_abort", "GRACE_S"]

GRACE_S = 5.0
"""Seconds a timed-out rank waits at exit for its peers before it aborts the MPI job."""


class _ExitGuard:
    """One per process (the first ``arm`` makes it): the private communicator and the failure flag."""

    def __init__(self, world: Any, timeout_s: float) -> None:
        self.rank = world.Get_rank()
        self.timeout_s = timeout_s
        self.aborted = False
        self.stuck = False  # a thread of this process is blocked in an MPI call that was given up on
        # Collective on COMM_WORLD, but non-blocking: it completes once every rank has armed.
        self.comm, self.ready = world.Idup()

    def at_exit(self) -> None:
        MPI = sys.modules.get("mpi4py.MPI")
        if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
            return
        exc = getattr(sys, "last_value", None)
        failed = (exc is not None and not _clean_exit(exc)) or self.aborted
        limit = min(GRACE_S, self.timeout_s) if _timed_out(exc) else self.timeout_s + GRACE_S
        arrived = self._all_arrive(limit)
        if self.stuck:
            why = "a thread is still blocked in an MPI call that timed out, so MPI cannot be finalized"
        elif failed and not arrived:
            why = f"it failed and not every rank reached the exit within {limit:g} s"
        else:
            return
        sys.stdout.flush()
        print(f"moecomm: rank {self.rank} ends the MPI job (MPI_Abort): {why}", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)

    def _all_arrive(self, limit: float) -> bool:
        deadline = time.monotonic() + limit
        barrier: Optional[Any] = None
        while time.monotonic() < deadline:
            if barrier is None:
                if self.ready.Test():
                    barrier = self.comm.Ibarrier()
                    continue
            elif barrier.Test():
                return True
            time.sleep(1e-3)
        return False


def _clean_exit(exc: BaseException) -> bool:
    return isinstance(exc, SystemExit) and exc.code in (None, 0)


def _timed_out(exc: Optional[BaseException]) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, TimeoutError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


_GUARD: dict[str, _ExitGuard] = {}  # explicit registry: this process's exit hook, once armed


def arm(world: Any, timeout_s: float) -> None:
    """Register the exit hook (once per process; later calls do nothing). Collective over
    ``world`` (``MPI.COMM_WORLD``): every rank's first ``init`` calls it.

    The duplicate of ``world`` is completed here, before ``init`` posts other collectives on
    ``world``: Open MPI mismatches an ``MPI_Comm_idup`` still in flight with later
    non-blocking collectives on the same communicator (``MPI_ERR_TRUNCATE`` in its NBC
    schedules, seen with two ranks on one GPU).

    Raises:
        TimeoutError: some rank did not reach it within ``timeout_s`` (the hook stays
            registered: the exit still does not wait forever).
    """
    guard = _GUARD.get("guard")
    if guard is None:
        from ..launch import mpi_wait

        guard = _ExitGuard(world, timeout_s)
        atexit.register(guard.at_exit)
        _GUARD["guard"] = guard
        mpi_wait(guard.ready, timeout_s=timeout_s, what="moecomm.init (MPI_Comm_idup of the exit hook)",
                 rank=guard.rank)
    guard.timeout_s = max(guard.timeout_s, timeout_s)  # the longest wait any communicator may make


def note_abort(*, stuck: bool = False) -> None:
    """Record that this process aborted a communicator (a failure, for the exit hook);
    ``stuck``: a thread stays blocked in an MPI call, so MPI cannot be finalized at all."""
    guard = _GUARD.get("guard")
    if guard is not None:
        guard.aborted = True
        guard.stuck = guard.stuck or stuck
