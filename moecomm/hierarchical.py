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
   local index: blocks ``[k][m]`` (``moecomm._blocks.permute_blocks``).
1. *intra* (all-to-all inside the node): local rank ``k`` of my node gets every row I send
   to any rank ``(m, k)``. Now each rank ``(n, k)`` holds the rows of its whole node for
   the ranks of its own rail, grouped ``[source l][destination node m]``.
2. *regroup* (copy): ``[l][m]`` -> ``[m][l]`` (``moecomm._blocks.permute_blocks``).
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
(``split(color=local_rank, key=node_rank)``) are made once, by :func:`attach`, when
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
(``comm._pool``) and go back to it as soon as the layout copy that reads them has run (or
been enqueued, on a GPU); the last phase receives straight into the returned tensor. The
layout copies return new tensors (``moecomm_ext`` allocates its outputs).

Asynchrony
----------
On NCCL every phase is enqueued at once, stream ordered (the layout copies run on the
caller's current stream, so work queued there after an async call waits for phase 1).
On CPU backends (MPI, gloo) a later phase is issued when the request is tested or waited
on (``Work.is_completed``/``wait``), as MPI progresses non-blocking collectives. Phases of
concurrent 2DH calls are issued on each sub-communicator in call order on every rank.

``algorithm="auto"``
--------------------
With a profile (``init(profile=...)`` or ``<profile dir>/<fingerprint>.json``, see
:mod:`moecomm.profile`) the choice of the profile entry nearest the call's bytes per rank
(the largest input over all ranks, agreed with one 8-byte allreduce unless the profile
makes the same choice at every size). Without a profile: ``"2dh"`` when the communicator
has the hierarchy groups, ``num_nodes > 1``, ``local_size > 1`` and the bytes per peer
(largest input over ranks / ``W``) are at most :data:`AUTO_2DH_MAX_BYTES_PER_PEER`, else
``"flat"``.
"""

from __future__ import annotations

import json
import math
import warnings
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch

from . import _blocks
from ._peer_check import PeerCheck
from .errors import CountMismatchError
from .backends.base import DoneRequest, Request
from .layout import Layout
from .profile import Fingerprint, Profile, ProfileError, default_profile_path, load_profile
from .splits import Splits, check_split_total, normalize_splits

if TYPE_CHECKING:  # pragma: no cover
    from .communicator import Communicator

__all__ = [
    "ALGORITHMS",
    "AUTO_2DH_MAX_BYTES_PER_PEER",
    "Hierarchy",
    "TopologyState",
    "Plan",
    "attach",
    "fingerprint",
    "choose_algorithm",
    "start_all_to_all_v",
    "reverse_all_to_all_v",
    "unequal_nodes_message",
]

ALGORITHMS = ("flat", "2dh", "auto")

AUTO_2DH_MAX_BYTES_PER_PEER = 256 << 10
"""Without a profile, ``"auto"`` picks 2DH up to this many bytes per peer (and layout allowing)."""


def unequal_nodes_message(sizes: Sequence[int]) -> str:
    return (
        f"moecomm: the 2D hierarchical all-to-all needs nodes of equal size, but this communicator's "
        f"nodes have {list(sizes)} ranks (node 0 first); use algorithm='flat' (or 'auto', which "
        f"falls back to it)"
    )


class Hierarchy:
    """The intra-node and rail sub-communicators of a communicator with equal nodes."""

    def __init__(self, comm: "Communicator", intra: "Communicator", rail: "Communicator") -> None:
        lay = comm.layout
        self.num_nodes = lay.num_nodes
        self.local_size = lay.local_size
        self.node_rank = lay.node_rank
        self.local_rank = lay.local_rank
        self.members: tuple[tuple[int, ...], ...] = lay.node_members
        self.intra = intra
        self.rail = rail
        if (intra.size, intra.rank, rail.size, rail.rank) != (self.local_size, self.local_rank, self.num_nodes, self.node_rank):
            raise RuntimeError(
                f"moecomm: hierarchy groups do not match the layout (intra {intra.rank}/{intra.size}, "
                f"rail {rail.rank}/{rail.size}, layout node {self.node_rank}/{self.num_nodes} "
                f"local {self.local_rank}/{self.local_size})"
            )
        L = self.local_size
        self.contiguous = all(r == n * L + l for n, m in enumerate(self.members) for l, r in enumerate(m))
        self._pending: list[_Chain] = []  # host-progressed chains with exchanges not yet issued

    def close(self) -> None:
        self.intra.close()
        self.rail.close()

    def abort(self) -> None:
        self.intra.abort()
        self.rail.abort()


@dataclass
class TopologyState:
    """What :func:`attach` leaves on a communicator (``comm._hier``)."""

    hierarchy: Optional[Hierarchy]
    why_not: str  # why there is no hierarchy ("" when there is one)
    profile: Optional[Profile]
    fingerprint: Fingerprint


# -- setup (moecomm.init) -------------------------------------------------------------------


def fingerprint(comm: "Communicator", hosts: Sequence[str]) -> Fingerprint:
    """The cluster fingerprint of ``comm``: layout, device model, backend and link kind.

    The link kind is ``<backend>-<H>host(s)``, with ``-simulated`` when the layout (from
    ``local_size=``) differs from the one the host names give.
    """
    if comm.device.type == "cuda":
        device = torch.cuda.get_device_name(comm.device)
    else:
        device = comm.device.type
    n_hosts = len(set(hosts)) if hosts else 1
    link = f"{comm.backend}-{n_hosts}host{'s' if n_hosts != 1 else ''}"
    if hosts and len(hosts) == comm.size:
        real = Layout.from_hosts(comm.rank, list(hosts))
        if real.node_of_rank != comm.layout.node_of_rank:
            link += "-simulated"
    return Fingerprint(comm.num_nodes, comm.local_size, device, link, comm.backend)


def attach(
    comm: "Communicator",
    *,
    hierarchy: Optional[bool],
    profile: Union[None, str, Any, Profile],
    hosts: Sequence[str],
    local_size_given: bool,
) -> TopologyState:
    """Collective: build ``comm``'s hierarchy groups and load its profile (``comm._hier``).

    ``hierarchy``: True builds the groups (ValueError for unequal nodes), False does not,
    None builds them when ``num_nodes > 1 and local_size > 1`` or ``local_size_given``.
    ``profile``: a :class:`Profile`, a path, or None for ``<profile dir>/<fingerprint>.json``
    if that file exists.
    """
    if hierarchy is not None and not isinstance(hierarchy, bool):
        raise TypeError(f"hierarchy must be True, False or None, got {hierarchy!r}")
    lay = comm.layout
    sizes = [len(m) for m in lay.node_members]
    want = hierarchy if hierarchy is not None else (local_size_given or (lay.num_nodes > 1 and lay.local_size > 1))
    groups: Optional[Hierarchy] = None
    why_not = ""
    if not want:
        why_not = ("init(hierarchy=False)" if hierarchy is False else
                   f"init(hierarchy=None) builds them only when num_nodes > 1 and local_size > 1 or local_size= "
                   f"is given, and this communicator has {lay.num_nodes} node(s) of {lay.local_size}")
    elif not lay.uniform:
        if hierarchy:
            raise ValueError(unequal_nodes_message(sizes))
        why_not = "unequal"
    else:
        intra = comm.split(lay.node_rank, lay.local_rank)
        rail = comm.split(lay.local_rank, lay.node_rank)
        groups = Hierarchy(comm, intra, rail)
    fp = fingerprint(comm, hosts)
    prof = _resolve_profile(comm, profile, fp)
    state = TopologyState(groups, why_not, prof, fp)
    comm._hier = state
    return state


def _profile_digest(prof: Optional[Profile]) -> int:
    if prof is None:
        return 0
    return zlib.crc32(json.dumps(prof.to_json(), sort_keys=True).encode()) & 0x7FFFFFFF


def _resolve_profile(comm: "Communicator", profile: Any, fp: Fingerprint) -> Optional[Profile]:
    explicit = profile is not None
    prof: Optional[Profile] = None
    problem = ""
    try:
        if isinstance(profile, Profile):
            prof = profile
        elif explicit:
            if not isinstance(profile, (str, bytes)) and not hasattr(profile, "__fspath__"):
                raise TypeError(f"profile must be a path, a moecomm.profile.Profile or None, got {type(profile).__name__}")
            prof = load_profile(profile)
        else:
            path = default_profile_path(fp)
            if path.is_file():
                prof = load_profile(path)
        if prof is not None:
            prof = _check_fingerprint(prof, fp, explicit)
    except TypeError:
        raise
    except ProfileError as exc:
        if explicit:
            problem = str(exc)
        else:
            warnings.warn(f"moecomm: ignoring the cached topology profile: {exc}", RuntimeWarning, stacklevel=4)
            prof = None
    # Every rank must decide alike: compare what each loaded.
    table = comm._gather_ints([1 if problem else 0, _profile_digest(prof)], "init (topology profile)")
    failed = [r for r, row in enumerate(table) if row[0]]
    if failed:
        mine = f": {problem}" if problem else ""
        raise ProfileError(f"moecomm: the topology profile could not be loaded on rank(s) {failed}{mine}")
    if len({row[1] for row in table}) > 1:
        if explicit:
            raise ProfileError(
                f"moecomm: the ranks loaded different topology profiles from {profile!r} "
                f"(content digests {[row[1] for row in table]}); give every rank the same file"
            )
        if comm.rank == 0:
            warnings.warn("moecomm: ranks found different cached topology profiles; using none (auto follows "
                          "the built-in rule)", RuntimeWarning, stacklevel=4)
        prof = None
    return prof


def _check_fingerprint(prof: Profile, fp: Fingerprint, explicit: bool) -> Profile:
    pf = prof.fingerprint
    where = prof.source or "the given profile"
    if (pf.num_nodes, pf.local_size) != (fp.num_nodes, fp.local_size):
        raise ProfileError(
            f"topology profile {where} was tuned for {pf.num_nodes} node(s) x {pf.local_size}, but this "
            f"communicator is {fp.num_nodes} node(s) x {fp.local_size}; tune this layout "
            f"(python -m topology tune) or pass another profile"
        )
    if pf != fp:
        message = f"topology profile {where} was tuned on {pf.describe()}; this communicator is {fp.describe()}"
        if not explicit:
            raise ProfileError(message)
        warnings.warn(f"moecomm: {message}", RuntimeWarning, stacklevel=5)
    return prof


# -- choosing ------------------------------------------------------------------------------


def _max_input_bytes(comm: "Communicator", x: torch.Tensor) -> int:
    t = torch.tensor([x.numel() * x.element_size()], dtype=torch.int64, device=comm.device)
    comm.allreduce(t, "max")
    return int(t.item())


def choose_algorithm(comm: "Communicator", x: torch.Tensor) -> str:
    """Collective: what ``algorithm="auto"`` runs for input ``x`` (the same on every rank)."""
    state: Optional[TopologyState] = getattr(comm, "_hier", None)
    if state is None or state.hierarchy is None or comm._capturing():
        return "flat"  # while a CUDA graph is captured, 2DH's count exchanges cannot run
    h = state.hierarchy
    if state.profile is not None:
        fixed = state.profile.uniform_choice()
        if fixed is not None:
            return fixed
        return state.profile.choose(_max_input_bytes(comm, x))
    if h.num_nodes == 1 or h.local_size == 1:
        return "flat"
    per_peer = _max_input_bytes(comm, x) / comm.size
    return "2dh" if per_peer <= AUTO_2DH_MAX_BYTES_PER_PEER else "flat"


def _require_hierarchy(comm: "Communicator") -> Hierarchy:
    state: Optional[TopologyState] = getattr(comm, "_hier", None)
    if state is not None and state.hierarchy is not None:
        return state.hierarchy
    if state is not None and state.why_not == "unequal":
        raise ValueError(unequal_nodes_message([len(m) for m in comm.layout.node_members]))
    why = f" ({state.why_not})" if state is not None and state.why_not else \
        " (it was not made by moecomm.init, e.g. it came from split())"
    raise RuntimeError(
        f"moecomm: algorithm='2dh' needs the intra-node and rail sub-communicators, which this "
        f"communicator does not have{why}; pass hierarchy=True to moecomm.init"
    )


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


def _records(sub: "Communicator", check: PeerCheck) -> tuple[list[list[int]], list[str], bool]:
    """A count exchange with ``check``'s records among ``sub`` (blocks the host): what each
    member sends this rank, and what disagrees (see :mod:`moecomm._peer_check`)."""
    if sub.size == 1:
        return check.sent, [], False
    got = sub._exchange_ints(check.record(), check.per_peer, f"{check.op} (count exchange)")[1]
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
    r1, issues, stuck = _records(h.intra, intra)
    found = _Counts(list(issues), stuck, intra if issues else None)
    # Rail step: to node m, the L counts [r1[l][m] for l]; from node n: rgrid[n].
    rail_sent = [[r1[l][m] for l in range(L)] for m in range(N)]
    if recv is None:
        rail = PeerCheck(f"{op}, rail", h.rail.rank, rail_sent, None, dtype, row_shape,
                         unit="rows (one count per source rank of its node)")
        rgrid, issues, stuck = _records(h.rail, rail)
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
            # exchanges them (None otherwise: see Communicator._start_records).
            found.rail_check = PeerCheck(f"{op}, rail", h.rail.rank, rail_sent, rgrid, dtype, row_shape,
                                         unit="rows (one count per source rank of its node)")
            found.rail_records = h.rail._start_records(found.rail_check)
    plan = Plan(tuple(send), tuple(recv), tuple(map(tuple, sgrid)), tuple(map(tuple, r1)), tuple(map(tuple, rgrid)))
    return plan, found


# -- the steps --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Exchange:
    sub: "Communicator"
    send: list[int]
    recv: list[int]
    name: str
    check: Optional[PeerCheck] = None  # records beside the rows (recv_splits given)
    records: Optional[tuple] = None  # ... already sent (Communicator._start_records)


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
        steps.append(_Exchange(h.intra, [sum(p.sgrid[m][k] for m in range(N)) for k in range(L)],
                               [sum(row) for row in p.r1], "intra"))
    if N > 1 and L > 1:
        steps.append(_Local(lambda x: _blocks.permute_blocks(x, p.r1), "regroup"))
    if N > 1:
        steps.append(_Exchange(h.rail, [sum(p.r1[l][m] for l in range(L)) for m in range(N)],
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
        steps.append(_Exchange(h.rail, [sum(row) for row in p.rgrid],
                               [sum(p.r1[l][m] for l in range(L)) for m in range(N)], "rail back"))
    if N > 1 and L > 1:
        steps.append(_Local(lambda x: _blocks.permute_blocks(x, p.r1, inverse=True), "regroup back"))
    if L > 1:
        steps.append(_Exchange(h.intra, [sum(row) for row in p.r1],
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

    def __init__(self, comm: "Communicator", h: Hierarchy, steps: list, x: torch.Tensor,
                 out: torch.Tensor, plan: Plan) -> None:
        self.plan = plan
        self._comm = comm
        self._h = h
        self._steps = steps
        self._out = out
        self._buf = x
        self._row_shape = tuple(x.shape[1:])
        self._i = 0
        self._current: Optional[Request] = None
        self._pooled: list[torch.Tensor] = []
        self._done = False
        self._ordered = comm._backend.stream_ordered
        if not steps:
            out.copy_(x)
            self._finish()
            return
        if self._ordered:
            self._run_ordered()
        else:
            h._pending.append(self)
            self._advance()

    # -- buffers --

    def _recv_buffer(self, rows: int, last: bool) -> torch.Tensor:
        if last:
            return self._out
        count = rows * math.prod(self._row_shape)
        buf = self._comm._staging(count, self._out.dtype).view((rows,) + self._row_shape)
        self._pooled.append(buf)
        return buf

    def _release(self, buf: torch.Tensor) -> None:
        for i, b in enumerate(self._pooled):
            if b is buf:
                del self._pooled[i]
                self._comm._unstage(b)
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
            request = step.sub._alltoallv(self._buf, step.send, recv, step.recv, check=step.check,
                                          records=step.records)
        else:
            request = step.sub._alltoallv(self._buf, step.send, recv, step.recv)
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

    def _unissued_on(self, sub: "Communicator") -> bool:
        return any(isinstance(s, _Exchange) and s.sub is sub for s in self._steps[self._i:])

    def _may_issue(self, sub: "Communicator") -> bool:
        for chain in self._h._pending:
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
                self._comm.abort()
            raise
        except BaseException:
            self._unpend()
            self._done = True
            self._comm.abort()
            raise

    def _unpend(self) -> None:
        try:
            self._h._pending.remove(self)
        except ValueError:
            pass

    def _finish(self) -> None:
        self._done = True
        self._unpend()
        for b in self._pooled:
            self._comm._unstage(b)
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
        for chain in list(self._h._pending):
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
        for chain in list(self._h._pending):
            chain._advance()
        return not self._h._pending


# -- entry points --------------------------------------------------------------------------


def start_all_to_all_v(
    comm: "Communicator",
    input: torch.Tensor,
    send_splits: Splits,
    recv_splits: Optional[Splits],
    algorithm: str,
) -> tuple[torch.Tensor, list[int], list[int], Request]:
    """``Communicator._start_all_to_all_v`` for ``algorithm`` "2dh" or "auto"."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    op = "all_to_all_v"
    comm._check_open(op)
    x = comm._check_tensor(input, "input", min_dim=1)
    if algorithm == "auto":
        algorithm = choose_algorithm(comm, x)
    if algorithm == "flat":
        return comm._start_all_to_all_v(x, send_splits, recv_splits)
    h = _require_hierarchy(comm)
    rows, row_shape = x.shape[0], tuple(x.shape[1:])
    send = normalize_splits(send_splits, "send_splits", comm.size)
    check_split_total(send, rows, "send_splits", "input")
    recv = None if recv_splits is None else comm._recv_splits(recv_splits, x)
    single_phase = h.contiguous and (h.num_nodes == 1 or h.local_size == 1)
    if not single_phase and comm._capturing():
        raise RuntimeError(
            f"moecomm: all_to_all_v(algorithm='2dh') cannot be captured into a CUDA graph on {h.num_nodes} nodes "
            f"x {h.local_size} ranks: its intra-node count exchange (what the node's ranks route through this "
            f"rank) waits on the host, also with recv_splits given; capture the flat exchange instead "
            f"(algorithm='flat', or 'auto', which is flat while capturing)")
    if h._pending:  # count exchanges use the sub-communicators too: keep their call order
        comm._wait_host(_Flush(h), "all_to_all_v (2dh, earlier exchanges)", None)
    if single_phase:
        # One node, or one rank per node: the other phase and both copies are empty, and
        # the sub-communicator holds every rank in rank order. Run the one phase as its flat
        # exchange (no plan: the backward is the flat reverse, the same exchange).
        sub = h.intra if h.num_nodes == 1 else h.rail
        return sub._start_all_to_all_v(x, send, recv)
    plan, counts = _make_plan(h, send, recv, x.dtype, row_shape, op + " (2dh)")
    if counts.issues and (counts.stuck or not comm._backend.mismatched_rows_complete):
        comm.abort()  # rows that could never arrive, or NCCL (pairs of different sizes): none move
        raise counts.error_check.error(counts.issues, moved=False, aborted=True)
    if comm.validate:
        try:
            comm._cross_check(op, list(plan.send), list(plan.recv), x.dtype, row_shape, None)
        except BaseException:
            h.rail._settle(counts.rail_records)
            raise
    out = torch.empty((sum(plan.recv),) + row_shape, dtype=x.dtype, device=x.device)
    request: Request
    from .communicator import _CheckedRequest, _RaiseAfter

    if math.prod(row_shape) == 0:  # the same on every rank: no bytes move anywhere
        request = _Done(plan)
        if counts.rail_records is not None:
            request = _CheckedRequest(comm, request, counts.rail_check, *counts.rail_records)
    else:
        request = _Chain(comm, h, _forward_steps(h, plan, counts), x, out, plan)
    if counts.issues:  # every rank completes its rows as planned (no peer waits), then raises
        request = _RaiseAfter(request, counts.error_check.error(counts.issues, moved=True))
    return out, list(plan.send), list(plan.recv), request


class _Done(DoneRequest):
    """A 2DH exchange with nothing to move (keeps its plan for the backward)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan


def reverse_all_to_all_v(comm: "Communicator", plan: Plan, grad: torch.Tensor) -> torch.Tensor:
    """The backward of a 2DH exchange: rows go back along the reversed phases (no counts exchanged)."""
    h = _require_hierarchy(comm)
    comm._check_open("all_to_all_v (2dh backward)")
    g = grad.contiguous()
    rows, row_shape = g.shape[0], tuple(g.shape[1:])
    if rows != sum(plan.recv):
        raise ValueError(f"grad_output has {rows} rows, but the exchange delivered {sum(plan.recv)}")
    out = torch.empty((sum(plan.send),) + row_shape, dtype=g.dtype, device=g.device)
    if math.prod(row_shape) == 0:
        return out
    chain = _Chain(comm, h, _reverse_steps(h, plan), g, out, plan)
    comm._complete(chain, "all_to_all_v (2dh backward)", None)
    return out
