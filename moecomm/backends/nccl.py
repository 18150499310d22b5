"""The GPU backend: NCCL through nccl4py, on the communicator's own CUDA streams.

Every operation runs on a dedicated high-priority stream that first waits for the caller's
current stream; tensors used there are protected with ``record_stream``. The grouped
send/recv of an all-to-all are issued from native code (``moecomm/backends/csrc/nccl_issue.cpp``:
one call for the whole group, through the libnccl nccl4py loaded); where that extension
cannot be built, through nccl4py's raw Cython bindings (``nccl.bindings.nccl``, one Python
call per send or recv, with one warning), never through its Python layer, which costs
several times more per call (``bench/results/README.md``). A watchdog thread aborts the NCCL communicator when an
operation outlives the timeout, so that no GPU wait hangs forever.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from ._deadline import call_before_deadline
from ._stream import EventRequest as _EventRequest
from ._stream import StreamOrdered, Watchdog
from .base import Backend, Request

try:
    from . import _cudart
except Exception:  # noqa: BLE001 - no CUDA runtime bindings: then no nccl4py either (it needs them)
    _cudart = None

__all__ = ["NcclBackend", "nccl_available"]

_UINT8 = 1
_NCCL_DTYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4,
    torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}
_NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3}


def nccl_available() -> bool:
    """True when CUDA is usable and nccl4py (with its cuda-bindings) imports."""
    if not torch.cuda.is_available() or _cudart is None:
        return False
    try:
        import nccl.core  # noqa: F401  (import check only)
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


_NATIVE_CALLS: dict = {}
"""Cache: libnccl path -> the native issue object (or the reason it is unavailable)."""


def _loaded_nccl_library() -> str:
    """Path of the libnccl mapped into this process (the one nccl4py loaded)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "/libnccl.so" in fields[-1]:
                return fields[-1]
    raise RuntimeError("no libnccl is mapped into this process")


def _native_calls() -> Optional[Any]:
    """The native grouped send/recv issuer, or None (then one warning says why)."""
    try:
        library = _loaded_nccl_library()
    except (OSError, RuntimeError) as exc:
        library, reason = "", str(exc)
    else:
        reason = ""
    cached = _NATIVE_CALLS.get(library)
    if cached is None:
        if library:
            try:
                from ._ext import load_nccl_issue

                cached = load_nccl_issue().NcclCalls(library)
            except Exception as exc:  # noqa: BLE001 - any failure: the raw bindings do the same work
                reason = str(exc)
        if cached is None:
            warnings.warn(f"moecomm: the NCCL backend issues its send/recv through nccl4py's raw bindings "
                          f"(one Python call each, slower) because native issuing is unavailable: {reason}",
                          RuntimeWarning, stacklevel=3)
            cached = reason
        _NATIVE_CALLS[library] = cached
    return None if isinstance(cached, str) else cached


class NcclBackend(StreamOrdered, Backend):
    name = "nccl"
    stream_ordered = True
    supports_displacements = True

    def __init__(self, nccl_comm: Any, device: torch.device, timeout_s: float) -> None:
        from nccl.bindings import nccl as raw

        self._comm = nccl_comm
        self._raw = raw
        self._handle = raw.Comm(nccl_comm.ptr)
        self.rank = int(nccl_comm.rank)
        self.size = int(nccl_comm.nranks)
        self.device = device
        self.timeout_s = timeout_s
        self._init_stream(device)
        self._barrier_token = torch.zeros(1, dtype=torch.int32, device=device)
        self._aborted = False
        self._native = _native_calls()
        self._comm_ptr = int(nccl_comm.ptr)

    @classmethod
    def create(cls, size: int, rank: int, unique_id: bytes, device: torch.device, timeout_s: float,
               max_ctas: Optional[int] = None) -> "NcclBackend":
        import nccl.core as nc

        torch.cuda.set_device(device)
        config = None if max_ctas is None else nc.NCCLConfig(max_ctas=max_ctas)

        def init() -> Any:
            _cudart.set_device(device.index)  # the current device is per thread
            return nc.Communicator.init(size, rank, nc.UniqueId.from_bytes(unique_id), config)

        comm = call_before_deadline(init, timeout_s, "ncclCommInitRank", rank,
                                        afterwards="end this process")
        backend = cls(comm, device, timeout_s)
        backend.connect_peers()
        return backend

    def connect_peers(self) -> None:
        """Exchange one byte with every peer now, while all ranks are here.

        NCCL connects peers lazily, inside the first ``ncclGroupEnd`` that needs them, and
        that call blocks the host until the peer joins. Connecting during creation keeps
        every later wait on the GPU, where the watchdog's timeout covers it.
        """
        ones = [1] * self.size
        send = torch.zeros(self.size, dtype=torch.uint8, device=self.device)
        recv = torch.empty_like(send)
        request = self.alltoallv(send, ones, recv, ones, 1)
        deadline = time.monotonic() + self.timeout_s
        while not request.test():
            self.check_health()
            if time.monotonic() > deadline:
                self.abort()
                raise TimeoutError(f"moecomm: connecting NCCL peers took over {self.timeout_s:g} s on rank {self.rank}")
            time.sleep(1e-4)

    @staticmethod
    def new_unique_id() -> bytes:
        import nccl.core as nc

        return bytes(nc.get_unique_id())

    # -- plumbing -------------------------------------------------------------------------

    # -- collectives ----------------------------------------------------------------------

    def alltoallv(self, send, send_counts, recv, recv_counts, row_bytes, send_displs=None, recv_displs=None) -> Request:
        h = self.begin(send, recv)
        if self._native is not None:  # the rank's own block too: NCCL copies it in the same kernel
            self._native.alltoallv(self._comm_ptr, h, send.data_ptr(), recv.data_ptr(), send_counts, recv_counts,
                                   row_bytes, () if send_displs is None else send_displs,
                                   () if recv_displs is None else recv_displs)
            return self.end("all_to_all_v")
        raw, comm = self._raw, self._handle
        sp, rp = send.data_ptr(), recv.data_ptr()
        so = ro = 0
        raw.group_start()
        try:
            for peer in range(self.size):  # the rank's own block too: NCCL copies it in the same kernel
                sc = send_counts[peer] * row_bytes
                rc = recv_counts[peer] * row_bytes
                if send_displs is not None:
                    so = send_displs[peer] * row_bytes
                if recv_displs is not None:
                    ro = recv_displs[peer] * row_bytes
                if sc:
                    raw.send(sp + so, sc, _UINT8, peer, comm, h)
                if rc:
                    raw.recv(rp + ro, rc, _UINT8, peer, comm, h)
                so += sc
                ro += rc
        finally:
            raw.group_end()
        return self.end("all_to_all_v")

    def allgatherv(self, send, recv, recv_counts, row_bytes) -> Request:
        h = self.begin(send, recv)
        raw, comm, me = self._raw, self._handle, self.rank
        sp, rp = send.data_ptr(), recv.data_ptr()
        mine = recv_counts[me] * row_bytes
        offset = 0
        raw.group_start()
        try:
            for peer in range(self.size):
                n = recv_counts[peer] * row_bytes
                if peer != me:
                    if mine:
                        raw.send(sp, mine, _UINT8, peer, comm, h)
                    if n:
                        raw.recv(rp + offset, n, _UINT8, peer, comm, h)
                else:
                    my_offset = offset
                offset += n
        finally:
            raw.group_end()
        if mine:
            with torch.cuda.stream(self.stream):
                recv.reshape(-1).view(torch.uint8)[my_offset:my_offset + mine].copy_(send.reshape(-1).view(torch.uint8))
        return self.end("all_gather_v")

    def exchange_counts(self, send, dev, host) -> Request:
        n = host.numel() // 2  # int64s out, then as many in
        nbytes = 8 * n
        if send is None:
            h = self.begin(dev)
            _cudart.copy_async(dev.data_ptr(), host.data_ptr(), nbytes, _cudart.H2D, h)
            src = dev.data_ptr()
        else:
            h = self.begin(send, dev)
            src = send.data_ptr()
        self._raw.allto_all(src, dev.data_ptr() + nbytes, nbytes // self.size, _UINT8, self._handle, h)
        if send is not None:
            _cudart.copy_async(host.data_ptr(), src, nbytes, _cudart.D2H, h)
        _cudart.copy_async(host.data_ptr() + nbytes, dev.data_ptr() + nbytes, nbytes, _cudart.D2H, h)
        return self.end("all_to_all_v (count exchange)")

    def alltoall(self, send, recv) -> Request:
        h = self.begin(send, recv)
        n = send.numel() * send.element_size() // self.size
        if n:
            self._raw.allto_all(send.data_ptr(), recv.data_ptr(), n, _UINT8, self._handle, h)
        return self.end("alltoall")

    def allgather(self, send, recv) -> Request:
        h = self.begin(send, recv)
        n = send.numel() * send.element_size()
        if n:
            self._raw.all_gather(send.data_ptr(), recv.data_ptr(), n, _UINT8, self._handle, h)
        return self.end("all_gather")

    def allreduce(self, tensor, op) -> Request:
        if tensor.dtype not in _NCCL_DTYPES:
            raise TypeError(f"tensor: the NCCL backend cannot reduce dtype {tensor.dtype} (NCCL has no such type)")
        h = self.begin(tensor)
        if tensor.numel():
            p = tensor.data_ptr()
            self._raw.all_reduce(p, p, tensor.numel(), _NCCL_DTYPES[tensor.dtype], _NCCL_OPS[op], self._handle, h)
        return self.end("allreduce")

    def broadcast(self, tensor, root) -> Request:
        h = self.begin(tensor)
        n = tensor.numel() * tensor.element_size()
        if n:
            p = tensor.data_ptr()
            self._raw.broadcast(p, p, n, _UINT8, root, self._handle, h)
        return self.end("broadcast")

    def barrier(self) -> Request:
        # One kept zero, reduced with max: no allocation per barrier, and it stays zero.
        return self.allreduce(self._barrier_token, "max")

    def split(self, color: Optional[int], key: int, table: Sequence[Sequence[int]]) -> Optional["NcclBackend"]:
        self.check_health()
        torch.cuda.current_stream(self.device).synchronize()

        def split() -> Any:
            _cudart.set_device(self._index)
            return self._comm.split(color, key)

        try:
            sub = call_before_deadline(split, self.timeout_s, "ncclCommSplit", self.rank,
                                        afterwards="end this process")
        except TimeoutError as exc:
            # The split still runs on this communicator in the abandoned thread: nothing else may
            # use it, and neither destroying nor aborting it under that call is safe.
            self._watchdog.failure = exc
            self._aborted = True
            raise
        if color is None or not sub.ptr:
            return None
        backend = NcclBackend(sub, self.device, self.timeout_s)
        backend.connect_peers()
        return backend

    def close(self) -> None:
        self._watchdog.stop()
        if not self._aborted:
            self._comm.destroy()
        _cudart.destroy_event(self._ready)

    def abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        self._watchdog.stop()
        self._comm.abort()
