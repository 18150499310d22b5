"""A blocking call that cannot be cancelled (communicator creation, split), run so that the
caller can give up on it when its deadline passes."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Optional

__all__ = ["call_before_deadline"]


def call_before_deadline(fn: Callable[[], Any], timeout_s: float, what: str, rank: int, *, afterwards: str) -> Any:
    """``fn()`` (a call that returns once every rank has made it) on a daemon thread of its own.

    Returns ``fn``'s result or raises its exception. ``timeout_s`` may be ``inf``.

    Raises:
        TimeoutError: ``fn`` has not returned within ``timeout_s`` seconds; the message names
            ``what`` and ``rank`` and ends with ``afterwards`` (what became of the
            communicator). The thread stays behind, blocked: a daemon thread does not keep
            the process alive.
    """
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"moecomm-{what}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(min(deadline - time.monotonic(), 3600.0))  # (join rejects timeouts past time_t)
    if thread.is_alive():
        raise TimeoutError(f"moecomm: {what} did not complete within {timeout_s:g} s on rank {rank}: some rank "
                           f"has not called it (the call cannot be cancelled; {afterwards})")
    if "error" in box:
        raise box["error"]
    return box["result"]


def poll_yielding(test: Callable[[], bool], deadline: float, every: Optional[Callable[[], None]] = None) -> bool:
    """Call ``test`` until it returns True (then True) or ``time.monotonic()`` passes
    ``deadline`` (then False), yielding the core between calls and looking at the clock every
    64 calls: MPI moves messages only while a request is polled, as ``MPI_Wait`` would.
    ``every``: called at each look at the clock (what it raises ends the wait)."""
    while True:
        for _ in range(64):
            if test():
                return True
            os.sched_yield()
        if every is not None:
            every()
        if time.monotonic() > deadline:
            return False
