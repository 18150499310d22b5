"""The few CUDA runtime calls on the NCCL backend's hot path, through cuda-bindings.

torch's ``Stream``/``Event`` objects cost Python work per call (device lookups, object
construction, stream context managers) that shows on a hot path issuing microsecond-scale
exchanges; the calls here take raw handles (ints) and do none of it. cuda-bindings is a dependency of nccl4py, so it is present
wherever the NCCL backend can run; this module is imported only by that backend.
"""

from __future__ import annotations

import torch
from cuda.bindings import driver as _drv
from cuda.bindings import runtime as _rt

__all__ = ["current_stream", "new_event", "destroy_event", "record", "wait", "query", "copy_async",
           "set_device", "relax_capture_mode", "allocation_base", "H2D", "D2H", "D2D"]

_SUCCESS = _rt.cudaError_t.cudaSuccess
_NOT_READY = _rt.cudaError_t.cudaErrorNotReady
H2D = _rt.cudaMemcpyKind.cudaMemcpyHostToDevice
D2H = _rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
D2D = _rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
_current_raw_stream = torch._C._cuda_getCurrentRawStream


def _check(result: tuple, what: str) -> None:
    if result[0] != _SUCCESS:
        raise RuntimeError(f"moecomm: CUDA {what} failed: {result[0].name}")


def current_stream(device_index: int) -> int:
    """The raw handle of torch's current stream on ``device_index``."""
    return _current_raw_stream(device_index)


def set_device(device_index: int) -> None:
    _check(_rt.cudaSetDevice(device_index), "cudaSetDevice")


def relax_capture_mode() -> None:
    """Let this thread make CUDA calls while another thread captures a CUDA graph.

    Under torch's default (global) capture mode, a call such as ``cudaEventQuery`` from any
    thread invalidates a capture in progress; a thread that only polls events of its own
    (a watchdog) opts out with the relaxed mode.
    """
    _check(_rt.cudaThreadExchangeStreamCaptureMode(_rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed)[:1],
           "cudaThreadExchangeStreamCaptureMode")


def new_event() -> object:
    """An event without timing (the cheapest kind to record and wait on)."""
    result = _rt.cudaEventCreateWithFlags(_rt.cudaEventDisableTiming)
    _check(result, "cudaEventCreateWithFlags")
    return result[1]


def destroy_event(event: object) -> None:
    _rt.cudaEventDestroy(event)  # safe while pending: released once the event completes


def record(event: object, stream: int) -> None:
    _check(_rt.cudaEventRecord(event, stream), "cudaEventRecord")


def wait(stream: int, event: object) -> None:
    """Make ``stream`` wait (on the device) for the work captured in ``event``."""
    _check(_rt.cudaStreamWaitEvent(stream, event, 0), "cudaStreamWaitEvent")


def query(event: object) -> bool:
    """True once the work captured in ``event`` has completed; never blocks."""
    err = _rt.cudaEventQuery(event)[0]
    if err == _SUCCESS:
        return True
    if err == _NOT_READY:
        _rt.cudaGetLastError()  # "not ready" is recorded as the thread's last error: clear it, as torch does
        return False
    raise RuntimeError(f"moecomm: CUDA cudaEventQuery failed: {err.name}")


def copy_async(dst: int, src: int, nbytes: int, kind: object, stream: int) -> None:
    """``cudaMemcpyAsync`` between raw pointers (host memory must be pinned to stay asynchronous)."""
    _check(_rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream), "cudaMemcpyAsync")


def allocation_base(ptr: int) -> int:
    """The start of the device allocation that holds ``ptr`` (``cuMemGetAddressRange``).

    Raises:
        RuntimeError: ``ptr`` is not in a device allocation of this context.
    """
    result = _drv.cuMemGetAddressRange(ptr)
    if result[0] != _drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"moecomm: CUDA cuMemGetAddressRange failed: {result[0].name}")
    return int(result[1])
