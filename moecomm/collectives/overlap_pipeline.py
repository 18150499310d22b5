"""The pipeline of ``scatter_compute_gather``: the exchanges of each stage (direct, at
displacements, where the backend allows it; else through ``all_to_all_v``), the streams of
an ``own_first`` call, and the four autograd functions around ``fn``'s own graph. See
docs/overlap.md ("Transport", "Autograd", "Streams")."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Optional

import torch

from ..engine import tags as _tags
from ..engine.dtypes import SUPPORTED_DTYPES
from ..engine.engine import Engine
from .overlap_chunk import Chunk
from .overlap_plan import Plan
from ..engine.requests import Work
from ..backends.base import DoneRequest, Request
from ..errors import CommunicatorClosedError

__all__ = ["Fn", "Transport", "Run", "run_pipeline"]

Fn = Callable[[torch.Tensor, Chunk], torch.Tensor]


class Transport:
    """Moves one stage: ``counts[p]`` rows from row ``displs[p]`` of a whole tensor to each peer.

    ``direct`` (the flat exchange on NCCL or MPI, ``validate=False``): the rows go straight
    from where they lie in ``input`` (or in the output gradient) and land straight where they
    belong in the output (or the input gradient), with per-peer displacements; nothing is
    packed or unpacked, and none of ``all_to_all_v``'s per-call checks run (they were done
    once for the whole call). NCCL: grouped send/recv on the backend's stream (the rank's own
    rows too), exactly as ``NcclBackend.alltoallv`` but at displacements; MPI: one
    ``Ialltoallv`` with displacements. Otherwise (``algorithm`` other than flat, the torch
    backend, ``validate=True``) each stage is packed and goes through ``all_to_all_v``.
    """

    OP = "scatter_compute_gather"

    def __init__(self, engine: Engine, kw: dict) -> None:
        self.engine = engine
        b = engine.backend
        self.backend = b
        self.direct = kw.get("algorithm", "flat") == "flat" and not engine.validate and b.supports_displacements

    def exchange(self, send: torch.Tensor, send_counts: list[int], send_displs: list[int], recv: torch.Tensor,
                 recv_counts: list[int], recv_displs: list[int], label: str) -> Any:
        """``label``: which of the pipeline's exchanges this is (one of :data:`moecomm.engine.tags.LABELS`)."""
        engine = self.engine
        if engine.closed:
            raise CommunicatorClosedError(f"moecomm: cannot run {self.OP}: the communicator is closed")
        b = self.backend
        row_bytes = math.prod(send.shape[1:]) * send.element_size()
        if engine.tagged:  # checked where the rows land (moecomm.engine.tags), row width and dtype included
            request: Request = engine.start_tagged(send, [[c] for c in send_counts], send_displs, recv,
                                                   [[c] for c in recv_counts], recv_displs, row_bytes,
                                                   f"{self.OP} ({label})", send.dtype, tuple(send.shape[1:]),
                                                   label=label)
        elif row_bytes == 0:  # the same on every rank (row shapes agree): nothing moves anywhere
            request = DoneRequest()
        elif engine.peer is not None:  # copy engines through peer memory: every rank takes part, always
            request = engine.peer.exchange(send, send_counts, send_displs, recv, recv_counts, recv_displs, row_bytes,
                                           self._meta(send, label))
        elif b.stream_ordered and not b.collective_exchanges and not (any(send_counts) or any(recv_counts)):
            b.check_health()  # point to point: a peer expects nothing from a rank that sends nothing
            request = DoneRequest()
        else:
            meta = self._meta(send, label)
            request = b.alltoallv(send, send_counts, recv, recv_counts, row_bytes, send_displs, recv_displs,
                                  **({} if meta is None else {"meta": meta}))
        return Work(engine, request, self.OP, (recv, None))


    def _meta(self, send: torch.Tensor, label: str) -> Optional[_tags.ExchangeMeta]:
        """What the exchange is, where the backend compares it between the ranks (else None)."""
        with _tags.labelled(label):
            return self.engine.meta_of(send)


class Run:
    """One call: the plan, fn, and the exchanges in flight (forward and backward)."""

    def __init__(self, comm: Any, plan: Plan, fn: Fn, a2a_kwargs: dict, wire_dtype: Any = None,
                 packed: Optional[torch.Tensor] = None) -> None:
        self.comm = comm
        self.engine: Engine = comm.engine
        self.plan = plan
        self.fn = fn
        self.kw = a2a_kwargs
        self.wire = wire_dtype  # the input's rows travel packed in this FP8 dtype (moecomm.wire)
        self.packed = packed  # those rows packed by the caller (the input is then read for its shape only)
        s = plan.stages
        self.scatter: list = [None] * s  # forward: input rows to the experts
        self.gather: list = [None] * s  # forward: fn's rows back
        self.grad_scatter: list = [None] * s  # backward: output gradient to the experts
        self.grad_gather: list = [None] * s  # backward: input gradient back
        self.out_shape: Optional[tuple] = None
        self.out_dtype: Optional[torch.dtype] = None
        self.in_shape: tuple = ()
        self.in_dtype: Optional[torch.dtype] = None
        self.transport = Transport(self.engine, a2a_kwargs)
        self.out: Optional[torch.Tensor] = None  # direct: the output, filled stage by stage
        self.grad_in: Optional[torch.Tensor] = None  # direct: the input gradient, likewise
        # own_first on a GPU: fn runs on the peers' rows on the communicator's stream for them
        # (waiting for their exchanges there) while the caller's stream works on the own rows
        cuda = plan.device.type == "cuda"
        self.main = torch.cuda.current_stream(plan.device) if cuda else None
        self.side = self._peer_rows_stream() if cuda and plan.own is not None else None
        self._side_joined = False
        self._made: dict = {}  # id of a tensor _alloc made -> an event at its allocation (own-first calls)

    def _peer_rows_stream(self) -> "torch.cuda.Stream":
        """The engine's stream for ``fn`` on the peers' rows of an ``own_first`` call (the
        caller's stream meanwhile works on the rank's own rows)."""
        stream = self.engine.peer_rows_stream
        if stream is None:
            raise RuntimeError(f"moecomm: a communicator on {self.engine.device} has no CUDA streams")
        return stream

    def fork_side(self) -> None:
        """The peers' rows stream starts after what the caller issued so far (once per call)."""
        if self.side is not None and not self._side_joined:
            self.side.wait_stream(self.main)
            self._side_joined = True

    def stage_stream(self, c: int) -> Any:
        """Where stage ``c``'s forward runs (its backward follows it there): the caller's stream,
        or the peers' rows stream for the peers' stages of an own-first call."""
        if self.side is None or self.plan.is_local(c):
            return contextlib.nullcontext()
        self.fork_side()
        return torch.cuda.stream(self.side)

    def join_side(self) -> None:
        """The caller's stream waits for the peers' rows stream (also inside a CUDA graph capture,
        which must end on the stream it began on)."""
        if self.side is not None:
            self.main.wait_stream(self.side)

    def _used_here(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (allocated on the caller's stream) is used on the peers' rows stream: keep the
        caching allocator from handing its memory out before that stream is done with it."""
        if self.side is not None and t.is_cuda and torch.cuda.current_stream(t.device) == self.side:
            t.record_stream(self.side)
        return t

    def _alloc(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A whole output (or input gradient), allocated on the caller's stream; in an own-first
        call the point of its allocation is kept (:meth:`_ready_for_exchange`)."""
        if self.main is None:
            return torch.empty(shape, dtype=dtype, device=self.plan.device)
        with torch.cuda.stream(self.main):
            t = torch.empty(shape, dtype=dtype, device=self.plan.device)
            if self.side is not None:
                made = torch.cuda.Event()
                made.record(self.main)
                self._made[id(t)] = made
        return t

    def _ready_for_exchange(self, dest: torch.Tensor) -> None:
        """Before an exchange issued on the peers' rows stream writes into ``dest`` (allocated on
        the caller's stream): that stream waits for the point ``dest`` was allocated. The
        caching allocator may hand out memory that work the caller's stream issued after the
        peers' stream last synchronised with it still uses; the exchange follows the current
        stream only. (A race that captured graphs, replayed without the host's gaps, showed
        with own_first=0.5 at 3 and 4 ranks.)"""
        made = self._made.get(id(dest))
        if made is not None and torch.cuda.current_stream(self.plan.device) != self.main:
            torch.cuda.current_stream(self.plan.device).wait_event(made)

    def _local(self, rows: torch.Tensor) -> Any:
        return Work(self.engine, DoneRequest(), self.transport.OP, (rows, None))

    def _a2a(self, x: torch.Tensor, send: list[int], recv: list[int]) -> Any:
        return self.comm.all_to_all_v(x, send, recv, async_op=True, **self.kw)

    def _wait(self, work: Any) -> Any:
        return work.wait()  # GPU: the current stream waits on the exchange's event; CPU: polls MPI

    def token(self) -> torch.Tensor:
        return torch.empty(0, device=self.plan.device)

    def chunk(self, c: int) -> Chunk:
        p = self.plan
        return Chunk(c, p.stages, p.recv_counts[c], p.recv_bounds[c].tolist(), p.recv, p.device)

    def abandon(self) -> None:
        """Keep whatever is still in flight referenced (by the communicator, buffers included,
        so that a peer's late transfer never lands in freed memory), and abort the communicator."""
        for works in (self.scatter, self.gather, self.grad_scatter, self.grad_gather):
            for w in works:
                if w is None:
                    continue
                try:
                    done = w.is_completed()
                except Exception:  # noqa: BLE001 - it completed, and found a disagreement (raised already)
                    done = True
                if not done:
                    self.engine.keep(w)
        self.engine.abort()

    # forward
    def issue_scatter(self, x: torch.Tensor) -> None:
        self.in_shape, self.in_dtype = tuple(x.shape[1:]), x.dtype
        if self.packed is not None:
            x, self.packed = self.packed, None
        elif self.wire is not None:  # one fused pass: every row quantized and packed (own rows too)
            from ..quant import WIRE_BLOCK, pack_rows

            x = pack_rows(x.detach(), self.wire, WIRE_BLOCK)
        p = self.plan
        with _tags.labelled(wire=self.wire):  # packed rows: their tags name the FP8 dtype
            for c in range(p.stages):
                self.scatter[c] = self._to_experts(x, c, "scatter_compute_gather scatter")

    def _to_experts(self, x: torch.Tensor, c: int, label: str) -> Any:
        """Stage ``c``'s rows of ``x`` (laid out like the input) to the experts' ranks."""
        p, t = self.plan, self.transport
        if p.is_local(c):
            return self._local(p.own_rows(x.detach(), c))
        if not t.direct:
            return self._a2a(p.pack(x, c), p.send_counts[c], p.recv_counts[c])
        buf = torch.empty((p.recv_totals[c],) + tuple(x.shape[1:]), dtype=x.dtype, device=p.device)
        return t.exchange(x, p.send_counts[c], p.send_displs[c], buf, p.recv_counts[c], p.chunk_displs[c], label)

    def _from_experts(self, y: torch.Tensor, c: int, dest: Optional[torch.Tensor], label: str) -> tuple:
        """Stage ``c``'s rows ``y`` (grouped by source) back home; direct: into ``dest``
        (made here when None, laid out like the input). Returns (work, dest)."""
        p, t = self.plan, self.transport
        if not t.direct:
            if p.is_local(c):
                return self._local(y), None
            return self._a2a(y, p.recv_counts[c], p.send_counts[c]), None
        if dest is None:
            dest = self._alloc((p.stage_rows[-1],) + tuple(y.shape[1:]), y.dtype)
        if p.is_local(c):
            p.own_rows(dest, c).copy_(y)
            return self._local(dest), dest
        self._ready_for_exchange(dest)
        return t.exchange(y, p.recv_counts[c], p.chunk_displs[c], dest, p.send_counts[c], p.send_displs[c],
                          label), dest

    def wait_scatter(self, c: int) -> torch.Tensor:
        rows, _ = self._wait(self.scatter[c])
        self.scatter[c] = None
        if self.wire is not None:
            from ..quant import WIRE_BLOCK, unpack_rows

            return unpack_rows(self._used_here(rows), self.in_shape, self.in_dtype, self.wire, WIRE_BLOCK)
        return self._used_here(rows)

    def check_result(self, c: int, y: Any, rows: int) -> torch.Tensor:
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"scatter_compute_gather: fn must return a torch.Tensor, got {type(y).__name__} "
                            f"(stage {c})")
        if y.dim() < 1 or y.shape[0] != rows:
            raise ValueError(f"scatter_compute_gather: fn must return one row per input row ({rows} rows in "
                             f"stage {c}), got shape {tuple(y.shape)}")
        dev = self.plan.device
        if y.device.type != dev.type or (dev.type == "cuda" and y.device.index != dev.index):
            raise ValueError(f"scatter_compute_gather: fn returned a tensor on {y.device}, expected {dev}")
        if y.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"scatter_compute_gather: fn returned dtype {y.dtype}, which cannot be exchanged")
        shape = tuple(y.shape[1:])
        if self.out_shape is None:
            self.out_shape, self.out_dtype = shape, y.dtype
        elif shape != self.out_shape or y.dtype != self.out_dtype:
            raise ValueError(f"scatter_compute_gather: fn returned rows of {shape} {y.dtype} in stage {c}, "
                             f"but {self.out_shape} {self.out_dtype} in stage 0")
        return y.contiguous()

    def issue_gather(self, c: int, y: torch.Tensor) -> None:
        self.gather[c], self.out = self._from_experts(y, c, self.out, "scatter_compute_gather gather")

    def _drain(self, works: list, whole: Optional[torch.Tensor], row_shape: tuple, dtype: Any) -> torch.Tensor:
        """Wait for every stage's exchange in ``works``; the result: ``whole`` (direct: the
        exchanges landed in it), else the stages' rows put back in input order."""
        parts = []
        try:
            for c in range(self.plan.stages):
                rows, _ = self._wait(works[c])
                works[c] = None
                parts.append(rows)
        except BaseException:  # later stages still in flight: keep their buffers, abort
            self.abandon()
            raise
        return whole if self.transport.direct else self.plan.unpack(parts, row_shape, dtype)

    def collect(self) -> torch.Tensor:
        out = self._drain(self.gather, self.out, self.out_shape, self.out_dtype)
        self.out = None
        return out

    # backward
    def issue_grad_scatter(self, grad: torch.Tensor) -> None:
        for c in reversed(range(self.plan.stages)):  # the autograd engine runs the last stage's backward first
            self.grad_scatter[c] = self._to_experts(grad, c, "scatter_compute_gather gradient scatter")

    def wait_grad_scatter(self, c: int) -> torch.Tensor:
        g, _ = self._wait(self.grad_scatter[c])
        self.grad_scatter[c] = None
        return self._used_here(g)

    def issue_grad_gather(self, c: int, g: torch.Tensor) -> None:
        self.grad_gather[c], self.grad_in = self._from_experts(g.contiguous(), c, self.grad_in,
                                                               "scatter_compute_gather gradient gather")

    def finish_backward(self) -> torch.Tensor:
        p = self.plan
        self.join_side()
        for c in reversed(range(p.stages)):
            if self.grad_scatter[c] is not None:  # a stage whose output took no part in the loss
                self.wait_grad_scatter(c)
            if self.grad_gather[c] is None:  # fn's result did not depend on its rows: zeros
                rows = sum(p.recv_counts[c])
                zeros = torch.zeros((rows,) + self.in_shape, dtype=self.in_dtype, device=p.device)
                self.issue_grad_gather(c, zeros)
        grad = self._drain(self.grad_gather, self.grad_in, self.in_shape, self.in_dtype)
        self.grad_in = None
        return grad


class Scatter(torch.autograd.Function):
    """Issues every stage's scatter; returns one token per stage (autograd edges only)."""

    @staticmethod
    def forward(ctx, x, run):  # type: ignore[override]
        ctx.run = run
        run.issue_scatter(x)
        return tuple(run.token() for _ in range(run.plan.stages))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *tokens):  # type: ignore[override]
        return ctx.run.finish_backward(), None


class Arrive(torch.autograd.Function):
    """Stage ``c``'s rows, once they have arrived; backward sends their gradient home."""

    @staticmethod
    def forward(ctx, token, run, c):  # type: ignore[override]
        ctx.run, ctx.c = run, c
        return run.wait_scatter(c)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        ctx.run.issue_grad_gather(ctx.c, grad)
        return ctx.run.token(), None, None


class Depart(torch.autograd.Function):
    """Sends stage ``c``'s results home; backward waits for that stage's output gradient."""

    @staticmethod
    def forward(ctx, y, run, c):  # type: ignore[override]
        ctx.run, ctx.c = run, c
        run.issue_gather(c, y)
        return run.token()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, token):  # type: ignore[override]
        run = ctx.run
        if ctx.c == 0 and run.plan.own_last:
            run.join_side()  # the first own rows go last: while the peers' input gradients travel home
        return run.wait_grad_scatter(ctx.c), None, None


class Collect(torch.autograd.Function):
    """The output in input order; backward scatters its gradient, stage by stage."""

    @staticmethod
    def forward(ctx, run, *tokens):  # type: ignore[override]
        ctx.run = run
        return run.collect()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        run = ctx.run
        run.issue_grad_scatter(grad.contiguous())
        return (None,) + tuple(run.token() for _ in range(run.plan.stages))


def run_pipeline(run: Run, x: torch.Tensor, fn: Fn) -> torch.Tensor:
    """Issue every stage's scatter, run ``fn`` on each stage as it arrives and send its result
    home; the output (differentiable through the four functions above)."""
    plan = run.plan
    tokens = Scatter.apply(x, run)
    departed: list = [None] * plan.stages
    # Own rows first on a GPU: the caller's stream computes the own rows while the peers'
    # stages run on their own stream. The autograd engine runs later-made nodes first, so the
    # backward starts on the stage made last: the last own rows, or with all own rows first
    # (made last here for that reason) those. On the CPU (one thread) the stages go in order.
    order = list(range(plan.stages))
    if run.side is not None and not plan.own_last:
        order = order[1:] + order[:1]
    try:
        run.fork_side()  # before the caller's stream gets the own rows: the peers' rows need not wait for them
        for c in order:
            if c == plan.stages - 1 and plan.own_last:
                run.join_side()  # the last own rows: computed while the peers' results travel home
            with run.stage_stream(c):
                rows = Arrive.apply(tokens[c], run, c)
                y = run.check_result(c, fn(rows, run.chunk(c)), rows.shape[0])
                departed[c] = Depart.apply(y, run, c)
        run.join_side()
    except BaseException:
        run.abandon()
        raise
    return Collect.apply(run, *departed)
