"""The 2D hierarchical (2DH) all-to-all for variable-length rows, and ``algorithm="auto"``.

A flat all-to-all among ``W = N * L`` ranks (``N`` nodes of ``L`` ranks) sends ``W - 1``
messages per rank, ``W - L`` of them over the network, each ``1/W`` of the rank's data.
The 2DH exchange sends ``L - 1`` messages inside the node and ``N - 1`` aggregated
messages over the network, each along a *rail* (the ranks of one local index on every
node). It moves the same bytes over the network in ``L`` times fewer messages, at the
price of a second pass of the data through the node and two layout copies.

Notation: rank ``(n, l)`` is local rank ``l`` of node ``n``; ``C[(n, l) -> (m, k)]`` is the
row count rank ``(n, l)`` sends to rank ``(m, k)``.

Phases (forward)
----------------
0. *pack* (copy): the input, grouped by destination rank, is regrouped by destination
   local index: blocks ``[k][m]`` (``moecomm_ext.permute_blocks``).
1. *intra* (all-to-all inside the node): local rank ``k`` of my node gets every row I send
   to any rank ``(m, k)``. Now each rank ``(n, k)`` holds the rows of its whole node for
   the ranks of its own rail, grouped ``[source l][destination node m]``.
2. *regroup* (copy): ``[l][m]`` -> ``[m][l]`` (``moecomm_ext.permute_blocks``).
3. *rail* (all-to-all along the rail, across nodes): rank ``(m, k)`` gets one message per
   node: all rows its node's ranks send it. They arrive grouped ``[source node n][source
   local l]``, which is source-rank order when ranks are numbered node by node, so this
   phase writes straight into the caller's output.
4. *unpack* (copy, only for layouts whose ranks are not numbered node by node): source
   blocks back into rank order (``moecomm_ext.gather_rows``).

Why intra-node first
~~~~~~~~~~~~~~~~~~~~
* Known ``recv_splits`` (the common MoE case: counts come from the routing) leave one
  metadata step, inside the node: a rank must learn what its node mates route through
  it (``C[(n, l) -> (m, k)]`` for all ``l, m``). Rail-first would instead need that step
  over the network (what rank ``(n, l)`` sends to every rank of my node), paying a network
  latency the flat exchange does not.
* The last and slowest phase (the network one) lands directly in the caller's output:
  nothing remains to do once it completes, which is what an asynchronous caller waits on.
  Both layout copies run before or between phases, over memory bandwidth.
* The backward pass is this exchange reversed (rail, regroup back, intra, pack back),
  reusing the forward's counts: no count exchange at all, and the other phase order is
  exercised by every backward.

A layout of one node, or of one rank per node (ranks numbered node by node), has a single
non-empty phase and no copies: 2DH runs that phase as the flat exchange of its
sub-communicator, with the sub-communicator's count exchange.

Counts are exchanged hierarchically too, along the same route (never a flat ``W x W``
exchange): an intra-node all-to-all of ``N`` counts per peer (which gives each rank its
phase-1 counts ``C[(n, l) -> (m, k)]`` for all ``l, m``), then, only when ``recv_splits`` is
not given, a rail all-to-all of ``L`` counts per peer (which gives ``recv_splits``).

Sub-communicators
-----------------
The intra-node group (``split(color=node_rank, key=local_rank)``) and the rail group
(``split(color=local_rank, key=node_rank)``) are made once, by :func:`moecomm._topology.build`, when
``moecomm.init`` builds the communicator (``hierarchy=`` argument), never inside a
collective. ``algorithm="2dh"`` on a communicator without them raises ``RuntimeError``.
Nodes of unequal size cannot use 2DH (there is no rail through every node): ``init(...,
hierarchy=True)`` raises ``ValueError`` naming the node sizes, the default skips the groups,
and ``algorithm="2dh"`` then raises the same ``ValueError``; ``"auto"`` uses the flat exchange.

CUDA graphs
-----------
Every 2DH exchange of a layout with more than one phase exchanges counts inside the node,
on the host, also with ``recv_splits`` given, so it cannot be captured into a CUDA graph:
``algorithm="2dh"`` raises ``RuntimeError`` during a capture (before anything moves), and
``"auto"`` runs the flat exchange while a capture is in progress. Layouts of one phase (one
node, or one rank per node) run the flat exchange of a sub-communicator and can be captured.

Buffers
-------
The receive buffers of the intermediate phases come from the communicator's staging pool
(the engine's, :meth:`moecomm._engine.Engine.staging`) and go back to it as soon as the layout copy that reads them has run (or
been enqueued, on a GPU); the last phase receives straight into the returned tensor. The
layout copies return new tensors (``moecomm_ext`` allocates its outputs).

Asynchrony
----------
On NCCL every phase is enqueued at once, stream ordered (the layout copies run on the
caller's current stream, so work queued there after an async call waits for phase 1).
On CPU backends (MPI, gloo) a later phase is issued when the request is tested or waited
on (``Work.is_completed``/``wait``), as MPI progresses non-blocking collectives. Phases of
concurrent 2DH calls are issued on each sub-communicator in call order on every rank.

``algorithm="auto"``: see :mod:`moecomm._topology`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from . import _blocks, _flat
from ._engine import Engine
from ._peer_check import PeerCheck
from ._requests import CheckedRequest, RaiseAfter
from ._topology import (ALGORITHMS, AUTO_2DH_MAX_BYTES_PER_PEER, Hierarchy, Topology, build, choose, fingerprint,
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
    (the same on every rank; see :mod:`moecomm._topology`)."""
    return choose(comm.engine, comm.topology, x)


# -- the plan: counts of one exchange --------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """The counts of one 2DH exchange as seen by one rank (kept for its backward).

    ``sgrid[m][k]``: rows I send to rank ``(m, k)``; ``r1[l][m]``: rows my node mate ``l``
    sends, through me, to rank ``(m, my local rank)``; ``rgrid[n][l]``: rows I receive from
    rank ``(n, l)``. ``send``/``recv`` are the same in rank order.
    """

    send: tuple[int, ...]
    recv: tuple[int, ...]
    sgrid: tuple[tuple[int, ...], ...]
    r1: tuple[tuple[int, ...], ...]
    rgrid: tuple[tuple[int, ...], ...]


def _records(sub: Engine, check: PeerCheck) -> tuple[list[list[int]], list[str], bool]:
    """A count exchange with ``check``'s records among ``sub`` (blocks the host): what each
    member sends this rank, and what disagrees (see :mod:`moecomm._peer_check`)."""
    if sub.size == 1:
        return check.sent, [], False
    got = sub.exchange_ints(check.record(), check.per_peer, f"{check.op} (count exchange)")[1]
    return check.compare(got)


@dataclass
class _Counts:
    """What the count exchanges of a 2DH call found: disagreements, and the rail records
    travelling beside the rail rows (when ``recv_splits`` was given)."""

    issues: list
    stuck: bool = False
    error_check: Optional[PeerCheck] = None
    rail_check: Optional[PeerCheck] = None
    rail_records: Optional[tuple] = None


def _make_plan(h: Hierarchy, send: list[int], recv: Optional[list[int]], dtype: torch.dtype = torch.uint8,
               row_shape: tuple = (), op: str = "all_to_all_v (2dh)") -> tuple[Plan, _Counts]:
    N, L = h.num_nodes, h.local_size
    sgrid = [[send[h.members[m][k]] for k in range(L)] for m in range(N)]
    # Intra step: to node mate k, the N counts [C[me -> (m, k)] for m]; from mate l: r1[l].
    intra = PeerCheck(f"{op}, intra-node", h.intra.rank, [[sgrid[m][k] for m in range(N)] for k in range(L)],
                      None, dtype, row_shape)
    r1, issues, stuck = _records(h.intra.engine, intra)
    found = _Counts(list(issues), stuck, intra if issues else None)
    # Rail step: to node m, the L counts [r1[l][m] for l]; from node n: rgrid[n].
    rail_sent = [[r1[l][m] for l in range(L)] for m in range(N)]
    if recv is None:
        rail = PeerCheck(f"{op}, rail", h.rail.rank, rail_sent, None, dtype, row_shape,
                         unit="rows (one count per source rank of its node)")
        rgrid, issues, stuck = _records(h.rail.engine, rail)
        if issues:
            found.issues += issues
            found.stuck = found.stuck or stuck
            found.error_check = found.error_check or rail
        recv = [0] * (N * L)
        for n in range(N):
            for l in range(L):
                recv[h.members[n][l]] = rgrid[n][l]
    else:
        rgrid = [[recv[h.members[n][l]] for l in range(L)] for n in range(N)]
        if N > 1:
            # validate=True: sent now, before any rows, where a rank without recv_splits
            # exchanges them (None otherwise: see moecomm._flat.start_records).
            found.rail_check = PeerCheck(f"{op}, rail", h.rail.rank, rail_sent, rgrid, dtype, row_shape,
                                         unit="rows (one count per source rank of its node)")
            found.rail_records = _flat.start_records(h.rail.engine, found.rail_check)
    plan = Plan(tuple(send), tuple(recv), tuple(map(tuple, sgrid)), tuple(map(tuple, r1)), tuple(map(tuple, rgrid)))
    return plan, found


# -- the steps --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Exchange:
    sub: Engine
    send: list[int]
    recv: list[int]
    name: str
    check: Optional[PeerCheck] = None  # records beside the rows (recv_splits given)
    records: Optional[tuple] = None  # ... already sent (moecomm._flat.start_records)


@dataclass(frozen=True)
class _Local:
    fn: Callable[[torch.Tensor], torch.Tensor]
    name: str


def _inverse_order(order: Sequence[int]) -> list[int]:
    inv = [0] * len(order)
    for i, g in enumerate(order):
        inv[g] = i
    return inv


def _forward_steps(h: Hierarchy, p: Plan, counts: Optional[_Counts] = None) -> list:
    N, L = h.num_nodes, h.local_size
    steps: list = []
    if h.contiguous:
        if N > 1 and L > 1:
            steps.append(_Local(lambda x: _blocks.permute_blocks(x, p.sgrid), "pack"))
    else:
        pack = [h.members[m][k] for k in range(L) for m in range(N)]
        steps.append(_Local(lambda x: _blocks.reorder_blocks(x, p.send, pack), "pack"))
    if L > 1:
        steps.append(_Exchange(h.intra.engine, [sum(p.sgrid[m][k] for m in range(N)) for k in range(L)],
                               [sum(row) for row in p.r1], "intra"))
    if N > 1 and L > 1:
        steps.append(_Local(lambda x: _blocks.permute_blocks(x, p.r1), "regroup"))
    if N > 1:
        steps.append(_Exchange(h.rail.engine, [sum(p.r1[l][m] for l in range(L)) for m in range(N)],
                               [sum(row) for row in p.rgrid], "rail",
                               counts.rail_check if counts is not None else None,
                               counts.rail_records if counts is not None else None))
    if not h.contiguous:
        unpack = _inverse_order([h.members[n][l] for n in range(N) for l in range(L)])
        arrived = [c for row in p.rgrid for c in row]
        steps.append(_Local(lambda x: _blocks.reorder_blocks(x, arrived, unpack), "unpack"))
    return steps


def _reverse_steps(h: Hierarchy, p: Plan) -> list:
    """The forward exchange undone: rows travel from where they arrived back to their source."""
    N, L = h.num_nodes, h.local_size
    steps: list = []
    if not h.contiguous:
        unpack = [h.members[n][l] for n in range(N) for l in range(L)]
        steps.append(_Local(lambda x: _blocks.reorder_blocks(x, p.recv, unpack), "unpack back"))
    if N > 1:
        steps.append(_Exchange(h.rail.engine, [sum(row) for row in p.rgrid],
                               [sum(p.r1[l][m] for l in range(L)) for m in range(N)], "rail back"))
    if N > 1 and L > 1:
        steps.append(_Local(lambda x: _blocks.permute_blocks(x, p.r1, inverse=True), "regroup back"))
    if L > 1:
        steps.append(_Exchange(h.intra.engine, [sum(row) for row in p.r1],
                               [sum(p.sgrid[m][k] for m in range(N)) for k in range(L)], "intra back"))
    if h.contiguous:
        if N > 1 and L > 1:
            steps.append(_Local(lambda x: _blocks.permute_blocks(x, p.sgrid, inverse=True), "pack back"))
    else:
        unpack_pack = _inverse_order([h.members[m][k] for k in range(L) for m in range(N)])
        packed = [p.sgrid[m][k] for k in range(L) for m in range(N)]
        steps.append(_Local(lambda x: _blocks.reorder_blocks(x, packed, unpack_pack), "pack back"))
    return steps


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
        if not steps:
            out.copy_(x)
            self._finish()
            return
        if self._ordered:
            self._run_ordered()
        else:
            h.pending.append(self)
            self._advance()

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

    def _run_local(self, step: _Local) -> None:
        last = self._i == len(self._steps) - 1
        result = step.fn(self._buf)
        if last and result is not self._out:
            self._out.copy_(result)
            result = self._out
        if result is not self._buf:
            self._release(self._buf)
        self._buf = result
        self._i += 1

    def _issue(self, step: _Exchange) -> Request:
        last = self._i == len(self._steps) - 1
        recv = self._recv_buffer(sum(step.recv), last)
        if step.check is not None and step.records is not None:
            request = _flat.alltoallv(step.sub, self._buf, step.send, recv, step.recv, check=step.check,
                                      records=step.records)
        else:
            request = _flat.alltoallv(step.sub, self._buf, step.send, recv, step.recv)
        self._buf = recv
        self._i += 1
        return request

    def _run_ordered(self) -> None:
        for step in self._steps:
            if self._current is not None:
                self._current.join()
                self._current = None
            if isinstance(step, _Exchange):
                self._current = self._issue(step)
            else:
                self._run_local(step)
        if self._current is None:
            self._finish()

    def _unissued_on(self, sub: Engine) -> bool:
        return any(isinstance(s, _Exchange) and s.sub is sub for s in self._steps[self._i:])

    def _may_issue(self, sub: Engine) -> bool:
        for chain in self._h.pending:
            if chain is self:
                return True
            if chain._unissued_on(sub):
                return False
        return True

    def _advance(self) -> None:
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
                if isinstance(step, _Exchange):
                    if not self._may_issue(step.sub):
                        return
                    self._current = self._issue(step)
                    if not any(isinstance(s, _Exchange) for s in self._steps[self._i:]):
                        self._unpend()
                else:
                    self._run_local(step)
        except CountMismatchError:
            # The rows of the checked phase completed as every rank planned (see
            # moecomm._peer_check), and the sub-communicators still match message for
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
            chain._advance()
        self._advance()
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
            chain._advance()
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
    plan, counts = _make_plan(h, send, recv, x.dtype, row_shape, op + " (2dh)")
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
        request = _Chain(engine, h, _forward_steps(h, plan, counts), x, out, plan)
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
    chain = _Chain(engine, h, _reverse_steps(h, plan), g, out, plan)
    engine.complete(chain, "all_to_all_v (2dh backward)", None)
    return out
