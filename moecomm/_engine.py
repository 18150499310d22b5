"""The engine under a :class:`moecomm.Communicator`: one backend, its staging pool, its
timeout, its count buffers, and the waits, count exchanges and flat row exchange that every
collective, the 2DH exchange (:mod:`moecomm.hierarchical`), the overlap pipeline
(:mod:`moecomm.overlap`) and the FP8 wire (:mod:`moecomm.wire`) are built from.

Internal: the communicator holds one engine (``comm.engine``) and hands it to those modules;
none of them touches another object's private members. Every wait has the engine's timeout
(``timeout``, seconds, or a per-call value), after which the engine is aborted.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ._dtypes import DTYPE_CODES, SUPPORTED_DTYPES
from ._peer_check import PeerCheck
from ._requests import CheckedRequest, RaiseAfter, ThenRequest, Work
from .backends.base import Backend, DoneRequest, Request
from .errors import CommunicatorClosedError, CountMismatchError
from .pool import StagingPool
from .splits import Splits, check_own_block, check_split_total, normalize_splits

__all__ = ["Engine", "PEER_ROW_ALIGN", "COPY_ENGINE_MIN_BYTES"]

PEER_ROW_ALIGN = 16
"""moecomm.backends.p2p.ROW_ALIGN (not imported: that module needs CUDA)."""

COPY_ENGINE_MIN_BYTES = 16 << 20
"""Default of ``init(p2p_min_bytes=)``: with peer memory, a plain ``all_to_all_v`` with known
counts moves by copy engines when a rank sends or receives at least this many bytes; below,
NCCL's grouped send/recv is as fast or faster (bench/results/README.md). The stages of
``scatter_compute_gather`` always use the copy engines: there, leaving the SMs to the
experts matters more."""


def _on_gpu(splits: Any) -> bool:
    return isinstance(splits, torch.Tensor) and splits.device.type != "cpu"


class Engine:
    """One backend with its pool, timeout and count buffers, and the primitives built on them.

    ``peer``: the peer-memory transport (:class:`moecomm.backends.p2p.PeerTransport`), made
    beforehand over an engine of the same backend without one; ``copy_engine_min_bytes``:
    see :data:`COPY_ENGINE_MIN_BYTES`. Sub-engines made by :meth:`split` with ``owned=True``
    (the hierarchy groups) are closed and aborted with this one.
    """

    def __init__(self, backend: Backend, pool: StagingPool, *, timeout: float, validate: bool,
                 peer: Any = None, copy_engine_min_bytes: int = COPY_ENGINE_MIN_BYTES) -> None:
        self.backend = backend
        self.pool = pool
        self.timeout = timeout
        self.validate = bool(validate)
        self.peer = peer
        self.copy_engine_min_bytes = int(copy_engine_min_bytes)
        # Records beside rows whose counts were given (moecomm._peer_check) also without
        # validate: off by default for their cost (README, "Bad input and faults"); a switch
        # for bench.alltoall --check-cost, which times them, and for tests.
        self.records_beside = False
        self.closed_as: Optional[str] = None  # "closed" or "aborted"
        self._abandoned: list = []
        self._counts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._owned: list[Engine] = []
        # fn on the peers' rows of scatter_compute_gather(own_first=True); made here, as it
        # may first be needed inside a CUDA graph capture
        self.peer_rows_stream = torch.cuda.Stream(backend.device) if backend.device.type == "cuda" else None

    # -- identity and state -------------------------------------------------------------------

    @property
    def timeout(self) -> float:
        """Seconds any wait may last (kept by the backend, whose own waits use it too)."""
        return self.backend.timeout_s

    @timeout.setter
    def timeout(self, value: float) -> None:
        value = float(value)
        if not value > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {value}")
        self.backend.timeout_s = value

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def size(self) -> int:
        return self.backend.size

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def closed(self) -> bool:
        return self.closed_as is not None

    def keep(self, obj: Any) -> None:
        """Keep ``obj`` (a request in flight and its buffers) referenced for the engine's life,
        so that a peer's late transfer never lands in freed memory."""
        self._abandoned.append(obj)

    def capturing(self) -> bool:
        """True while the current CUDA stream captures a graph."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def check_open(self, op: str) -> None:
        """Raise :class:`CommunicatorClosedError` (naming ``op``) if closed, or what the backend
        reports if it failed asynchronously (then the engine counts as aborted)."""
        if self.closed_as is not None:
            raise CommunicatorClosedError(f"moecomm: cannot run {op}: the communicator is {self.closed_as}")
        try:
            self.backend.check_health()
        except Exception:  # the backend failed asynchronously (a watchdog timeout, a CUDA error) and aborted
            self.closed_as = "aborted"
            raise

    def close(self) -> None:
        """Collective on NCCL: release the peer transport, the owned sub-engines and the backend."""
        if self.closed_as is None:
            if self.peer is not None:
                self.peer.close(self)
                self.peer = None
            self.closed_as = "closed"
            for sub in self._owned:
                sub.close()
            self.backend.close()

    def abort(self) -> None:
        """Tear down at once (owned sub-engines too); operations in flight are abandoned."""
        if self.closed_as is None or self.closed_as == "closed":
            self.closed_as = "aborted"
            for sub in self._owned:
                sub.abort()
            self.backend.abort()

    def split(self, color: Optional[int], key: int, *, owned: bool = False) -> tuple[Optional["Engine"], list[int]]:
        """Collective: an engine over the ranks that pass ``color`` (None: none), ordered by
        ``key`` then rank, with this one's timeout, validation and pool; and its members' ranks
        here. ``owned``: closed and aborted with this engine."""
        self.check_open("split")
        table = self.gather_ints([-1 if color is None else color, key], "split")
        sub_backend = self.backend.split(color, key, table)
        if color is None:
            return None, []
        members = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(table) if c == color)]
        sub = Engine(sub_backend, self.pool, timeout=self.timeout, validate=self.validate)
        if owned:
            self._owned.append(sub)
        return sub, members

    # -- buffers ------------------------------------------------------------------------------

    def staging(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """``count`` elements of pooled device memory for work on this engine's stream."""
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return self.pool.take(nbytes, self.device, id(self.backend)).view(dtype)

    def unstage(self, buf: torch.Tensor) -> None:
        """Give a buffer of :meth:`staging` back to the pool."""
        self.pool.give(buf, self.device, id(self.backend))

    def _count_buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This engine's own staging for ``n`` ints out and ``n`` in: ``[2 * n]`` int64 on
        the device and (pinned) on the host. Exchanges of ints block the host until done, so
        one pair per size serves every call (an explicit cache, keyed by ``n``)."""
        bufs = self._counts.get(n)
        if bufs is None:
            dev = torch.empty(2 * n, dtype=torch.int64, device=self.device)
            host = dev if self.device.type == "cpu" else torch.empty(2 * n, dtype=torch.int64, pin_memory=True)
            bufs = self._counts[n] = (dev, host)
        return bufs

    # -- checks -------------------------------------------------------------------------------

    def check_tensor(self, t: Any, name: str, *, min_dim: int, written: bool = False) -> torch.Tensor:
        """``t`` checked (ValueError/TypeError naming ``name``); an input that is a conjugate or
        negative view is returned resolved (a copy), an output (``written``) is refused."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{name} is a sparse tensor (layout {t.layout}); collectives move dense rows: "
                            f"call .to_dense() first")
        if t.is_conj() or t.is_neg():
            what = "a conjugate view (torch.conj)" if t.is_conj() else "a negative view (torch.conj of a real view)"
            if written:
                raise ValueError(f"{name} is {what}, which cannot be written as raw bytes: pass a tensor "
                                 f"that owns its values (.resolve_conj() / .resolve_neg() make one)")
            t = t.resolve_conj().resolve_neg()
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has unsupported dtype {t.dtype}; supported: {sorted(map(str, SUPPORTED_DTYPES))}")
        if t.dim() < min_dim:
            raise ValueError(f"{name} must have at least {min_dim} dimension(s) (rows along dim 0), got shape {tuple(t.shape)}")
        dev = self.device
        if t.device.type != dev.type or (dev.type == "cuda" and t.device.index != dev.index):
            raise ValueError(f"{name} must be on {dev} (the communicator's device), got a tensor on {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous()), got strides {t.stride()} for shape {tuple(t.shape)}")
        return t

    def check_count_tensor(self, counts: torch.Tensor, name: str) -> None:
        """A tensor of counts: integer, ``[size]``."""
        if counts.dtype.is_floating_point or counts.dtype == torch.bool or counts.dtype.is_complex:
            raise TypeError(f"{name} must be an integer tensor, got dtype {counts.dtype}")
        if counts.shape != (self.size,):
            raise ValueError(f"{name} must be 1-D with {self.size} entries, got shape {tuple(counts.shape)}")

    def check_recv_splits(self, recv_splits: Splits, x: torch.Tensor) -> list[int]:
        """``recv_splits`` as ints, refused where the output they describe could not exist."""
        recv = normalize_splits(recv_splits, "recv_splits", self.size)
        row_bytes = max(1, math.prod(x.shape[1:]) * x.element_size())
        limit = (1 << 62) // row_bytes
        if sum(recv) > limit:
            raise ValueError(f"recv_splits sums to {sum(recv)} rows of {row_bytes} bytes, beyond the {limit} rows "
                             f"(2**62 bytes) an output can hold: {recv}")
        return recv

    def check_exchanged_counts(self, send: list[int], recv: list[int], rows: int, sent: str) -> Optional[str]:
        """Counts from a GPU tensor, checked once they reach the host, after ``sent`` went out.
        A bad count aborts the engine (its peers have what was sent) and raises, unless
        ``validate``, where it is returned for the cross-check to raise on every rank."""
        try:
            check_split_total(send, rows, "send_splits", "input")
            for name, vals in (("send_splits", send), ("recv_splits (received)", recv)):
                if any(v < 0 for v in vals):
                    raise ValueError(f"{name} must be >= 0, got {vals}")
        except ValueError as exc:
            if not self.validate:
                self.abort()
                raise ValueError(f"{exc} (the communicator was aborted: peers had received {sent})") from None
            return str(exc)
        return None

    # -- small exchanges of ints (block the host) ---------------------------------------------

    def exchange_ints(self, values: Union[torch.Tensor, Sequence[int]], per_peer: int, op: str) -> tuple[list[int], list[int]]:
        """All-to-all of ``per_peer`` int64s with every rank (blocks the host until done).

        ``values`` holds ``size * per_peer`` ints, peer by peer (a host sequence or an integer
        tensor on any device). Returns (sent, received) as host lists in the same layout.
        """
        n = self.size * per_peer
        if n == 0:
            return [], []
        dev, host = self._count_buffers(n)
        if self.backend.stream_ordered:
            # One stream-ordered request: (the copy in,) the exchange and the copy to pinned memory.
            send: Optional[torch.Tensor] = None
            if not isinstance(values, torch.Tensor):
                host[:n] = torch.tensor(values, dtype=torch.int64)
            elif values.device.type == "cpu":
                host[:n].copy_(values.reshape(-1))
            elif values.dtype == torch.int64 and values.is_contiguous() and values.device == self.device:
                send = values.reshape(-1)  # the caller's own counts go out as they are
            else:
                send = dev[:n]
                send.copy_(values.reshape(-1), non_blocking=True)
            self.wait_host(self.backend.exchange_counts(send, dev, host), op, None)
        else:
            if isinstance(values, torch.Tensor):
                dev[:n].copy_(values.reshape(-1), non_blocking=True)
            else:
                dev[:n].copy_(torch.tensor(values, dtype=torch.int64))
            if self.size == 1:
                dev[n:].copy_(dev[:n])
            else:
                self.wait_host(self.backend.alltoall(dev[:n], dev[n:]), op, None)
            if host is not dev:
                host.copy_(dev)
        values_out = host.tolist()
        return values_out[:n], values_out[n:]

    def exchange_counts(self, send_splits: Union[torch.Tensor, list[int]], name: str) -> tuple[list[int], list[int]]:
        """One all-to-all of row counts; returns (send, recv) as host lists."""
        if isinstance(send_splits, torch.Tensor):
            self.check_count_tensor(send_splits, name)
        return self.exchange_ints(send_splits, 1, "all_to_all_v (count exchange)")

    def gather_ints(self, values: list[int], op: str) -> list[list[int]]:
        """All-gather a short list of ints from every rank (blocks the host)."""
        n = len(values)
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        table = torch.empty(self.size * n, dtype=torch.int64, device=self.device)
        self.wait_host(self.backend.allgather(mine, table), f"{op} (metadata)", None)
        flat = table.tolist()
        return [flat[r * n:(r + 1) * n] for r in range(self.size)]

    def max_int(self, value: int, op: str) -> int:
        """The largest ``value`` over all ranks (one allreduce, blocks the host)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.check_open(op)
        self.complete(self.backend.allreduce(t, "max"), op, None)
        return int(t.item())

    def barrier(self) -> None:
        """Return once every rank has entered the barrier (at most ``timeout`` seconds)."""
        self.check_open("barrier")
        self.wait_host(self.backend.barrier(), "barrier", None)

    def cross_check(self, op: str, send: list[int], recv: list[int], dtype: torch.dtype,
                    row_shape: tuple, problem: Optional[str]) -> None:
        """validate=True: every rank compares its counts with its peers' and all raise together."""
        w = self.size
        shape_code = hash(tuple(row_shape)) & 0x7FFFFFFF
        table = self.gather_ints(
            [0 if problem is None else 1, DTYPE_CODES.get(dtype, -1), shape_code] + list(send) + list(recv), op
        )
        issues: list[str] = []
        for r, row in enumerate(table):
            if row[0]:
                issues.append(f"rank {r} passed invalid arguments" + (f": {problem}" if r == self.rank else ""))
        ref = table[0]
        for r, row in enumerate(table):
            if row[1] != ref[1] or row[2] != ref[2]:
                issues.append(f"rank {r} passed a different dtype or row shape than rank 0 (rank {self.rank} has {dtype}, rows {tuple(row_shape)})")
        for src in range(w):
            for dst in range(w):
                sent = table[src][3 + dst]
                expected = table[dst][3 + w + src]
                if sent != expected:
                    issues.append(f"rank {src} sends {sent} rows to rank {dst}, which expects {expected}")
        if issues:
            shown = "; ".join(issues[:8]) + (f"; and {len(issues) - 8} more" if len(issues) > 8 else "")
            raise CountMismatchError(f"moecomm: {op} (validate=True) found ranks that disagree: {shown}")

    # -- the flat variable-length exchange ----------------------------------------------------

    def start_all_to_all_v(
        self, input: torch.Tensor, send_splits: Splits, recv_splits: Optional[Splits]
    ) -> tuple[torch.Tensor, list[int], list[int], Request]:
        """The flat ``all_to_all_v``: validate, learn the counts and issue the exchange.
        Returns (output, send, recv, request); see ``Communicator.all_to_all_v``."""
        op = "all_to_all_v"
        self.check_open(op)
        x = self.check_tensor(input, "input", min_dim=1)
        rows, row_shape = x.shape[0], tuple(x.shape[1:])
        problem: Optional[str] = None
        records: Optional[tuple] = None
        if (recv_splits is None or _on_gpu(send_splits) or _on_gpu(recv_splits)) and self.capturing():
            raise RuntimeError(f"{op}: recv_splits must be given, and both splits on the host (ints, numpy or "
                               f"CPU tensors), while a CUDA graph is captured: reading counts from the GPU or "
                               f"exchanging them needs the host, which a captured graph cannot involve")
        device_counts = (
            recv_splits is None and isinstance(send_splits, torch.Tensor) and send_splits.device.type != "cpu"
        )
        row_bytes = math.prod(row_shape) * x.element_size()
        if device_counts and self.peer is not None and row_bytes > 0 and row_bytes % PEER_ROW_ALIGN == 0:
            return self._start_peer_exchange(x, send_splits, row_bytes)
        if device_counts:
            self.check_count_tensor(send_splits, "send_splits")
            check = PeerCheck(op, self.rank, [[0]] * self.size, None, x.dtype, row_shape)
            send, recv, issues, stuck = self.exchange_records(check, send_splits)
            problem = self.check_exchanged_counts(send, recv, rows, "the counts")
        else:
            send = normalize_splits(send_splits, "send_splits", self.size)
            check_split_total(send, rows, "send_splits", "input")
            if recv_splits is None:
                check = PeerCheck(op, self.rank, [[c] for c in send], None, x.dtype, row_shape)
                send, recv, issues, stuck = self.exchange_records(check)
            else:
                recv = self.check_recv_splits(recv_splits, x)
                check = PeerCheck(op, self.rank, [[c] for c in send], [[c] for c in recv], x.dtype, row_shape)
                issues, stuck = None, False
                records = self.start_records(check)  # (validate=True) compared beside the rows
        try:
            if self.validate:
                self.cross_check(op, send, recv, x.dtype, row_shape, problem)
            out = torch.empty((sum(recv),) + row_shape, dtype=x.dtype, device=x.device)
            request = self.alltoallv(x, send, out, recv, check=check, issues=issues, stuck=stuck, records=records)
        except BaseException:
            self.settle(records)
            raise
        return out, send, recv, request

    def start_records(self, check: PeerCheck) -> Optional[tuple]:
        """With ``validate``: send ``check``'s records (counts were given, so no count exchange
        carried them), before anything else of the call, as a call without ``recv_splits``
        exchanges its counts first. Host backends: non-blocking, ``(request, mine, theirs)``;
        NCCL: exchanged at once (validate=True blocks the host anyway). None: not sent."""
        if self.size == 1 or not (self.validate or self.records_beside):
            return None
        if self.backend.stream_ordered:
            _, got = self.exchange_ints(check.record(), check.per_peer, f"{check.op} (count records)")
            return DoneRequest(), None, torch.tensor(got, dtype=torch.int64)
        mine = torch.tensor(check.record(), dtype=torch.int64)
        theirs = torch.empty_like(mine)
        return self.backend.alltoall(mine, theirs), mine, theirs

    def settle(self, records: Optional[tuple]) -> None:
        """Records from :meth:`start_records` that no request took over (the call failed
        after sending them): wait for them, as every rank sends its records first, so that
        MPI never writes into freed memory; past the timeout they are kept referenced."""
        if records is None:
            return
        try:
            self.wait_host(records[0], "count records (of a call that failed)", None)
        except BaseException:  # noqa: BLE001 - the caller's error is the one to report
            self.keep(records)

    def exchange_records(self, check: PeerCheck, counts: Optional[torch.Tensor] = None
                         ) -> tuple[list[int], list[int], list[str], bool]:
        """The count exchange of a call without ``recv_splits``: every rank's records
        (:mod:`moecomm._peer_check`), blocking. Returns (send, recv, disagreements) with one
        count per peer, and whether some rows could never arrive; ``counts`` (a count tensor, any
        device) replaces ``check.sent``."""
        values: Any = check.record() if counts is None else check.record_tensor(counts)
        mine, got = self.exchange_ints(values, check.per_peer, f"{check.op} (count exchange)")
        n = check.per_peer
        if counts is not None:
            check.sent = [[mine[p * n]] for p in range(self.size)]
        theirs, issues, stuck = check.compare(got)
        return [s[0] for s in check.sent], [t[0] for t in theirs], issues, stuck

    def _start_peer_exchange(self, x: torch.Tensor, counts: torch.Tensor,
                             row_bytes: int) -> tuple[torch.Tensor, list[int], list[int], Request]:
        """``all_to_all_v`` with the counts on the GPU through peer memory (``init(p2p_bytes=)``):
        the rows move with the counts, in one round (see :mod:`moecomm.backends.p2p`)."""
        op = "all_to_all_v"
        self.check_count_tensor(counts, "send_splits")
        c = counts.to(device=self.device, dtype=torch.int64).contiguous()  # the kernels read them on this GPU
        if x.data_ptr() % PEER_ROW_ALIGN:
            x = x.clone()  # the kernels move 16-byte vectors
        request = self.peer.start(x, c, row_bytes)
        self.wait_host(request, f"{op} (peer memory)", None)
        send, recv, timed_out = self.peer.counts()
        if timed_out:
            self.abort()
            raise TimeoutError(f"moecomm: {op} (peer memory) did not receive every rank's rows within "
                               f"{self.timeout:g} s on rank {self.rank}; the communicator was aborted")
        problem = self.check_exchanged_counts(send, recv, x.shape[0], "the rows")
        if self.validate:
            self.cross_check(op, send, recv, x.dtype, tuple(x.shape[1:]), problem)
        out = torch.empty((sum(recv),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        request.join()  # (the kernels ran on the caller's stream: nothing to order)
        return out, send, recv, self.peer.finish(x, out, send, recv, row_bytes)

    def alltoallv(self, x: torch.Tensor, send: list[int], out: torch.Tensor, recv: list[int],
                  check: Optional[PeerCheck] = None, issues: Optional[list[str]] = None,
                  records: Optional[tuple] = None, stuck: bool = False) -> Request:
        """Issue the rows. ``check``: the records of this exchange; ``issues``: what the count
        exchange that carried them found, or ``records``: the records in flight from
        :meth:`start_records`, compared once they and the rows complete (before the rows where
        the backend cannot complete disagreeing rows). Neither: the counts are not checked."""
        check_own_block(send, recv, self.rank)  # before anything moves
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        host = not self.backend.stream_ordered
        complete = self.backend.mismatched_rows_complete
        beside = records
        if beside is not None and not complete:
            # gloo aborts the process on rows of another size than expected: compare first.
            self.wait_host(beside[0], f"{check.op} (count records)", None)
            _, issues, stuck = check.compare(beside[2].tolist())
            beside = None
        if issues and (stuck or not complete):
            # Rows that could never arrive (a side that sends or expects none posts nothing),
            # or a backend that cannot complete rows of disagreeing sizes (gloo, NCCL): raise
            # before the rows and abort; peers waiting for this rank's rows time out.
            self.abort()
            raise check.error(issues, moved=False, aborted=True)
        if row_bytes == 0:
            # Host backends still run the row exchange (empty), so that every rank issues the
            # same collectives whatever the others' rows; NCCL has no matching to keep.
            if host and self.size > 1:
                request = self.backend.alltoallv(x, [0] * self.size, out, [0] * self.size, 1)
            else:
                request = self.backend.barrier() if self.size > 1 else DoneRequest()
        elif self.peer is not None and max(sum(send), sum(recv)) * row_bytes >= self.copy_engine_min_bytes:
            request = self.peer.exchange(x, send, None, out, recv, None, row_bytes)
        else:
            request = self.backend.alltoallv(x, send, out, recv, row_bytes)
        if beside is not None:
            return CheckedRequest(self, request, check, *beside)
        if issues:
            return RaiseAfter(request, check.error(issues, moved=True))
        return request

    # -- completion ---------------------------------------------------------------------------

    def then(self, request: Request, then: Callable[[], Any]) -> Request:
        """``request``, running ``then`` once its results are usable."""
        return ThenRequest(request, then, self.backend.stream_ordered)

    def finish(self, request: Request, op: str, result: Any, async_op: bool,
               then: Optional[Callable[[], Any]] = None) -> Any:
        """``result`` once ``request`` completes, or a :class:`Work` for it (``async_op``)."""
        if then is not None:
            request = self.then(request, then)
        if async_op:
            return Work(self, request, op, result)
        self.complete(request, op, None)
        return result

    def complete(self, request: Request, op: str, timeout: Optional[float]) -> None:
        """Make the results usable: on a GPU order the current stream (a ``timeout`` given
        puts the work under the backend's watchdog with it), else wait on the host."""
        if self.backend.stream_ordered:
            request.join()
            if timeout is not None and not self.capturing():
                self.backend.watch_stream(op, float(timeout))
        else:
            self.wait_host(request, op, timeout)

    def wait_host(self, request: Request, op: str, timeout: Optional[float]) -> None:
        """Block the host until ``request`` completes, at most ``timeout`` seconds (default: the
        engine's); past it, the engine is aborted and ``TimeoutError`` raised naming ``op``."""
        if self.capturing():  # nothing captured runs before the replay: the wait could only time out
            raise RuntimeError(f"moecomm: {op} waits on the host, which a CUDA graph capture cannot include "
                               f"(collectives in a capture need their counts known on the host: pass recv_splits)")
        if request.test():
            return
        limit = self.timeout if timeout is None else float(timeout)
        start = time.monotonic()
        deadline = start + limit
        test = request.test
        if self.backend.progress_on_test:
            # MPI moves large messages only while it is polled (as MPI_Wait does): poll in a
            # tight loop that yields the core, and look at the clock every 64 polls.
            while True:
                for _ in range(64):
                    if test():
                        return
                    os.sched_yield()
                if time.monotonic() > deadline:
                    self._time_out(request, op, limit)
        pause = 0.0
        while not test():
            now = time.monotonic()
            if now > deadline:
                self._time_out(request, op, limit)
            self.check_open(op)
            # Other backends progress on their own: yield for 5 ms, then sleep up to 1 ms.
            if now - start < 5e-3:
                os.sched_yield()
            else:
                pause = min(1e-3, pause * 2 if pause else 5e-5)
                time.sleep(pause)

    def _time_out(self, request: Request, op: str, limit: float) -> None:
        self.keep(request)
        self.abort()
        raise TimeoutError(
            f"moecomm: {op} did not complete within {limit:g} s on rank {self.rank} "
            f"(backend {self.backend.name}); the communicator was aborted"
        )
