"""What the stream-ordered GPU backends (NCCL, peer memory) share: requests that complete
with a CUDA event, the watchdog thread that aborts a backend whose operation outlives its
timeout, and the begin/end bracket of every operation on the backend's own stream.

Importable without cuda-bindings (:mod:`moecomm.backends._cudart` is then None, and no
stream-ordered backend can be made).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Optional

import torch

from ..errors import MoeCommError
from .base import Request

try:
    from . import _cudart
except Exception:  # noqa: BLE001 - no CUDA runtime bindings: no stream-ordered backend can be made
    _cudart = None

__all__ = ["EventRequest", "Watchdog", "StreamOrdered"]


class EventRequest(Request):
    """Done when a CUDA event recorded after the operation on the backend's stream completes.

    An operation issued while the caller's stream captures a CUDA graph only joins the
    graph: it runs at each replay, and its event can be waited on but not queried."""

    __slots__ = ("event", "_device_index", "_problem", "_op")

    def __init__(self, event: object, device_index: int,
                 problem: Optional[Callable[[], Optional[BaseException]]] = None, captured_op: str = "") -> None:
        self.event = event
        self._device_index = device_index
        self._problem = problem  # after completion: what the GPU reported as failed, if anything
        self._op = captured_op

    def test(self) -> bool:
        """True once complete; raises what ``problem`` reports (a transport's failed exchange)."""
        if self._op:
            raise RuntimeError(f"moecomm: {self._op} was captured into a CUDA graph: it runs when the graph is "
                               f"replayed, and only wait() (which orders the current stream) applies to it")
        done = _cudart.query(self.event)
        if done and self._problem is not None:
            exc = self._problem()
            if exc is not None:
                raise exc
        return done

    def join(self) -> None:
        _cudart.wait(_cudart.current_stream(self._device_index), self.event)

    def __del__(self) -> None:
        if _cudart is not None:  # None while the interpreter shuts down
            _cudart.destroy_event(self.event)


class Watchdog:
    """Polls the requests in flight of one backend; aborts it past a deadline.

    ``backend`` needs ``rank``, ``device``, ``name`` and ``abort()``."""

    def __init__(self, backend: "StreamOrdered", period_s: float = 0.05) -> None:
        self._backend = backend
        self._period = period_s
        self._pending: collections.deque = collections.deque()  # appends and pops are atomic
        self._stop = threading.Event()
        self.failure: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"moecomm-{backend.name}-watchdog", daemon=True)
        self._thread.start()

    def watch(self, request: EventRequest, op: str, timeout_s: float) -> None:
        self._pending.append((request, time.monotonic() + timeout_s, op, timeout_s))

    def _run(self) -> None:
        failure: Optional[BaseException] = None
        what = self._backend.name.upper() if self._backend.name == "nccl" else self._backend.name
        try:
            _cudart.set_device(self._backend.device.index)
            _cudart.relax_capture_mode()
            while failure is None and not self._stop.wait(self._period):
                failure = self._overdue(what)
        except Exception as exc:  # noqa: BLE001 - a CUDA error: nothing may wait on this context now
            failure = RuntimeError(f"moecomm: the {what} watchdog on rank {self._backend.rank} could not poll the "
                                   f"GPU ({exc}); the {what} communicator was aborted")
        if failure is not None:
            self.failure = failure
            self._backend.abort()

    def _overdue(self, what: str) -> Optional[BaseException]:
        """Drop the finished requests; a TimeoutError naming the oldest if it is past its deadline,
        or the failure a finished one reported."""
        pending = self._pending
        # Operations on the backend's stream complete in issue order: only the oldest
        # unfinished one can be late.
        try:
            while pending and pending[0][0].test():
                pending.popleft()
        except (TimeoutError, MoeCommError) as exc:  # an exchange that completed with a reported failure
            return exc
        if pending and time.monotonic() > pending[0][1]:
            _, _, op, timeout_s = pending[0]
            return TimeoutError(f"moecomm: {op} did not complete on the GPU within {timeout_s:g} s on rank "
                                f"{self._backend.rank}; the {what} communicator was aborted")
        return None

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)


class StreamOrdered:
    """The bracket of every operation of a stream-ordered backend: its own high-priority
    stream waits for the caller's current stream (:meth:`begin`), and an event recorded
    after the operation is its request, under the watchdog (:meth:`end`).

    :meth:`_init_stream` sets ``stream``, ``_stream``, ``_index``, ``_ready`` and
    ``_watchdog``; the class also needs ``rank``, ``device``, ``name``, ``timeout_s`` and
    ``abort()``."""

    name: str
    rank: int
    device: torch.device
    timeout_s: float

    def _init_stream(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device, priority=-1)
        self._stream = self.stream.cuda_stream  # the raw handle, for the hot path
        self._index = device.index
        # Re-recorded by every operation at the caller's stream point: a wait takes the
        # state an event had when it was enqueued, so one event serves every call.
        self._ready = _cudart.new_event()
        self._watchdog = Watchdog(self)

    def abort(self) -> None:  # pragma: no cover - every subclass has its own
        raise NotImplementedError

    def check_health(self) -> None:
        if self._watchdog.failure is not None:
            raise self._watchdog.failure

    def begin(self, *tensors: torch.Tensor) -> int:
        """Order the backend's stream after the caller's; returns the backend stream's handle.
        With :meth:`end`, what a transport issuing on this stream (the peer transport) brackets
        its work with."""
        self.check_health()
        _cudart.record(self._ready, _cudart.current_stream(self._index))
        _cudart.wait(self._stream, self._ready)
        for t in tensors:
            t.record_stream(self.stream)
        return self._stream

    def end(self, op: str, problem: Optional[Callable[[], Optional[BaseException]]] = None) -> EventRequest:
        """The request of what was issued on the backend's stream since :meth:`begin`, under the
        watchdog (``problem()``: a failure to report once it completes)."""
        event = _cudart.new_event()
        _cudart.record(event, self._stream)
        if torch.cuda.is_current_stream_capturing():  # nothing runs now: replays are watched by watch_stream
            return EventRequest(event, self._index, None, op)
        request = EventRequest(event, self._index, problem)
        self._watchdog.watch(request, op, self.timeout_s)
        return request

    def watch_stream(self, op: str, timeout_s: float,
                     problem: Optional[Callable[[], Optional[BaseException]]] = None) -> None:
        event = _cudart.new_event()
        _cudart.record(event, _cudart.current_stream(self._index))
        self._watchdog.watch(EventRequest(event, self._index, problem), op, timeout_s)

    def copy_to_host(self, src: torch.Tensor, dst: torch.Tensor) -> Request:
        self.begin(src)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        return self.end("copy to the host")
