"""The 2D hierarchical (2DH) all-to-all for variable-length rows: inside the node, then
along the *rail* (the ranks of one local index on every node).

Among ``W = N * L`` ranks (``N`` nodes of ``L``) a flat all-to-all sends ``W - L`` messages
per rank over the network; 2DH sends ``N - 1`` aggregated ones, the same bytes in ``L``
times fewer messages, at the price of a second pass through the node and two layout copies
(``moecomm.collectives.blocks``). Counts go the same route (never a flat ``W x W``
exchange). The backward is the exchange reversed, reusing the forward's counts (the
:class:`Plan`). Phases, why intra-node first, buffers, asynchrony and CUDA graphs:
docs/hierarchical.md. The groups, the profile and ``algorithm="auto"``:
:mod:`moecomm.collectives.topology` (whose names this module re-exports).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .collectives import flat as _flat
from .engine import tags as _tags
from .engine.engine import Engine
from .collectives.hier_plan import Exchange, Local, Plan, forward_steps, make_plan, reverse_steps
from .engine.requests import CheckedRequest, RaiseAfter
from .collectives.topology import (ALGORITHMS, AUTO_2DH_MAX_BYTES_PER_PEER, Hierarchy, Topology, build, choose, fingerprint,
                        require_hierarchy, unequal_nodes_message)
from .backends.base import DoneRequest, Request
from .errors import CountMismatchError
from .splits import Splits, check_split_total, normalize_splits

__all__ = [
    "ALGORITHMS",
    "AUTO_2DH_MAX_BYTES_PER_PEER",
    "Hierarchy",
    "Topology",
    "TopologyState",
    "Plan",
    "build",
    "fingerprint",
    "choose_algorithm",
    "start_all_to_all_v",
    "reverse_all_to_all_v",
    "unequal_nodes_message",
]

TopologyState = Topology  # the name of earlier releases


def choose_algorithm(comm: Any, x: torch.Tensor) -> str:
    """Collective: what ``algorithm="auto"`` runs on the communicator ``comm`` for input ``x``
    (the same on every rank; see :mod:`moecomm.collectives.topology`)."""
    return choose(comm.engine, comm.topology, x)


class _Chain(Request):
    """The phases of one 2DH exchange as one request (see the module docstring)."""

    def __init__(self, engine: Engine, h: Hierarchy, steps: list, x: torch.Tensor,
                 out: torch.Tensor, plan: Plan) -> None:
        self.plan = plan
        self._engine = engine
        self._h = h
        self._steps = steps
        self._out = out
        self._buf = x
        self._row_shape = tuple(x.shape[1:])
        self._i = 0
        self._current: Optional[Request] = None
        self._pooled: list[torch.Tensor] = []
        self._done = False
        self._ordered = engine.backend.stream_ordered
        self._tags = _tags.current()  # phases issued later (while polled) carry their call's label
        if not steps:
            out.copy_(x)
            self._finish()
            return
        if self._ordered:
            self._run_ordered()
        else:
            h.pending.append(self)
            self.advance()

    # -- buffers --

    def _recv_buffer(self, rows: int, last: bool) -> torch.Tensor:
        if last:
            return self._out
        count = rows * math.prod(self._row_shape)
        buf = self._engine.staging(count, self._out.dtype).view((rows,) + self._row_shape)
        self._pooled.append(buf)
        return buf

    def _release(self, buf: torch.Tensor) -> None:
        for i, b in enumerate(self._pooled):
            if b is buf:
                del self._pooled[i]
                self._engine.unstage(b)
                return

    # -- steps --

    def _run_local(self, step: Local) -> None:
        last = self._i == len(self._steps) - 1
        result = step.fn(self._buf)
        if last and result is not self._out:
            self._out.copy_(result)
            result = self._out
        if result is not self._buf:
            self._release(self._buf)
        self._buf = result
        self._i += 1

    def _issue(self, step: Exchange) -> Request:
        last = self._i == len(self._steps) - 1
        recv = self._recv_buffer(sum(step.recv), last)
        with _tags.using(self._tags):
            request = _flat.alltoallv(step.sub, self._buf, step.send, recv, step.recv, check=step.check,
                                      records=step.records)
        self._buf = recv
        self._i += 1
        return request

    def _run_ordered(self) -> None:
        for step in self._steps:
            if self._current is not None:
                self._current.join()
                self._current = None
            if isinstance(step, Exchange):
                self._current = self._issue(step)
            else:
                self._run_local(step)
        if self._current is None:
            self._finish()

    def unissued_on(self, sub: Engine) -> bool:
        """Whether a phase not yet issued exchanges on ``sub`` (then a later chain waits for it)."""
        return any(isinstance(s, Exchange) and s.sub is sub for s in self._steps[self._i:])

    def _may_issue(self, sub: Engine) -> bool:
        for chain in self._h.pending:
            if chain is self:
                return True
            if chain.unissued_on(sub):
                return False
        return True

    def advance(self) -> None:
        """Issue and complete the phases that can go now, without blocking (host-progressed chains)."""
        try:
            while not self._done:
                if self._current is not None:
                    if not self._current.test():
                        return
                    self._current = None
                if self._i >= len(self._steps):
                    self._finish()
                    return
                step = self._steps[self._i]
                if isinstance(step, Exchange):
                    if not self._may_issue(step.sub):
                        return
                    self._current = self._issue(step)
                    if not any(isinstance(s, Exchange) for s in self._steps[self._i:]):
                        self._unpend()
                else:
                    self._run_local(step)
        except CountMismatchError:
            # The rows of the checked phase completed as every rank planned (see
            # moecomm.engine.peer_check), and the sub-communicators still match message for
            # message, unless the check aborted one (rows that could never arrive).
            self._finish()
            if self._h.intra.closed or self._h.rail.closed:
                self._engine.abort()
            raise
        except BaseException:
            self._unpend()
            self._done = True
            self._engine.abort()
            raise

    def _unpend(self) -> None:
        try:
            self._h.pending.remove(self)
        except ValueError:
            pass

    def _finish(self) -> None:
        self._done = True
        self._unpend()
        for b in self._pooled:
            self._engine.unstage(b)
        self._pooled = []
        self._buf = self._out

    # -- Request --

    def test(self) -> bool:
        if self._done:
            return True
        if self._ordered:
            if self._current is not None and self._current.test():
                self._finish()
            return self._done
        for chain in list(self._h.pending):
            if chain is self:
                break
            chain.advance()
        self.advance()
        return self._done

    def join(self) -> None:
        if self._ordered and self._current is not None:
            self._current.join()
            self._finish()


class _Flush(Request):
    """Done once every earlier host-progressed chain has issued all its exchanges."""

    def __init__(self, h: Hierarchy) -> None:
        self._h = h

    def test(self) -> bool:
        for chain in list(self._h.pending):
            chain.advance()
        return not self._h.pending


# -- entry points --------------------------------------------------------------------------


def start_all_to_all_v(
    engine: Engine,
    topology: Optional[Topology],
    input: torch.Tensor,
    send_splits: Splits,
    recv_splits: Optional[Splits],
    algorithm: str = "flat",
) -> tuple[torch.Tensor, list[int], list[int], Request]:
    """Issue ``all_to_all_v`` with ``algorithm`` ("flat", "2dh" or "auto"): (output, send, recv,
    request); the request of a 2DH exchange has its :class:`Plan` as ``plan``, for the backward.

    Raises:
        ValueError: an unknown ``algorithm``; "2dh" on unequal nodes.
        RuntimeError: "2dh" without the hierarchy groups, or while a CUDA graph is captured
            on a layout of more than one phase.
        TypeError, ValueError, CountMismatchError, TimeoutError: as ``Communicator.all_to_all_v``.
    """
    if algorithm == "flat":
        return _flat.start_all_to_all_v(engine, input, send_splits, recv_splits)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    op = "all_to_all_v"
    engine.check_open(op)
    x = engine.check_tensor(input, "input", min_dim=1)
    if algorithm == "auto":
        algorithm = choose(engine, topology, x)
    if algorithm == "flat":
        return _flat.start_all_to_all_v(engine, x, send_splits, recv_splits)
    h = require_hierarchy(topology)
    rows, row_shape = x.shape[0], tuple(x.shape[1:])
    send = normalize_splits(send_splits, "send_splits", engine.size)
    check_split_total(send, rows, "send_splits", "input")
    recv = None if recv_splits is None else engine.check_recv_splits(recv_splits, x)
    single_phase = h.contiguous and (h.num_nodes == 1 or h.local_size == 1)
    if not single_phase and engine.capturing():
        raise RuntimeError(
            f"moecomm: all_to_all_v(algorithm='2dh') cannot be captured into a CUDA graph on {h.num_nodes} nodes "
            f"x {h.local_size} ranks: its intra-node count exchange (what the node's ranks route through this "
            f"rank) waits on the host, also with recv_splits given; capture the flat exchange instead "
            f"(algorithm='flat', or 'auto', which is flat while capturing)")
    if h.pending:  # count exchanges use the sub-communicators too: keep their call order
        engine.wait_host(_Flush(h), "all_to_all_v (2dh, earlier exchanges)", None)
    if single_phase:
        # One node, or one rank per node: the other phase and both copies are empty, and
        # the sub-communicator holds every rank in rank order. Run the one phase as its flat
        # exchange (no plan: the backward is the flat reverse, the same exchange).
        sub = h.intra if h.num_nodes == 1 else h.rail
        return _flat.start_all_to_all_v(sub.engine, x, send, recv)
    plan, counts = make_plan(h, send, recv, x.dtype, row_shape, op + " (2dh)")
    if counts.issues and (counts.stuck or not engine.backend.mismatched_rows_complete):
        engine.abort()  # rows that could never arrive, or NCCL (pairs of different sizes): none move
        raise counts.error_check.error(counts.issues, moved=False, aborted=True)
    if engine.validate:
        try:
            engine.cross_check(op, list(plan.send), list(plan.recv), x.dtype, row_shape, None)
        except BaseException:
            _flat.settle(h.rail.engine, counts.rail_records)
            raise
    out = torch.empty((sum(plan.recv),) + row_shape, dtype=x.dtype, device=x.device)
    request: Request
    if math.prod(row_shape) == 0:  # the same on every rank: no bytes move anywhere
        request = _Done(plan)
        if counts.rail_records is not None:
            request = CheckedRequest(engine, request, counts.rail_check, *counts.rail_records)
    else:
        request = _Chain(engine, h, forward_steps(h, plan, counts), x, out, plan)
    if counts.issues:  # every rank completes its rows as planned (no peer waits), then raises
        request = RaiseAfter(request, counts.error_check.error(counts.issues, moved=True))
    return out, list(plan.send), list(plan.recv), request


class _Done(DoneRequest):
    """A 2DH exchange with nothing to move (keeps its plan for the backward)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan


def reverse_all_to_all_v(engine: Engine, topology: Optional[Topology], plan: Plan, grad: torch.Tensor) -> torch.Tensor:
    """The backward of a 2DH exchange: rows go back along the reversed phases (no counts exchanged).

    Raises:
        ValueError: ``grad`` has another row count than the exchange delivered.
        RuntimeError: no hierarchy groups (see :func:`start_all_to_all_v`).
    """
    h = require_hierarchy(topology)
    engine.check_open("all_to_all_v (2dh backward)")
    g = grad.contiguous()
    rows, row_shape = g.shape[0], tuple(g.shape[1:])
    if rows != sum(plan.recv):
        raise ValueError(f"grad_output has {rows} rows, but the exchange delivered {sum(plan.recv)}")
    out = torch.empty((sum(plan.send),) + row_shape, dtype=g.dtype, device=g.device)
    if math.prod(row_shape) == 0:
        return out
    with _tags.labelled("all_to_all_v backward"):
        chain = _Chain(engine, h, reverse_steps(h, plan), g, out, plan)
    engine.complete(chain, "all_to_all_v (2dh backward)", None)
    return out
