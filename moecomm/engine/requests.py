"""Requests that wrap a backend's: the :class:`Work` handle of ``async_op=True``, and the
checks and follow-ups that complete with an exchange."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from .peer_check import PeerCheck
from ..backends.base import Request

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

__all__ = ["Work", "CheckedRequest", "TagChecked", "RaiseAfter", "ThenRequest"]


class Work:
    """A collective in flight, returned by ``async_op=True``.

    ``wait()`` returns the operation's result. On a GPU it orders the caller's current
    stream after the collective without blocking the host (torch.distributed's semantics);
    on the CPU it blocks until the data has arrived, at most ``timeout`` seconds.
    """

    __slots__ = ("_engine", "_request", "_op", "_result", "_done", "_at")

    def __init__(self, engine: "Engine", request: Request, op: str, result: Any) -> None:
        self._engine = engine
        self._request = request
        self._op = op
        self._result = result
        self._done = False
        # where its wait stands among the collective calls (it heeds the peers' failure notices
        # of that call and step: moecomm.engine.notices)
        self._at = engine.wait_position()

    def is_completed(self) -> bool:
        """True once the data has arrived (never blocks)."""
        return self._request.test()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Make the result usable and return it; ``timeout`` in seconds (default: the communicator's).

        Raises:
            TimeoutError: the data did not arrive within ``timeout`` (the communicator is aborted).
            CountMismatchError: a peer disagreed on the counts (see ``all_to_all_v``).
            PeerFailedError: a peer failed this call, or aborted the communicator (MPI; it is
                aborted here too).
        """
        if not self._done:
            self._engine.complete(self._request, self._op, timeout, self._at)
            self._done = True
        return self._result

    def synchronize(self, timeout: Optional[float] = None) -> Any:
        """Block the host until the data has arrived, on any backend; then as :meth:`wait`.

        Raises:
            TimeoutError, CountMismatchError, PeerFailedError: as :meth:`wait`.
        """
        self._engine.wait_host(self._request, self._op, timeout, self._at)
        return self.wait(timeout)


class CheckedRequest(Request):
    """Rows whose counts were given, with the records sent beside them: done once both are,
    then raises :class:`CountMismatchError` if a peer disagrees (see :mod:`moecomm.engine.peer_check`).
    Where the disagreement means some rows can never arrive, it raises as soon as the records
    are in, abandoning the rows and aborting the engine."""

    __slots__ = ("_engine", "_rows", "_check", "_records", "_mine", "_theirs", "_issues", "_stuck", "_done", "plan")

    def __init__(self, engine: "Engine", rows: Request, check: PeerCheck, records: Request,
                 mine: torch.Tensor, theirs: torch.Tensor) -> None:
        self._engine = engine
        self._rows = rows
        self._check = check
        self._records = records
        self._mine = mine
        self._theirs = theirs
        self._issues: Optional[list[str]] = None
        self._stuck = False
        self._done = False
        self.plan = getattr(rows, "plan", None)  # a 2DH exchange's, for its backward

    def test(self) -> bool:
        if self._done:
            return True
        if self._issues is None:
            if not self._records.test():
                self._rows.test()  # (MPI progresses what it is polled for)
                return False
            _, self._issues, self._stuck = self._check.compare(self._theirs.tolist())
            if self._issues and self._stuck:
                self._done = True
                self._engine.keep(self._rows)
                self._engine.abort()
                raise self._check.error(self._issues, moved=False, aborted=True)
        if not self._rows.test():
            return False
        self._done = True
        if self._issues:
            raise self._check.error(self._issues, moved=True)
        return True

    def join(self) -> None:  # stream-ordered backends: the records were compared before the rows
        self._rows.join()


class TagChecked(Request):
    """A tagged exchange (:meth:`moecomm.backends.base.Backend.exchange_tagged`): done once
    every message is, then raises :class:`CountMismatchError` if what arrived disagrees with
    ``plan`` (:class:`moecomm.engine.tags.TagPlan`). Every rank sent and received one message per
    peer whatever it found, so the communicator stays matched."""

    __slots__ = ("_inner", "_plan", "_done", "plan")

    def __init__(self, inner: Request, tag_plan: Any) -> None:
        self._inner = inner
        self._plan = tag_plan
        self._done = False
        self.plan = None

    def test(self) -> bool:
        if self._done:
            return True
        if not self._inner.test():
            return False
        self._done = True
        issues = self._plan.issues(self._inner.arrived)
        if issues:
            raise self._plan.error(issues)
        return True


class RaiseAfter(Request):
    """Raises ``error`` once ``inner`` completes (a disagreement found before the rows moved,
    on a backend where every rank still completes the exchange so that no peer waits)."""

    __slots__ = ("_inner", "_error", "plan")

    def __init__(self, inner: Request, error: BaseException) -> None:
        self._inner = inner
        self._error = error
        self.plan = getattr(inner, "plan", None)

    def test(self) -> bool:
        if self._inner.test():
            raise self._error
        return False

    def join(self) -> None:
        self._inner.join()
        raise self._error


class ThenRequest(Request):
    """Runs ``then`` once the inner request is usable (for unpacking into user tensors)."""

    __slots__ = ("_inner", "_then", "_stream_ordered", "plan")

    def __init__(self, inner: Request, then: Callable[[], Any], stream_ordered: bool) -> None:
        self._inner = inner
        self._then = then
        self._stream_ordered = stream_ordered
        self.plan = getattr(inner, "plan", None)

    def _run_then(self) -> None:
        if self._then is not None:
            then, self._then = self._then, None
            then()

    def test(self) -> bool:
        done = self._inner.test()
        if done and not self._stream_ordered:
            self._run_then()
        return done

    def join(self) -> None:
        self._inner.join()
        self._run_then()
