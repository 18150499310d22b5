"""The :class:`Communicator`: variable-length collectives over one backend."""

from __future__ import annotations

import math
import os
import time
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ._peer_check import PeerCheck
from .backends._p2p_limits import ROW_ALIGN as _P2P_ROW_ALIGN
from .backends.base import REDUCE_OPS, Backend, DoneRequest, Request
from .errors import CommunicatorClosedError, CountMismatchError
from .layout import Layout
from .pool import PoolStats, StagingPool
from .splits import Splits, check_own_block, check_split_total, normalize_splits

__all__ = ["Communicator", "Work", "SUPPORTED_DTYPES"]


def _on_gpu(splits: Any) -> bool:
    return isinstance(splits, torch.Tensor) and splits.device.type != "cpu"


def _float8_dtypes() -> tuple:
    names = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    return tuple(getattr(torch, n) for n in names if hasattr(torch, n))


SUPPORTED_DTYPES: frozenset = frozenset(
    (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
     torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool) + _float8_dtypes()
)
"""Dtypes every collective moves (as raw bytes, so bit for bit)."""

_DTYPE_CODES = {dt: i for i, dt in enumerate(sorted(SUPPORTED_DTYPES, key=str))}
# With peer memory (init(p2p_bytes=)), a plain all_to_all_v with known counts moves by copy
# engines when a rank sends or receives at least this many bytes; below, NCCL's grouped
# send/recv is as fast or faster (2 x H200: bench/results/h200x2/alltoall_ce.json). The
# stages of scatter_compute_gather always use the copy engines: there, leaving the SMs to
# the experts matters more.
_P2P_COPY_ENGINE_MIN_BYTES = 16 << 20


class Work:
    """A collective in flight, returned by ``async_op=True``.

    ``wait()`` returns the operation's result. On a GPU it orders the caller's current
    stream after the collective without blocking the host (torch.distributed's semantics);
    on the CPU it blocks until the data has arrived, at most ``timeout`` seconds.
    """

    __slots__ = ("_comm", "_request", "_op", "_result", "_done")

    def __init__(self, comm: "Communicator", request: Request, op: str, result: Any) -> None:
        self._comm = comm
        self._request = request
        self._op = op
        self._result = result
        self._done = False

    def is_completed(self) -> bool:
        """True once the data has arrived (never blocks)."""
        return self._request.test()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Make the result usable and return it; ``timeout`` in seconds (default: the communicator's)."""
        if not self._done:
            self._comm._complete(self._request, self._op, timeout)
            self._done = True
        return self._result

    def synchronize(self, timeout: Optional[float] = None) -> Any:
        """Block the host until the data has arrived, on any backend; then as :meth:`wait`."""
        self._comm._wait_host(self._request, self._op, timeout)
        return self.wait(timeout)


class Communicator:
    """Variable-length collectives among ``size`` ranks, over MPI, NCCL or torch.distributed.

    Made by :func:`moecomm.init` (or :meth:`split`); not constructed directly. Every method
    is collective: all ranks of the communicator call it in the same order.

    Attributes:
        rank, size: this rank and the number of ranks.
        backend: ``"mpi"``, ``"nccl"``, ``"torch"`` or ``"self"`` (one process).
        device: where tensors must live (``cpu`` or this rank's ``cuda:N``).
        local_rank, local_size, node_rank, num_nodes: the node layout (from host names, or
            from the ``local_size=`` override).
        timeout: seconds any wait may last before the communicator is aborted.
        validate: check that ranks agree on counts, dtype and row shape on every exchange,
            before anything moves (without it, only exchanges that exchange counts are checked).
    """

    def __init__(
        self,
        backend: Backend,
        layout: Layout,
        *,
        timeout: float,
        validate: bool,
        pool: StagingPool,
    ) -> None:
        self._backend = backend
        self.layout = layout
        self.timeout = float(timeout)
        self.validate = bool(validate)
        self._pool = pool
        self._closed: Optional[str] = None
        self._abandoned: list[Request] = []
        self._counts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Records beside rows whose counts were given (moecomm._peer_check) also without
        # validate: off by default for their cost (README, "Bad input and faults"); a private
        # switch for bench.alltoall --check-cost, which times them.
        self._records_beside = False
        self._hier: Any = None  # moecomm.hierarchical.TopologyState, set by init (hierarchy=, profile=)
        self._p2p: Any = None  # moecomm.backends.p2p.PeerTransport, set by init (p2p_bytes=)
        # see _peer_rows_stream; made here, as it may first be needed inside a CUDA graph capture
        self._peer_stream = torch.cuda.Stream(backend.device) if backend.device.type == "cuda" else None

    # -- identity ---------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._backend.rank

    @property
    def size(self) -> int:
        return self._backend.size

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def device(self) -> torch.device:
        return self._backend.device

    @property
    def local_rank(self) -> int:
        return self.layout.local_rank

    @property
    def local_size(self) -> int:
        return self.layout.local_size

    @property
    def node_rank(self) -> int:
        return self.layout.node_rank

    @property
    def num_nodes(self) -> int:
        return self.layout.num_nodes

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def __repr__(self) -> str:
        state = f", closed ({self._closed})" if self._closed else ""
        return (
            f"<moecomm.Communicator rank={self.rank}/{self.size} backend={self.backend} "
            f"device={self.device} nodes={self.num_nodes}x{self.local_size}{state}>"
        )

    def pool_stats(self) -> PoolStats:
        """Counters of the staging-buffer pool (bytes and hits/misses)."""
        return self._pool.stats()

    # -- the variable-length all-to-all -----------------------------------------------------

    def all_to_all_v(
        self,
        input: torch.Tensor,
        send_splits: Splits,
        recv_splits: Optional[Splits] = None,
        *,
        async_op: bool = False,
        algorithm: str = "flat",
        wire_dtype: Optional[torch.dtype] = None,
    ) -> Union[tuple[torch.Tensor, list[int]], Work]:
        """Send rows of ``input`` to every rank, ``send_splits[p]`` rows to rank ``p``.

        Args:
            input: ``[N, *row_shape]`` on :attr:`device`, contiguous; rows grouped by
                destination rank in rank order.
            send_splits: ``size`` row counts summing to ``N``: a sequence of ints or a 1-D
                integer tensor (on the CPU or on the GPU, as MoE code has them).
            recv_splits: the ``size`` row counts this rank receives, if known; otherwise they
                are exchanged first (one small all-to-all, the call then blocks the host
                until the counts have arrived).
            async_op: return a :class:`Work` whose ``wait()`` gives the result.
            algorithm: ``"flat"`` (one all-to-all), ``"2dh"`` (hierarchical: inside the
                node, then along the rail; needs ``init(hierarchy=True)`` or a multi-node
                layout) or ``"auto"`` (the topology profile's choice for this size); the
                same result either way. See :mod:`moecomm.hierarchical`.
            wire_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``: rows of a
                float32/bfloat16/float16 ``input`` travel quantized to it, in blocks of 128
                elements with a float32 scale each, and ``output`` is dequantized back to
                ``input.dtype``: exactly :func:`moecomm.quant.quantize_rows` then
                :func:`moecomm.quant.dequantize_rows`, on every path (see :mod:`moecomm.wire`).
                Non-finite values give undefined results (``validate=True`` refuses them).

        Returns:
            ``(output, recv_splits)``: ``output`` is ``[sum(recv_splits), *row_shape]`` with
            the rows from rank ``p`` in block ``p``; ``recv_splits`` a list of ints.

        Raises:
            TypeError, ValueError: bad tensors, splits, ``algorithm`` or ``wire_dtype`` (not an
                FP8 dtype, or ``input`` not floating), named, before anything is sent; with
                ``validate=True`` also non-finite rows under ``wire_dtype`` (on every rank).
                A conjugate or negative view is resolved first (a copy); sparse tensors are
                refused. An input that requires grad warns: use :mod:`moecomm.functional`.
            CountMismatchError: a peer sends another count than ``recv_splits`` says, expects
                another than ``send_splits`` says, or moves another dtype or row shape; raised
                on both ranks of each such pair, at completion (``wait()`` when ``async_op``),
                before it where rows could never arrive (then the communicator is aborted).
            TimeoutError: a wait outlived the communicator's timeout (it is aborted).
        """
        _warn_if_graph_lost(input, "all_to_all_v")
        if wire_dtype is not None:
            from .wire import start_all_to_all_v as start_wire

            out, _, recv, request, _ = start_wire(self, input, send_splits, recv_splits, algorithm, wire_dtype)
            return self._finish(request, "all_to_all_v", (out, recv), async_op)
        out, _, recv, request = self._start_all_to_all_v(input, send_splits, recv_splits, algorithm=algorithm)
        return self._finish(request, "all_to_all_v", (out, recv), async_op)

    def _start_all_to_all_v(
        self, input: torch.Tensor, send_splits: Splits, recv_splits: Optional[Splits], *, algorithm: str = "flat"
    ) -> tuple[torch.Tensor, list[int], list[int], Request]:
        """Validate, learn the counts and issue the exchange: (output, send, recv, request)."""
        if algorithm != "flat":
            from . import hierarchical

            return hierarchical.start_all_to_all_v(self, input, send_splits, recv_splits, algorithm)
        op = "all_to_all_v"
        self._check_open(op)
        x = self._check_tensor(input, "input", min_dim=1)
        rows, row_shape = x.shape[0], tuple(x.shape[1:])
        problem: Optional[str] = None
        records: Optional[tuple] = None
        if (recv_splits is None or _on_gpu(send_splits) or _on_gpu(recv_splits)) and self._capturing():
            raise RuntimeError(f"{op}: recv_splits must be given, and both splits on the host (ints, numpy or "
                               f"CPU tensors), while a CUDA graph is captured: reading counts from the GPU or "
                               f"exchanging them needs the host, which a captured graph cannot involve")
        device_counts = (
            recv_splits is None and isinstance(send_splits, torch.Tensor) and send_splits.device.type != "cpu"
        )
        row_bytes = math.prod(row_shape) * x.element_size()
        if device_counts and self._p2p is not None and row_bytes > 0 and row_bytes % _P2P_ROW_ALIGN == 0:
            return self._start_peer_exchange(x, send_splits, row_bytes)
        if device_counts:
            self._check_count_tensor(send_splits, "send_splits")
            check = PeerCheck(op, self.rank, [[0]] * self.size, None, x.dtype, row_shape)
            send, recv, issues, stuck = self._exchange_records(check, send_splits)
            problem = self._check_exchanged_counts(send, recv, rows, "the counts")
        else:
            send = normalize_splits(send_splits, "send_splits", self.size)
            check_split_total(send, rows, "send_splits", "input")
            if recv_splits is None:
                check = PeerCheck(op, self.rank, [[c] for c in send], None, x.dtype, row_shape)
                send, recv, issues, stuck = self._exchange_records(check)
            else:
                recv = self._recv_splits(recv_splits, x)
                check = PeerCheck(op, self.rank, [[c] for c in send], [[c] for c in recv], x.dtype, row_shape)
                issues, stuck = None, False
                records = self._start_records(check)  # (validate=True) compared beside the rows
        try:
            if self.validate:
                self._cross_check(op, send, recv, x.dtype, row_shape, problem)
            out = torch.empty((sum(recv),) + row_shape, dtype=x.dtype, device=x.device)
            request = self._alltoallv(x, send, out, recv, check=check, issues=issues, stuck=stuck, records=records)
        except BaseException:
            self._settle(records)
            raise
        return out, send, recv, request

    def _start_records(self, check: PeerCheck) -> Optional[tuple]:
        """With ``validate``: send ``check``'s records (counts were given, so no count exchange
        carried them), before anything else of the call, as a call without ``recv_splits``
        exchanges its counts first. Host backends: non-blocking, ``(request, mine, theirs)``;
        NCCL: exchanged at once (validate=True blocks the host anyway). None: not sent."""
        if self.size == 1 or not (self.validate or self._records_beside):
            return None
        if self._backend.stream_ordered:
            _, got = self._exchange_ints(check.record(), check.per_peer, f"{check.op} (count records)")
            return DoneRequest(), None, torch.tensor(got, dtype=torch.int64)
        mine = torch.tensor(check.record(), dtype=torch.int64)
        theirs = torch.empty_like(mine)
        return self._backend.alltoall(mine, theirs), mine, theirs

    def _settle(self, records: Optional[tuple]) -> None:
        """Records from :meth:`_start_records` that no request took over (the call failed
        after sending them): wait for them, as every rank sends its records first, so that
        MPI never writes into freed memory; past the timeout they are kept referenced."""
        if records is None:
            return
        try:
            self._wait_host(records[0], "count records (of a call that failed)", None)
        except BaseException:  # noqa: BLE001 - the caller's error is the one to report
            self._abandoned.append(records)

    def _recv_splits(self, recv_splits: Splits, x: torch.Tensor) -> list[int]:
        """``recv_splits`` as ints, refused where the output they describe could not exist."""
        recv = normalize_splits(recv_splits, "recv_splits", self.size)
        row_bytes = max(1, math.prod(x.shape[1:]) * x.element_size())
        limit = (1 << 62) // row_bytes
        if sum(recv) > limit:
            raise ValueError(f"recv_splits sums to {sum(recv)} rows of {row_bytes} bytes, beyond the {limit} rows "
                             f"(2**62 bytes) an output can hold: {recv}")
        return recv

    def _exchange_records(self, check: PeerCheck, counts: Optional[torch.Tensor] = None
                          ) -> tuple[list[int], list[int], list[str], bool]:
        """The count exchange of a call without ``recv_splits``: every rank's records
        (:mod:`moecomm._peer_check`), blocking. Returns (send, recv, disagreements) with one
        count per peer, and whether some rows could never arrive; ``counts`` (a count tensor, any
        device) replaces ``check.sent``."""
        values: Any = check.record() if counts is None else check.record_tensor(counts)
        mine, got = self._exchange_ints(values, check.per_peer, f"{check.op} (count exchange)")
        n = check.per_peer
        if counts is not None:
            check.sent = [[mine[p * n]] for p in range(self.size)]
        theirs, issues, stuck = check.compare(got)
        return [s[0] for s in check.sent], [t[0] for t in theirs], issues, stuck

    def _check_exchanged_counts(self, send: list[int], recv: list[int], rows: int, sent: str) -> Optional[str]:
        """Counts from a GPU tensor, checked once they reach the host, after ``sent`` went out.
        A bad count aborts the communicator (its peers have what was sent) and raises, unless
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

    def _start_peer_exchange(self, x: torch.Tensor, counts: torch.Tensor,
                             row_bytes: int) -> tuple[torch.Tensor, list[int], list[int], Request]:
        """``all_to_all_v`` with the counts on the GPU through peer memory (``init(p2p_bytes=)``):
        the rows move with the counts, in one round (see :mod:`moecomm.backends.p2p`)."""
        op = "all_to_all_v"
        self._check_count_tensor(counts, "send_splits")
        c = counts.to(device=self.device, dtype=torch.int64).contiguous()  # the kernels read them on this GPU
        if x.data_ptr() % _P2P_ROW_ALIGN:
            x = x.clone()  # the kernels move 16-byte vectors
        request = self._p2p.start(x, c, row_bytes)
        self._wait_host(request, f"{op} (peer memory)", None)
        send, recv, timed_out = self._p2p.counts()
        if timed_out:
            self.abort()
            raise TimeoutError(f"moecomm: {op} (peer memory) did not receive every rank's rows within "
                               f"{self.timeout:g} s on rank {self.rank}; the communicator was aborted")
        problem = self._check_exchanged_counts(send, recv, x.shape[0], "the rows")
        if self.validate:
            self._cross_check(op, send, recv, x.dtype, tuple(x.shape[1:]), problem)
        out = torch.empty((sum(recv),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        request.join()  # (the kernels ran on the caller's stream: nothing to order)
        return out, send, recv, self._p2p.finish(x, out, send, recv, row_bytes)

    def _alltoallv(self, x: torch.Tensor, send: list[int], out: torch.Tensor, recv: list[int],
                   check: Optional[PeerCheck] = None, issues: Optional[list[str]] = None,
                   records: Optional[tuple] = None, stuck: bool = False) -> Request:
        """Issue the rows. ``check``: the records of this exchange; ``issues``: what the count
        exchange that carried them found, or ``records``: the records in flight from
        :meth:`_start_records`, compared once they and the rows complete (before the rows where
        the backend cannot complete disagreeing rows). Neither: the counts are not checked."""
        check_own_block(send, recv, self.rank)  # before anything moves
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        host = not self._backend.stream_ordered
        complete = self._backend.mismatched_rows_complete
        beside = records
        if beside is not None and not complete:
            # gloo aborts the process on rows of another size than expected: compare first.
            self._wait_host(beside[0], f"{check.op} (count records)", None)
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
                request = self._backend.alltoallv(x, [0] * self.size, out, [0] * self.size, 1)
            else:
                request = self._backend.barrier() if self.size > 1 else DoneRequest()
        elif self._p2p is not None and max(sum(send), sum(recv)) * row_bytes >= _P2P_COPY_ENGINE_MIN_BYTES:
            request = self._p2p.exchange(x, send, None, out, recv, None, row_bytes)
        else:
            request = self._backend.alltoallv(x, send, out, recv, row_bytes)
        if beside is not None:
            return _CheckedRequest(self, request, check, *beside)
        if issues:
            return _RaiseAfter(request, check.error(issues, moved=True))
        return request

    # -- all-to-all overlapped with compute -------------------------------------------------

    def scatter_compute_gather(
        self,
        input: torch.Tensor,
        send_splits: Splits,
        fn: Callable[[torch.Tensor, Any], torch.Tensor],
        *,
        degree: Union[int, str] = 2,
        recv_splits: Optional[Splits] = None,
        algorithm: Optional[str] = None,
        own_first: bool = False,
        own_split: float = 0.3,
        wire_dtype: Optional[torch.dtype] = None,
    ) -> torch.Tensor:
        """``all_to_all_v -> fn -> all_to_all_v`` back, pipelined in ``degree`` chunks per peer.

        ``fn(rows, chunk)`` runs on each chunk as it arrives (rows grouped by source rank,
        ``chunk`` a :class:`moecomm.overlap.Chunk`) while later chunks are in flight; each
        result is sent back as soon as it is ready. Returns ``[N, *fn_out_shape]`` in
        ``input``'s row order, exactly the non-overlapped result; differentiable (the backward
        is pipelined too). ``degree``: 1..16 or ``"auto"``. ``own_first``: ``fn`` runs first
        on the rank's own rows (which need no exchange and are not copied) while the peers'
        rows are in flight, forward and backward; ``own_split`` of them first, the rest last,
        while the peers' results travel home. ``wire_dtype``: the input's rows travel in that FP8
        dtype, as in :meth:`all_to_all_v` (results in their own dtype). See :mod:`moecomm.overlap`.
        """
        from .overlap import scatter_compute_gather

        kw = {} if wire_dtype is None else {"wire_dtype": wire_dtype}
        return scatter_compute_gather(self, input, send_splits, fn, degree=degree, recv_splits=recv_splits,
                                      algorithm=algorithm, own_first=own_first, own_split=own_split, **kw)

    def _peer_rows_stream(self) -> "torch.cuda.Stream":
        """The communicator's stream for ``fn`` on the peers' rows in ``scatter_compute_gather(...,
        own_first=True)`` (the caller's stream meanwhile works on the rank's own rows)."""
        if self._peer_stream is None:
            raise RuntimeError(f"moecomm: a communicator on {self.device} has no CUDA streams")
        return self._peer_stream

    # -- torch.distributed-compatible all-to-all --------------------------------------------

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Optional[Splits] = None,
        input_split_sizes: Optional[Splits] = None,
        async_op: bool = False,
    ) -> Optional[Work]:
        """``torch.distributed.all_to_all_single`` with its arguments and semantics.

        ``output`` is filled in place; split sizes of ``None`` mean equal blocks along dim 0.
        Returns a :class:`Work` (whose ``wait()`` returns True) when ``async_op``, else None.

        Raises:
            TypeError, ValueError: bad tensors or split sizes, named (``output`` when its size
                cannot hold what ``input`` sends this rank itself), before anything is sent.
            CountMismatchError: as :meth:`all_to_all_v` (a peer disagrees on a block's size).
        """
        op = "all_to_all_single"
        self._check_open(op)
        _warn_if_graph_lost(input, op)
        x = self._check_tensor(input, "input", min_dim=1)
        y = self._check_tensor(output, "output", min_dim=1, written=True)
        if y.dtype != x.dtype:
            raise TypeError(f"output must have input's dtype {x.dtype}, got {y.dtype}")
        if math.prod(y.shape[1:]) != math.prod(x.shape[1:]):
            raise ValueError(
                f"output rows must hold as many elements as input rows ({math.prod(x.shape[1:])}, "
                f"input shape {tuple(x.shape)}), got output shape {tuple(y.shape)}"
            )
        send = self._split_sizes(input_split_sizes, x, "input_split_sizes", "input")
        recv = self._split_sizes(output_split_sizes, y, "output_split_sizes", "output")
        r = self.rank
        if send[r] != recv[r]:
            raise ValueError(
                f"output (shape {tuple(y.shape)}) must hold, in block {r}, the {send[r]} rows input sends rank {r} "
                f"itself (input_split_sizes{'=None: equal blocks' if input_split_sizes is None else ''}), but "
                f"output_split_sizes{'=None: equal blocks' if output_split_sizes is None else ''} gives block {r} "
                f"{recv[r]} rows")
        check = PeerCheck(op, self.rank, [[c] for c in send], [[c] for c in recv], x.dtype, (math.prod(x.shape[1:]),))
        records = self._start_records(check)
        try:
            if self.validate:
                self._cross_check(op, send, recv, x.dtype, (math.prod(x.shape[1:]),), None)
            request = self._alltoallv(x, send, y, recv, check=check, records=records)
        except BaseException:
            self._settle(records)
            raise
        return self._finish(request, op, True, async_op) if async_op else self._finish(request, op, None, False)

    def all_to_all(
        self,
        output_tensor_list: Sequence[torch.Tensor],
        input_tensor_list: Sequence[torch.Tensor],
        async_op: bool = False,
    ) -> Optional[Work]:
        """``torch.distributed.all_to_all``: ``input_tensor_list[p]`` goes to rank ``p``,
        ``output_tensor_list[p]`` is filled from rank ``p``; any shapes, one dtype.

        Raises:
            TypeError, ValueError: bad lists or tensors, named, before anything is sent.
            CountMismatchError: a slot's size (in bytes) differs from what its peer sends,
                or a peer sends another dtype; on both ranks of the pair.
        """
        op = "all_to_all"
        self._check_open(op)
        for t in input_tensor_list if isinstance(input_tensor_list, (list, tuple)) else ():
            _warn_if_graph_lost(t, op)
        for name, lst in (("output_tensor_list", output_tensor_list), ("input_tensor_list", input_tensor_list)):
            if not isinstance(lst, (list, tuple)) or len(lst) != self.size:
                raise ValueError(f"{name} must be a list of {self.size} tensors (one per rank), got {type(lst).__name__}"
                                 + (f" of length {len(lst)}" if isinstance(lst, (list, tuple)) else ""))
        ins = [self._check_tensor(t, f"input_tensor_list[{i}]", min_dim=0) for i, t in enumerate(input_tensor_list)]
        outs = [self._check_tensor(t, f"output_tensor_list[{i}]", min_dim=0, written=True)
                for i, t in enumerate(output_tensor_list)]
        dtype = ins[0].dtype
        for i, t in enumerate(ins + outs):
            if t.dtype != dtype:
                name = f"input_tensor_list[{i}]" if i < self.size else f"output_tensor_list[{i - self.size}]"
                raise TypeError(f"{name} must have dtype {dtype} like input_tensor_list[0], got {t.dtype}")
        esize = ins[0].element_size()
        send = [t.numel() * esize for t in ins]
        recv = [t.numel() * esize for t in outs]
        check = PeerCheck(op, self.rank, [[c] for c in send], [[c] for c in recv], dtype, (), unit="bytes")
        records = self._start_records(check)
        try:
            if self.validate:
                self._cross_check(op, send, recv, torch.uint8, (1,), None)
            packed = torch.cat([t.reshape(-1).view(torch.uint8) for t in ins]) if sum(send) else \
                torch.empty(0, dtype=torch.uint8, device=self.device)
            landing = torch.empty(sum(recv), dtype=torch.uint8, device=self.device)
            request = self._alltoallv(packed, send, landing, recv, check=check, records=records)
        except BaseException:
            self._settle(records)
            raise

        def unpack() -> None:
            offset = 0
            for t, n in zip(outs, recv):
                t.reshape(-1).view(torch.uint8).copy_(landing[offset:offset + n])
                offset += n

        return self._finish(request, op, True if async_op else None, async_op, then=unpack)

    # -- other collectives ------------------------------------------------------------------

    def all_gather_v(self, input: torch.Tensor, *, async_op: bool = False) -> Union[tuple[torch.Tensor, list[int]], Work]:
        """Concatenate every rank's ``input`` (``[N_r, *row_shape]``, ``N_r`` may differ) in rank order.

        Returns ``(output, sizes)`` with ``output`` of ``[sum(sizes), *row_shape]`` and
        ``sizes[r] = N_r``. The row counts are gathered first (the call blocks the host for them).
        """
        op = "all_gather_v"
        self._check_open(op)
        x = self._check_tensor(input, "input", min_dim=1)
        row_shape = tuple(x.shape[1:])
        sizes = self._gather_ints([x.shape[0], _DTYPE_CODES[x.dtype], hash(row_shape) & 0x7FFFFFFF], op)
        for r, (_, code, shape_hash) in enumerate(sizes):
            if code != _DTYPE_CODES[x.dtype] or shape_hash != hash(row_shape) & 0x7FFFFFFF:
                raise CountMismatchError(
                    f"all_gather_v: rank {r} passed a different dtype or row shape than rank {self.rank} "
                    f"({x.dtype}, rows of {row_shape})"
                )
        counts = [s[0] for s in sizes]
        out = torch.empty((sum(counts),) + row_shape, dtype=x.dtype, device=x.device)
        row_bytes = math.prod(row_shape) * x.element_size()
        if row_bytes == 0 or not any(counts):
            request: Request = DoneRequest()
        else:
            request = self._backend.allgatherv(x, out, counts, row_bytes)
        return self._finish(request, op, (out, counts), async_op)

    def allreduce(self, tensor: torch.Tensor, op: Any = "sum", async_op: bool = False) -> Optional[Work]:
        """In-place reduction over all ranks (``op``: "sum", "max", "min", "prod" or a
        ``torch.distributed.ReduceOp``). float16/bfloat16 are reduced in float32 on MPI."""
        name = "allreduce"
        self._check_open(name)
        t = self._check_tensor(tensor, "tensor", min_dim=0, written=True)
        op_name = _reduce_op_name(op)
        if t.dtype.is_complex or t.dtype in _float8_dtypes():
            raise TypeError(f"tensor: allreduce does not support dtype {t.dtype}")
        work_tensor = t
        if self.backend == "mpi" and t.dtype in (torch.float16, torch.bfloat16):
            work_tensor = t.float()
        request = self._backend.allreduce(work_tensor, op_name)
        then = (lambda: t.copy_(work_tensor)) if work_tensor is not t else None
        return self._finish(request, name, True if async_op else None, async_op, then=then)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Optional[Work]:
        """In-place broadcast of ``tensor`` from rank ``src``."""
        name = "broadcast"
        self._check_open(name)
        t = self._check_tensor(tensor, "tensor", min_dim=0, written=True)
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.size:
            raise ValueError(f"src must be a rank in [0, {self.size}), got {src!r}")
        request = self._backend.broadcast(t, src)
        return self._finish(request, name, True if async_op else None, async_op)

    def barrier(self) -> None:
        """Return once every rank has entered the barrier (at most ``timeout`` seconds)."""
        self._check_open("barrier")
        self._wait_host(self._backend.barrier(), "barrier", None)

    def watch_stream(self, op: str = "CUDA graph replay", *, timeout: Optional[float] = None) -> None:
        """Put the work issued so far on the current CUDA stream under the communicator's
        watchdog: if it has not completed within ``timeout`` seconds (default: the
        communicator's), the communicator is aborted and its next call raises
        ``TimeoutError`` naming ``op``.

        Collectives captured into a CUDA graph run at each replay, where no call of this
        library sees them; call this after ``graph.replay()`` so that a replay waiting on a
        peer that never comes does not hang forever. Host-waiting backends (MPI, torch)
        time out every wait themselves: there it does nothing.
        """
        self._check_open(op)
        limit = self.timeout if timeout is None else float(timeout)
        if not limit > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self._backend.watch_stream(op, limit, None if self._p2p is None else self._p2p.problem)

    def _capturing(self) -> bool:
        """True while the current CUDA stream captures a graph."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def split(self, color: Optional[int], key: int = 0) -> Optional["Communicator"]:
        """Collective: a sub-communicator of the ranks that pass the same ``color``.

        Ranks are ordered by ``key``, then by rank here. ``color=None`` joins no group and
        returns None. The sub-communicator keeps this one's timeout, validation and pool.
        """
        self._check_open("split")
        if color is not None and (isinstance(color, bool) or not isinstance(color, int) or color < 0):
            raise ValueError(f"color must be a non-negative int or None, got {color!r}")
        if isinstance(key, bool) or not isinstance(key, int):
            raise TypeError(f"key must be an int, got {key!r}")
        table = self._gather_ints([-1 if color is None else color, key], "split")
        sub_backend = self._backend.split(color, key, table)
        if color is None:
            return None
        members = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(table) if c == color)]
        layout = self.layout.subset(members.index(self.rank), members)
        return Communicator(sub_backend, layout, timeout=self.timeout, validate=self.validate, pool=self._pool)

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Release the communicator (collective on NCCL). Idempotent."""
        if self._closed is None:
            if self._p2p is not None:
                self._p2p.close(self)
                self._p2p = None
            self._closed = "closed"
            if self._hier is not None and self._hier.hierarchy is not None:
                self._hier.hierarchy.close()
            self._backend.close()

    def abort(self) -> None:
        """Tear the communicator down at once; collectives in flight are abandoned."""
        if self._closed is None or self._closed == "closed":
            self._closed = "aborted"
            if self._hier is not None and self._hier.hierarchy is not None:
                self._hier.hierarchy.abort()
            self._backend.abort()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- internals --------------------------------------------------------------------------

    def _check_open(self, op: str) -> None:
        if self._closed is not None:
            raise CommunicatorClosedError(f"moecomm: cannot run {op}: the communicator is {self._closed}")
        try:
            self._backend.check_health()
        except Exception:  # the backend failed asynchronously (a watchdog timeout, a CUDA error) and aborted
            self._closed = "aborted"
            raise

    def _check_tensor(self, t: Any, name: str, *, min_dim: int, written: bool = False) -> torch.Tensor:
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

    def _split_sizes(self, splits: Optional[Splits], t: torch.Tensor, name: str, tensor_name: str) -> list[int]:
        if splits is None:
            if t.shape[0] % self.size:
                raise ValueError(
                    f"{name} is None, so {tensor_name} must split into {self.size} equal blocks, "
                    f"but its dim 0 is {t.shape[0]}"
                )
            return [t.shape[0] // self.size] * self.size
        values = normalize_splits(splits, name, self.size)
        check_split_total(values, t.shape[0], name, tensor_name)
        return values

    def _staging(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """``count`` elements of pooled device memory for work on this communicator's stream."""
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return self._pool.take(nbytes, self.device, id(self._backend)).view(dtype)

    def _unstage(self, buf: torch.Tensor) -> None:
        self._pool.give(buf, self.device, id(self._backend))

    def _count_buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This communicator's own staging for ``n`` ints out and ``n`` in: ``[2 * n]`` int64 on
        the device and (pinned) on the host. Exchanges of ints block the host until done, so
        one pair per size serves every call (an explicit cache, keyed by ``n``)."""
        bufs = self._counts.get(n)
        if bufs is None:
            dev = torch.empty(2 * n, dtype=torch.int64, device=self.device)
            host = dev if self.device.type == "cpu" else torch.empty(2 * n, dtype=torch.int64, pin_memory=True)
            bufs = self._counts[n] = (dev, host)
        return bufs

    def _exchange_ints(self, values: Union[torch.Tensor, Sequence[int]], per_peer: int, op: str) -> tuple[list[int], list[int]]:
        """All-to-all of ``per_peer`` int64s with every rank (blocks the host until done).

        ``values`` holds ``size * per_peer`` ints, peer by peer (a host sequence or an integer
        tensor on any device). Returns (sent, received) as host lists in the same layout.
        """
        n = self.size * per_peer
        if n == 0:
            return [], []
        dev, host = self._count_buffers(n)
        if self._backend.stream_ordered:
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
            self._wait_host(self._backend.exchange_counts(send, dev, host), op, None)
        else:
            if isinstance(values, torch.Tensor):
                dev[:n].copy_(values.reshape(-1), non_blocking=True)
            else:
                dev[:n].copy_(torch.tensor(values, dtype=torch.int64))
            if self.size == 1:
                dev[n:].copy_(dev[:n])
            else:
                self._wait_host(self._backend.alltoall(dev[:n], dev[n:]), op, None)
            if host is not dev:
                host.copy_(dev)
        values_out = host.tolist()
        return values_out[:n], values_out[n:]

    def _check_count_tensor(self, counts: torch.Tensor, name: str) -> None:
        if counts.dtype.is_floating_point or counts.dtype == torch.bool or counts.dtype.is_complex:
            raise TypeError(f"{name} must be an integer tensor, got dtype {counts.dtype}")
        if counts.shape != (self.size,):
            raise ValueError(f"{name} must be 1-D with {self.size} entries, got shape {tuple(counts.shape)}")

    def _exchange_counts(self, send_splits: Union[torch.Tensor, list[int]], name: str) -> tuple[list[int], list[int]]:
        """One all-to-all of row counts; returns (send, recv) as host lists."""
        if isinstance(send_splits, torch.Tensor):
            self._check_count_tensor(send_splits, name)
        return self._exchange_ints(send_splits, 1, "all_to_all_v (count exchange)")

    def _gather_ints(self, values: list[int], op: str) -> list[list[int]]:
        """All-gather a short list of ints from every rank (blocks the host)."""
        n = len(values)
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        table = torch.empty(self.size * n, dtype=torch.int64, device=self.device)
        self._wait_host(self._backend.allgather(mine, table), f"{op} (metadata)", None)
        flat = table.tolist()
        return [flat[r * n:(r + 1) * n] for r in range(self.size)]

    def _cross_check(self, op: str, send: list[int], recv: list[int], dtype: torch.dtype,
                     row_shape: tuple, problem: Optional[str]) -> None:
        """validate=True: every rank compares its counts with its peers' and all raise together."""
        w = self.size
        shape_code = hash(tuple(row_shape)) & 0x7FFFFFFF
        table = self._gather_ints(
            [0 if problem is None else 1, _DTYPE_CODES.get(dtype, -1), shape_code] + list(send) + list(recv), op
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

    def _finish(self, request: Request, op: str, result: Any, async_op: bool,
                then: Optional[Callable[[], Any]] = None) -> Any:
        if then is not None:
            request = _ThenRequest(request, then, self._backend.stream_ordered)
        if async_op:
            return Work(self, request, op, result)
        self._complete(request, op, None)
        return result

    def _complete(self, request: Request, op: str, timeout: Optional[float]) -> None:
        """Make the results usable: on a GPU order the current stream, else wait on the host."""
        if self._backend.stream_ordered:
            request.join()
        else:
            self._wait_host(request, op, timeout)

    def _wait_host(self, request: Request, op: str, timeout: Optional[float]) -> None:
        if self._capturing():  # nothing captured runs before the replay: the wait could only time out
            raise RuntimeError(f"moecomm: {op} waits on the host, which a CUDA graph capture cannot include "
                               f"(collectives in a capture need their counts known on the host: pass recv_splits)")
        if request.test():
            return
        limit = self.timeout if timeout is None else float(timeout)
        start = time.monotonic()
        deadline = start + limit
        test = request.test
        if self._backend.progress_on_test:
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
            self._check_open(op)
            # Other backends progress on their own: yield for 5 ms, then sleep up to 1 ms.
            if now - start < 5e-3:
                os.sched_yield()
            else:
                pause = min(1e-3, pause * 2 if pause else 5e-5)
                time.sleep(pause)

    def _time_out(self, request: Request, op: str, limit: float) -> None:
        self._abandoned.append(request)
        self.abort()
        raise TimeoutError(
            f"moecomm: {op} did not complete within {limit:g} s on rank {self.rank} "
            f"(backend {self.backend}); the communicator was aborted"
        )


class _CheckedRequest(Request):
    """Rows whose counts were given, with the records sent beside them: done once both are,
    then raises :class:`CountMismatchError` if a peer disagrees (see :mod:`moecomm._peer_check`).
    Where the disagreement means some rows can never arrive, it raises as soon as the records
    are in, abandoning the rows and aborting the communicator."""

    __slots__ = ("_comm", "_rows", "_check", "_records", "_mine", "_theirs", "_issues", "_stuck", "_done", "plan")

    def __init__(self, comm: "Communicator", rows: Request, check: PeerCheck, records: Request,
                 mine: torch.Tensor, theirs: torch.Tensor) -> None:
        self._comm = comm
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
                self._comm._abandoned.append(self._rows)
                self._comm.abort()
                raise self._check.error(self._issues, moved=False, aborted=True)
        if not self._rows.test():
            return False
        self._done = True
        if self._issues:
            raise self._check.error(self._issues, moved=True)
        return True

    def join(self) -> None:  # stream-ordered backends: the records were compared before the rows
        self._rows.join()


class _RaiseAfter(Request):
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


class _ThenRequest(Request):
    """Runs ``then`` once the inner request is usable (for unpacking into user tensors)."""

    __slots__ = ("_inner", "_then", "_stream_ordered")

    def __init__(self, inner: Request, then: Callable[[], Any], stream_ordered: bool) -> None:
        self._inner = inner
        self._then = then
        self._stream_ordered = stream_ordered

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


def _warn_if_graph_lost(t: Any, op: str) -> None:
    """Warn (once per call site, Python's default filter) when ``t``'s autograd graph would end here."""
    if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
        warnings.warn(f"moecomm: {op} is not differentiable: the result of an input that requires grad has no "
                      f"autograd graph; use moecomm.functional.all_to_all_v (or .detach() the input to silence "
                      f"this)", UserWarning, stacklevel=3)


def _reduce_op_name(op: Any) -> str:
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
