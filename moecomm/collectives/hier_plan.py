"""The plan of one 2DH exchange (its counts, learned along the hierarchy) and its steps
(layout copies and sub-communicator exchanges), forward and reversed; run by
:mod:`moecomm.hierarchical`. See docs/hierarchical.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from . import blocks as _blocks
from . import flat as _flat
from ..engine.engine import Engine
from ..engine.peer_check import PeerCheck
from .topology import Hierarchy

__all__ = ["Plan", "Counts", "Exchange", "Local", "make_plan", "forward_steps", "reverse_steps"]


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
    member sends this rank, and what disagrees (see :mod:`moecomm.engine.peer_check`)."""
    if sub.size == 1:
        return check.sent, [], False
    got = sub.exchange_ints(check.record(), check.per_peer, f"{check.op} (count exchange)")[1]
    return check.compare(got)


@dataclass
class Counts:
    """What the count exchanges of a 2DH call found: disagreements, and the rail records
    travelling beside the rail rows (when ``recv_splits`` was given)."""

    issues: list
    stuck: bool = False
    error_check: Optional[PeerCheck] = None
    rail_check: Optional[PeerCheck] = None
    rail_records: Optional[tuple] = None


def make_plan(h: Hierarchy, send: list[int], recv: Optional[list[int]], dtype: torch.dtype = torch.uint8,
               row_shape: tuple = (), op: str = "all_to_all_v (2dh)") -> tuple[Plan, Counts]:
    N, L = h.num_nodes, h.local_size
    sgrid = [[send[h.members[m][k]] for k in range(L)] for m in range(N)]
    # Intra step: to node mate k, the N counts [C[me -> (m, k)] for m]; from mate l: r1[l].
    intra = PeerCheck(f"{op}, intra-node", h.intra.rank, [[sgrid[m][k] for m in range(N)] for k in range(L)],
                      None, dtype, row_shape)
    r1, issues, stuck = _records(h.intra.engine, intra)
    found = Counts(list(issues), stuck, intra if issues else None)
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
        # the rail rows' tags carry the per-source counts, as where recv_splits is given
        found.rail_check = PeerCheck(rail.op, h.rail.rank, rail_sent, rgrid, dtype, row_shape, unit=rail.unit)
    else:
        rgrid = [[recv[h.members[n][l]] for l in range(L)] for n in range(N)]
        if N > 1:
            # validate=True: sent now, before any rows, where a rank without recv_splits
            # exchanges them (None otherwise: see moecomm.collectives.flat.start_records).
            found.rail_check = PeerCheck(f"{op}, rail", h.rail.rank, rail_sent, rgrid, dtype, row_shape,
                                         unit="rows (one count per source rank of its node)")
            found.rail_records = _flat.start_records(h.rail.engine, found.rail_check)
    plan = Plan(tuple(send), tuple(recv), tuple(map(tuple, sgrid)), tuple(map(tuple, r1)), tuple(map(tuple, rgrid)))
    return plan, found


# -- the steps --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exchange:
    sub: Engine
    send: list[int]
    recv: list[int]
    name: str
    check: Optional[PeerCheck] = None  # records beside the rows (recv_splits given)
    records: Optional[tuple] = None  # ... already sent (moecomm.collectives.flat.start_records)


@dataclass(frozen=True)
class Local:
    fn: Callable[[torch.Tensor], torch.Tensor]
    name: str


def _inverse_order(order: Sequence[int]) -> list[int]:
    inv = [0] * len(order)
    for i, g in enumerate(order):
        inv[g] = i
    return inv


def forward_steps(h: Hierarchy, p: Plan, counts: Optional[Counts] = None) -> list:
    N, L = h.num_nodes, h.local_size
    steps: list = []
    if h.contiguous:
        if N > 1 and L > 1:
            steps.append(Local(lambda x: _blocks.permute_blocks(x, p.sgrid), "pack"))
    else:
        pack = [h.members[m][k] for k in range(L) for m in range(N)]
        steps.append(Local(lambda x: _blocks.reorder_blocks(x, p.send, pack), "pack"))
    if L > 1:
        steps.append(Exchange(h.intra.engine, [sum(p.sgrid[m][k] for m in range(N)) for k in range(L)],
                               [sum(row) for row in p.r1], "intra"))
    if N > 1 and L > 1:
        steps.append(Local(lambda x: _blocks.permute_blocks(x, p.r1), "regroup"))
    if N > 1:
        steps.append(Exchange(h.rail.engine, [sum(p.r1[l][m] for l in range(L)) for m in range(N)],
                               [sum(row) for row in p.rgrid], "rail",
                               counts.rail_check if counts is not None else None,
                               counts.rail_records if counts is not None else None))
    if not h.contiguous:
        unpack = _inverse_order([h.members[n][l] for n in range(N) for l in range(L)])
        arrived = [c for row in p.rgrid for c in row]
        steps.append(Local(lambda x: _blocks.reorder_blocks(x, arrived, unpack), "unpack"))
    return steps


def reverse_steps(h: Hierarchy, p: Plan) -> list:
    """The forward exchange undone: rows travel from where they arrived back to their source."""
    N, L = h.num_nodes, h.local_size
    steps: list = []
    if not h.contiguous:
        unpack = [h.members[n][l] for n in range(N) for l in range(L)]
        steps.append(Local(lambda x: _blocks.reorder_blocks(x, p.recv, unpack), "unpack back"))
    if N > 1:
        steps.append(Exchange(h.rail.engine, [sum(row) for row in p.rgrid],
                               [sum(p.r1[l][m] for l in range(L)) for m in range(N)], "rail back"))
    if N > 1 and L > 1:
        steps.append(Local(lambda x: _blocks.permute_blocks(x, p.r1, inverse=True), "regroup back"))
    if L > 1:
        steps.append(Exchange(h.intra.engine, [sum(row) for row in p.r1],
                               [sum(p.sgrid[m][k] for m in range(N)) for k in range(L)], "intra back"))
    if h.contiguous:
        if N > 1 and L > 1:
            steps.append(Local(lambda x: _blocks.permute_blocks(x, p.sgrid, inverse=True), "pack back"))
    else:
        unpack_pack = _inverse_order([h.members[m][k] for k in range(L) for m in range(N)])
        packed = [p.sgrid[m][k] for k in range(L) for m in range(N)]
        steps.append(Local(lambda x: _blocks.reorder_blocks(x, packed, unpack_pack), "pack back"))
    return steps
