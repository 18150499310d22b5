"""The NCCL backend's watchdog, on the CPU: requests that finish, one that outlives its
deadline, and a GPU poll that fails. The CUDA calls are replaced by a stand-in."""

from __future__ import annotations

import threading
import time
import types

import pytest

import moecomm
from moecomm.backends import _stream
from moecomm.backends._deadline import call_before_deadline


class _Request:
    def __init__(self, done_after_s: float = 0.0, error: Exception | None = None) -> None:
        self._at = time.monotonic() + done_after_s
        self._error = error

    def test(self) -> bool:
        if self._error is not None:
            raise self._error
        return time.monotonic() >= self._at


def _backend() -> types.SimpleNamespace:
    aborted = threading.Event()
    return types.SimpleNamespace(name="nccl", rank=3, device=types.SimpleNamespace(index=0), abort=aborted.set, aborted=aborted)


@pytest.fixture(autouse=True)
def fake_cuda(monkeypatch):
    monkeypatch.setattr(_stream, "_cudart", types.SimpleNamespace(set_device=lambda index: None,
                                                               relax_capture_mode=lambda: None,
                                                               destroy_event=lambda event: None))


def test_finished_requests_leave_no_failure():
    b = _backend()
    w = _stream.Watchdog(b, period_s=0.005)
    for i in range(20):
        w.watch(_Request(0.001 * i), f"op {i}", timeout_s=5.0)
    time.sleep(0.2)
    w.stop()
    assert w.failure is None and not b.aborted.is_set() and not w._pending


def test_overdue_request_aborts_and_names_the_operation():
    b = _backend()
    w = _stream.Watchdog(b, period_s=0.005)
    w.watch(_Request(0.0), "barrier", timeout_s=5.0)
    w.watch(_Request(60.0), "all_to_all_v", timeout_s=0.05)
    assert b.aborted.wait(5.0)
    assert isinstance(w.failure, TimeoutError)
    assert str(w.failure) == ("moecomm: all_to_all_v did not complete on the GPU within 0.05 s on rank 3; "
                              "the NCCL communicator was aborted")


def test_failing_gpu_poll_aborts_instead_of_killing_the_thread():
    b = _backend()
    w = _stream.Watchdog(b, period_s=0.005)
    w.watch(_Request(error=RuntimeError("moecomm: CUDA cudaEventQuery failed: cudaErrorIllegalAddress")), "allreduce",
            timeout_s=5.0)
    assert b.aborted.wait(5.0)
    assert isinstance(w.failure, RuntimeError)
    assert "could not poll the GPU (moecomm: CUDA cudaEventQuery failed: cudaErrorIllegalAddress)" in str(w.failure)
    assert "rank 3" in str(w.failure)


@pytest.mark.parametrize("reported", [
    moecomm.CountMismatchError("moecomm: all_to_all_v (copy engines): rank 3 expected 4 rows from rank 0, but rank 0 "
                               "sent 5 (the ranks' splits disagree); the communicator was aborted"),
    TimeoutError("moecomm: all_to_all_v (copy engines) on rank 3 received nothing from rank 1 within 2 s; "
                 "the communicator was aborted"),
])
def test_failure_reported_by_a_finished_exchange_is_kept_as_is(reported):
    b = _backend()
    w = _stream.Watchdog(b, period_s=0.005)
    w.watch(_Request(0.0), "barrier", timeout_s=5.0)
    w.watch(_Request(error=reported), "all_to_all_v (copy engines)", timeout_s=5.0)
    assert b.aborted.wait(5.0)
    assert w.failure is reported


def test_event_request_reports_its_problem_once_complete(monkeypatch):
    state = {"done": False}
    monkeypatch.setattr(_stream, "_cudart", types.SimpleNamespace(query=lambda event: state["done"],
                                                               destroy_event=lambda event: None))
    problem = moecomm.CountMismatchError("counts disagree")
    request = _stream.EventRequest(object(), 0, lambda: problem)
    assert request.test() is False  # not complete: the status is not looked at yet
    state["done"] = True
    with pytest.raises(moecomm.CountMismatchError, match="counts disagree"):
        request.test()
    assert _stream.EventRequest(object(), 0, lambda: None).test() is True


def test_a_captured_operation_cannot_be_polled():
    """An operation recorded into a CUDA graph capture runs at each replay: its request
    refuses test() (a query of a captured event would break the capture) and names the op."""
    request = _stream.EventRequest(object(), 0, None, "all_to_all_v")
    with pytest.raises(RuntimeError, match=r"all_to_all_v was captured into a CUDA graph.*only wait\(\)"):
        request.test()


def test_call_before_deadline_returns_and_reraises():
    assert call_before_deadline(lambda: 42, 5.0, "ncclCommInitRank", 0, afterwards="end this process") == 42
    assert call_before_deadline(lambda: 43, float("inf"), "ncclCommInitRank", 0, afterwards="end this process") == 43  # timeout=inf

    def fails():
        raise ValueError("bad unique id")

    with pytest.raises(ValueError, match="bad unique id"):
        call_before_deadline(fails, 5.0, "ncclCommInitRank", 0, afterwards="end this process")


def test_call_before_deadline_times_out_naming_the_call():
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        call_before_deadline(lambda: release.wait(30), 0.2, "ncclCommSplit", 5, afterwards="end this process")
    assert time.monotonic() - start < 10
    assert str(info.value).startswith("moecomm: ncclCommSplit did not complete within 0.2 s on rank 5")
    assert str(info.value).endswith("end this process)")
    release.set()
