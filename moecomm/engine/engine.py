"""The engine under a :class:`moecomm.Communicator`: one backend, its staging pool, its
timeout, its count buffers, and the waits and count exchanges that every
collective, the flat exchange (:mod:`moecomm.collectives.flat`), the 2DH exchange
(:mod:`moecomm.hierarchical`), the overlap pipeline
(:mod:`moecomm.overlap`) and the FP8 wire (:mod:`moecomm.wire`) are built from.

Internal: the communicator holds one engine (``comm.engine``) and hands it to those modules;
none of them touches another object's private members. Every wait has the engine's timeout
(``timeout``, seconds, or a per-call value), after which the engine is aborted.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..backends._deadline import poll_yielding
from ..backends._host_channel import OPS, HostChannel
from ..backends.base import Backend, Request
from ..errors import CommunicatorClosedError, CountMismatchError, PeerFailedError
from ..pool import StagingPool
from ..splits import Splits, normalize_splits
from .dtypes import DTYPE_CODES, SUPPORTED_DTYPES
from .notices import Notice, Notices, cause, describe, failure_kind, peer_failed_error
from .requests import TagChecked, ThenRequest, Work
from .tags import ExchangeMeta, TagPlan, exchange_meta

__all__ = ["COPY_ENGINE_MIN_BYTES", "Engine", "warn_if_graph_lost"]

COPY_ENGINE_MIN_BYTES = 16 << 20
"""Default of ``init(p2p_min_bytes=)``: with peer memory, a plain ``all_to_all_v`` with known
counts moves by copy engines when a rank sends or receives at least this many bytes; below,
NCCL's grouped send/recv is as fast or faster (bench/results/README.md). The stages of
``scatter_compute_gather`` always use the copy engines: there, leaving the SMs to the
experts matters more."""

_FRAME = 16
"""Values of :meth:`Engine.allreduce_ints` that travel with the length check in one collective."""


def warn_if_graph_lost(t: Any, op: str) -> None:
    """Warn (once per call site, Python's default filter) when ``t``'s autograd graph would end
    in the collective ``op``; call it from the public method, so that the warning points at
    the user's line."""
    if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
        warnings.warn(f"moecomm: {op} is not differentiable: the result of an input that requires grad has no "
                      f"autograd graph; use moecomm.functional.all_to_all_v (or .detach() the input to silence "
                      f"this)", UserWarning, stacklevel=3)


class Engine:
    """One backend with its pool, timeout and count buffers, and the primitives built on them.

    ``peer``: the peer-memory transport (:class:`moecomm.backends.p2p.PeerTransport`), made
    beforehand over an engine of the same backend without one; ``host``: the host channel
    (:class:`moecomm.backends._host_channel.HostChannel`) of the short integer agreements, closed and
    aborted with the engine (None: they go through the backend, on its device); ``copy_engine_min_bytes``:
    see :data:`COPY_ENGINE_MIN_BYTES`. Sub-engines made by :meth:`split` with ``owned=True``
    (the hierarchy groups) are closed and aborted with this one, and share its failure notices.

    ``notices``: the failure notices (:mod:`moecomm.engine.notices`) to share; None: those of
    the backend's own notice channel where it has one (MPI, two or more ranks; asking for it
    is collective the first time), shared by every engine made over the backend.
    """

    def __init__(self, backend: Backend, pool: StagingPool, *, timeout: float, validate: bool,
                 peer: Any = None, host: Optional[HostChannel] = None,
                 copy_engine_min_bytes: int = COPY_ENGINE_MIN_BYTES, notices: Optional[Notices] = None) -> None:
        self.backend = backend
        self.host = host
        self.pool = pool
        self.timeout = timeout
        self.validate = bool(validate)
        self.peer = peer
        self.copy_engine_min_bytes = int(copy_engine_min_bytes)
        # Records beside rows whose counts were given (moecomm.engine.peer_check) also without
        # validate: off by default for their cost (README, "Bad input and faults"); a switch
        # for bench.alltoall --check-cost, which times them, and for tests.
        self.records_beside = False
        # Row exchanges as tagged messages (moecomm.engine.tags) where the backend has them, and
        # what an exchange is in its agreement record where the backend carries one (peer): the
        # default check; a switch for bench.alltoall --check-cost, which times it.
        self.row_tags = True
        self.seq = 0  # exchanges issued on this engine (their tags carry it)
        self.world_ranks: Optional[list[int]] = None  # a sub-engine's members' ranks in its parent
        self.parent: Optional[Engine] = None
        self.closed_as: Optional[str] = None  # "closed" or "aborted"
        if notices is None and backend.size > 1:
            channel = backend.notice_channel()
            if channel is not None:
                if channel.reader is None:
                    channel.reader = Notices(channel)
                notices = channel.reader
        self.notices = notices
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

    @property
    def tagged(self) -> bool:
        """Whether row exchanges travel tagged (checked where they land, see :mod:`moecomm.engine.tags`)."""
        return self.row_tags and self.backend.tagged and self.size > 1

    def meta_of(self, rows: torch.Tensor) -> Optional[ExchangeMeta]:
        """What the exchange of ``rows`` is (under the current :func:`moecomm.engine.tags.labelled`),
        for a backend that compares it between the ranks (:attr:`Backend.carries_meta`) while
        the default check is on; else None. On the hot path of every exchange: one cached
        lookup."""
        if not (self.row_tags and self.backend.carries_meta):
            return None
        return exchange_meta(rows.dtype, rows.shape[1:])

    def start_tagged(self, send: torch.Tensor, send_counts: Sequence[Sequence[int]], send_displs: Sequence[int],
                     recv: torch.Tensor, recv_counts: Sequence[Sequence[int]], recv_displs: Sequence[int],
                     row_bytes: int, op: str, dtype: torch.dtype, row_shape: Sequence[int], unit: str = "rows",
                     label: Optional[str] = None) -> TagChecked:
        """A tagged exchange (only where :attr:`tagged`): ``sum(send_counts[p])`` rows of
        ``row_bytes`` from row ``send_displs[p]`` to each peer ``p`` (the counts as the rank
        plans them, one or more per peer), likewise in; raises ``CountMismatchError`` at
        completion where a peer disagrees."""
        plan = TagPlan(op, self.rank, self.seq, send_counts, recv_counts, row_bytes, dtype, row_shape, unit, label)
        self.seq += 1
        request = self.backend.exchange_tagged(send, [sum(c) for c in send_counts], send_displs, recv,
                                               [sum(c) for c in recv_counts], recv_displs, row_bytes, plan.tags)
        return TagChecked(request, plan)

    def where(self) -> str:
        """This rank as messages name it: its world rank, and its rank here if it differs."""
        world = self.world_rank
        return f"rank {world}" if world == self.rank else f"world rank {world} (rank {self.rank} of a sub-communicator)"

    @property
    def world_rank(self) -> int:
        engine, rank = self, self.rank
        while engine.parent is not None and engine.world_ranks is not None:
            rank = engine.world_ranks[rank]
            engine = engine.parent
        return rank

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

    # -- failure notices (moecomm.engine.notices) ------------------------------------------------

    def wait_position(self) -> Optional[tuple[int, Optional[int]]]:
        """Where a wait issued now stands: (the collective call, the steps it completed), the
        step None outside any call; None without failure notices (see
        :mod:`moecomm.engine.notices`)."""
        notices = self.notices
        if notices is None:
            return None
        return notices.call, (notices.step if notices.depth else None)

    def tell_failure(self, op: str, call: int, steps: int, exc: BaseException) -> None:
        """This rank's collective call ``call`` (``op``) raised ``exc`` after ``steps`` steps:
        where there are notices and :func:`moecomm.engine.notices.failure_kind` says so, tell
        the peers, and (the engine not aborted) start the meeting of the ranks that failed the
        call, which the next call settles (:meth:`settle_failure`). The engine is left as it is."""
        notices = self.notices
        kind = failure_kind(exc, self.closed_as == "aborted")
        if kind is None or notices is None or self.closed_as == "closed":
            return
        try:
            notices.tell(kind, call, steps, op, self.where(), describe(exc))
            if kind == "failed":
                notices.meeting = (call, notices.channel.agree())
        except Exception as send_error:  # noqa: BLE001 - exc is the error to report
            exc.add_note(f"moecomm: {op}: this failure could not be told to the peers ({send_error!r})")

    def settle_failure(self, op: str) -> None:
        """Before the call ``op`` after one that failed on this rank (its meeting pending):
        wait until every rank that failed that call has met, then go on (they all failed it:
        nothing is wrong between them); or until a peer's notice says it gave up waiting for
        this rank: then abort and raise :class:`moecomm.PeerFailedError` quoting it, so that
        this call never pairs with messages the peers left behind.

        Raises:
            PeerFailedError: a peer gave up on the failed call (the communicator is aborted).
            TimeoutError: neither within the timeout: some rank neither failed that call nor
                gave up on it (the communicator is aborted).
        """
        notices = self.notices
        call, meeting = notices.meeting
        notices.meeting = None
        if self.closed_as is not None:
            return  # (check_open names it)
        seen: list[Optional[Notice]] = [None]

        def met() -> bool:
            if meeting.test():
                return True
            seen[0] = notices.peer_aborted()
            return seen[0] is not None
        if poll_yielding(met, time.monotonic() + self.timeout) and seen[0] is None:
            return
        self.keep(meeting)
        top = self._top()
        top.abort()
        self.abort()
        if seen[0] is not None:
            raise PeerFailedError(f"moecomm: {op}: this rank failed its call {call}, which a peer waited for: "
                                  f"{cause(seen[0])} -- the communicator was aborted on {top.where()}")
        raise TimeoutError(f"moecomm: {op}: this rank failed its call {call}, and within {self.timeout:g} s not every "
                           f"rank either failed that call too or gave up waiting for it, on {top.where()}; the "
                           f"communicator was aborted")

    def _give_up(self, request: Optional[Any], op: str, at: tuple[int, Optional[int]], notice: Notice) -> None:
        """End a wait at ``at`` on a peer's ``notice``: keep ``request`` referenced, abort (the
        hierarchy's top too, as a timeout does), tell the peers, raise
        :class:`moecomm.PeerFailedError`."""
        if request is not None:
            self.keep(request)
        top = self._top()
        top.abort()
        self.abort()
        error = peer_failed_error(notice, op, top.where())
        try:  # the cause travels on: a peer that reads this notice first still learns it
            self.notices.tell("aborted", at[0], at[1] or 0, op, top.where(), f"{type(error).__name__}: {cause(notice)}")
        except Exception as send_error:  # noqa: BLE001 - the peer's failure is the error to report
            error.add_note(f"moecomm: the peers could not be told of this abort ({send_error!r})")
        raise error

    def _watch(self, op: str, at: Optional[tuple[int, Optional[int]]]) -> Optional[Callable[[], None]]:
        """For a wait at ``at`` (:meth:`wait_position`) outside :meth:`wait_host` (the host
        channel's): a function that raises as :meth:`wait_host` does on a peer's notice; None
        without notices."""
        notices = self.notices
        if notices is None or at is None:
            return None

        def watch() -> None:
            notice = notices.check(*at)
            if notice is not None:
                self._give_up(None, op, at, notice)
        return watch

    def close(self) -> None:
        """Collective on NCCL: release the peer transport, the owned sub-engines and the backend."""
        if self.closed_as is None:
            if self.peer is not None:
                self.peer.close(self)
                self.peer = None
            self.closed_as = "closed"
            for sub in self._owned:
                sub.close()
            if self.host is not None:
                self.host.close()
            self.backend.close()

    def abort(self) -> None:
        """Tear down at once (owned sub-engines too); operations in flight are abandoned."""
        if self.closed_as is None or self.closed_as == "closed":
            self.closed_as = "aborted"
            for sub in self._owned:
                sub.abort()
            if self.host is not None:
                self.host.abort()
            self.backend.abort()

    def split(self, color: Optional[int], key: int, *, owned: bool = False) -> tuple[Optional["Engine"], list[int]]:
        """Collective: an engine over the ranks that pass ``color`` (None: none), ordered by
        ``key`` then rank, with this one's timeout, validation and pool; and its members' ranks
        here. ``owned``: closed and aborted with this engine."""
        self.check_open("split")
        table = self.gather_ints([-1 if color is None else color, key], "split")
        sub_backend = self.backend.split(color, key, table)
        sub_host = None
        if self.host is not None:
            try:
                sub_host = self.host.split(color, key, timeout=self.timeout)
            except BaseException:
                if sub_backend is not None:
                    sub_backend.abort()
                raise
        if color is None:
            return None, []
        members = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(table) if c == color)]
        sub = Engine(sub_backend, self.pool, timeout=self.timeout, validate=self.validate, host=sub_host,
                     notices=self.notices if owned else None)
        sub.world_ranks, sub.parent = members, self
        sub.row_tags = self.row_tags
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
        """A tensor of counts: integer, ``[size]``, holding values (not on the meta device)."""
        if counts.device.type == "meta":
            raise ValueError(f"{name} is a tensor on the meta device, which holds no counts: pass counts on the "
                             f"CPU or {self.device}")
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

    def output(self, rows: int, row_shape: tuple, dtype: torch.dtype, name: str = "recv_splits") -> torch.Tensor:
        """The output of an exchange, ``[rows, *row_shape]``; ``ValueError`` naming ``name`` where
        it cannot be allocated (before anything is sent)."""
        try:
            return torch.empty((rows,) + tuple(row_shape), dtype=dtype, device=self.device)
        except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory and size errors
            nbytes = rows * math.prod(row_shape) * torch.empty((), dtype=dtype).element_size()
            raise ValueError(f"{name} sums to {rows} rows ({nbytes} bytes of {dtype} rows of {tuple(row_shape)}), "
                             f"an output that cannot be allocated on {self.device}: {str(exc).splitlines()[0]}") from None

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
                self.wait_host(self.start_ints(dev[:n], dev[n:], per_peer, op), op, None)
            if host is not dev:
                host.copy_(dev)
        values_out = host.tolist()
        return values_out[:n], values_out[n:]

    def start_ints(self, mine: torch.Tensor, theirs: torch.Tensor, per_peer: int, op: str) -> Request:
        """A host backend's all-to-all of ``per_peer`` int64s per peer (non-blocking): tagged
        as a count exchange where :attr:`tagged`, so that it never pairs with rows."""
        if not self.tagged:
            return self.backend.alltoall(mine, theirs)
        ones = [[1]] * self.size
        displs = list(range(self.size))
        return self.start_tagged(mine, ones, displs, theirs, ones, displs, 8 * per_peer, op, torch.int64,
                                 (per_peer,), unit="records", label="count exchange")

    def exchange_counts(self, send_splits: Union[torch.Tensor, list[int]], name: str) -> tuple[list[int], list[int]]:
        """One all-to-all of row counts; returns (send, recv) as host lists."""
        if isinstance(send_splits, torch.Tensor):
            self.check_count_tensor(send_splits, name)
        return self.exchange_ints(send_splits, 1, "all_to_all_v (count exchange)")

    def gather_ints(self, values: list[int], op: str) -> list[list[int]]:
        """All-gather a short list of ints (the same length on every rank) from every rank
        (blocks the host; over the host channel where there is one, so it never waits for
        the GPU)."""
        n = len(values)
        what = f"{op} (metadata)"
        self.check_open(what)
        if self.size == 1:
            return [[int(v) for v in values]]
        if self.host is not None:
            return self._on_host(lambda watch: self.host.allgather(values, timeout=self.timeout, what=what,
                                                                   watch=watch), what)
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        table = torch.empty(self.size * n, dtype=torch.int64, device=self.device)
        self.wait_host(self.backend.allgather(mine, table), what, None)
        flat = table.tolist()
        return [flat[r * n:(r + 1) * n] for r in range(self.size)]

    def reduce_ints(self, values: list[int], op: str, what: str) -> list[int]:
        """Element-wise ``op`` ("max", "min", "sum") of a short list of ints (the same length
        on every rank) over all ranks, in int64 (blocks the host; over the host channel where
        there is one, else through the backend on its device)."""
        self.check_open(what)
        if self.size == 1:
            return [int(v) for v in values]
        if self.host is not None:
            return self._on_host(lambda watch: self.host.allreduce(values, op, timeout=self.timeout, what=what,
                                                                   watch=watch), what)
        if self.capturing():
            raise RuntimeError(f"moecomm: {what} returns host ints, which a CUDA graph capture cannot give: this "
                               f"communicator has no host channel (see the README, \"Host agreements\")")
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        self.complete(self.backend.allreduce(t, op), what, None)
        return [int(v) for v in t.tolist()]

    def max_int(self, value: int, op: str) -> int:
        """The largest ``value`` over all ranks (one allreduce, blocks the host)."""
        return self.reduce_ints([value], "max", op)[0]

    def allreduce_ints(self, values: list[int], op: str, what: str) -> list[int]:
        """:meth:`reduce_ints` for values from a user: every call also agrees on the number of
        values (ranks that pass different lengths all raise :class:`CountMismatchError`
        instead of reducing mismatched messages). Lists of up to :data:`_FRAME` values take
        one collective, longer ones two."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        n = len(values)
        head = values[:_FRAME]
        # max and min: (n, -n) reduce to the largest and smallest length; sum: (n, n*n) to
        # sums that match size * n only where every n is equal (Cauchy-Schwarz).
        frame = [n, n * n if op == "sum" else -n] + head + [0] * (_FRAME - len(head))
        out = self.reduce_ints(frame, op, what)
        if op == "sum":
            equal = out[0] * out[0] == self.size * out[1] and out[0] == self.size * n
        else:
            equal = out[0] == -out[1] == n
        if not equal:
            raise CountMismatchError(f"moecomm: {what}: the ranks passed lists of different lengths (this rank "
                                     f"{self.rank}: {n} values); every rank must pass the same number")
        result = out[2:2 + len(head)]
        if n > _FRAME:
            result += self.reduce_ints(values[_FRAME:], op, what)
        return result

    def _on_host(self, call: Callable[[Optional[Callable[[], None]]], Any], what: str) -> Any:
        """``call(watch)`` on the host channel, as a step of the call in progress: ``watch``
        ends it on a peer's failure notice (:meth:`wait_host`'s rule). Its timeout aborts the
        engine (a collective is left in flight on some rank)."""
        notices = self.notices
        try:
            result = call(self._watch(what, self.wait_position()))
        except TimeoutError as exc:
            self.abort()
            raise TimeoutError(f"{exc}; the communicator was aborted") from None
        if notices is not None and notices.depth:
            notices.step += 1
        return result

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

    def complete(self, request: Request, op: str, timeout: Optional[float],
                 at: Optional[tuple[int, Optional[int]]] = None) -> None:
        """Make the results usable: on a GPU order the current stream (a ``timeout`` given
        puts the work under the backend's watchdog with it), else wait on the host
        (:meth:`wait_host`, ``at`` as there)."""
        if self.backend.stream_ordered:
            request.join()
            if timeout is not None and not self.capturing():
                self.backend.watch_stream(op, float(timeout))
        else:
            self.wait_host(request, op, timeout, at)

    def wait_host(self, request: Request, op: str, timeout: Optional[float],
                  at: Optional[tuple[int, Optional[int]]] = None) -> None:
        """Block the host until ``request`` completes, at most ``timeout`` seconds (default: the
        engine's); past it, the engine is aborted and ``TimeoutError`` raised naming ``op``.

        With failure notices (:mod:`moecomm.engine.notices`), a peer's notice that it failed
        the call this wait belongs to before reaching it, or aborted, ends the wait at once:
        the engine is aborted and :class:`moecomm.PeerFailedError` raised quoting the peer's
        error. ``at``: the wait's place (:meth:`wait_position`) where it is not the next step
        of the call in progress (an ``async_op`` call's ``wait()``); without it, the wait is
        that step and counts as done when it returns."""
        if self.capturing():  # nothing captured runs before the replay: the wait could only time out
            raise RuntimeError(f"moecomm: {op} waits on the host, which a CUDA graph capture cannot include "
                               f"(collectives in a capture need their counts known on the host: pass recv_splits)")
        notices = self.notices
        step = at is None and notices is not None and notices.depth > 0  # the call's next step
        if request.test():
            if step:
                notices.step += 1
            return
        limit = self.timeout if timeout is None else float(timeout)
        start = time.monotonic()
        deadline = start + limit
        watch = None
        if notices is not None:
            place = self.wait_position() if at is None else at

            def watch() -> None:  # one test of the notice channel's posted receive
                notice = notices.check(*place)
                if notice is not None:
                    self._give_up(request, op, place, notice)
        if self.backend.progress_on_test:
            if not poll_yielding(request.test, deadline, watch):  # watch: every 64 polls
                self._time_out(request, op, limit)
        else:
            pause = 0.0
            while not request.test():
                if watch is not None:
                    watch()
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
        if step:
            notices.step += 1

    def owns(self, sub: "Engine") -> bool:
        """Whether ``sub`` is one of the sub-engines closed and aborted with this one."""
        return any(e is sub for e in self._owned)

    def _top(self) -> "Engine":
        """The engine whose fate this one shares: the top of the hierarchy that owns it."""
        top = self
        while top.parent is not None and top.parent.owns(top):
            top = top.parent
        return top

    def _time_out(self, request: Request, op: str, limit: float) -> None:
        self.keep(request)
        top = self._top()
        top.abort()  # a hierarchy group's timeout leaves its communicator unusable too
        self.abort()
        raise TimeoutError(
            f"moecomm: {op} did not complete within {limit:g} s on {self.where()} "
            f"(backend {self.backend.name}); the communicator was aborted"
        )
