"""Overlapped scatter/compute/gather: the MoE all-to-all pipelined with the experts' compute.

:func:`scatter_compute_gather` computes exactly what

    rows, recv = comm.all_to_all_v(input, send_splits)       # scatter to the experts' ranks
    out_rows = fn(rows, Chunk.full(recv, ...))               # the experts
    output, _ = comm.all_to_all_v(out_rows, recv, send_splits)  # gather back

computes, but cuts the rows into ``degree`` chunks and pipelines them: the scatter of every
chunk is issued first, ``fn`` runs on chunk ``c`` as soon as it has arrived (while the
later chunks are still in flight), and chunk ``c``'s results are sent back as soon as
``fn`` has produced them (while ``fn`` works on chunk ``c + 1``). The backward pass is
pipelined the same way: the output gradient is scattered chunk by chunk, ``fn``'s backward
runs per chunk, and each chunk's input gradient is sent back as soon as it is ready.

Chunking
--------
The rows that rank ``p`` sends to rank ``q`` (``n`` rows, a contiguous block of ``p``'s
input) are cut into ``k`` contiguous pieces, piece ``c`` being rows
``[c * n // k, (c + 1) * n // k)`` of the block (sizes differ by at most one; zeros
allowed). Piece ``c`` travels in stage ``c``; a pair cut into fewer pieces than there are
stages sends nothing in the later stages. Both ends derive ``k`` and the piece sizes from
``n`` alone, so no counts are exchanged beyond what ``all_to_all_v`` itself needs (none
when ``recv_splits`` is given). With an integer ``degree`` every pair is cut into
``degree`` pieces; with ``degree="auto"`` each pair gets as many pieces as its size
warrants (:func:`auto_pieces`), in at most :func:`auto_stages` stages.

In stage ``c`` ``fn`` receives the stage's rows grouped by source rank in rank order (the
same layout as ``all_to_all_v``'s output, restricted to the stage), and a :class:`Chunk`
describing them: per-source counts and offsets, per-row source ranks, the rows' positions
in the non-overlapped layout, and per-expert grouping (:meth:`Chunk.group_order`). ``fn``
must be row-wise in the sense that output row ``i`` belongs to input row ``i``: it returns
``[rows, *out_shape]`` with the same ``out_shape`` and dtype in every call and on every
rank. It is called once per stage, also with zero rows.

Own rows first
--------------
With ``own_first=True`` the rows a rank sends to itself form stages of their own. The
first ``round(own_split * n)`` of its ``n`` own rows are stage 0; the peers' pieces follow
in stages ``1..degree`` (so ``degree=1`` means: own rows, then all the peers' rows in one
exchange); with ``own_split < 1`` the rest of the own rows are one more stage, the last.
The own rows are never exchanged or copied: ``fn`` gets a view of ``input`` for them (it
must not write into its rows), and their results are copied into place. ``fn`` works on
the first own rows while the peers' rows are in flight, and on the last own rows while the
peers' results travel home, which hides up to the smaller of ``fn``'s time on each part
and one exchange, forward and backward (the backward pass the other way round: it starts
on the last own rows, whose output gradient needs no exchange, and ends on the first),
with no more exchanges than ``degree`` alone. Where the own rows are ``1/size`` of the
work (2 ranks: half) that is the cheapest overlap there is: the number of exchanges stays
that of the unchunked computation. ``own_split=1`` puts all own rows first: it hides
nothing of the last exchange.

On a GPU the peers' stages run on a stream of the communicator's own (waiting there for
their exchanges), while the caller's stream works on the own rows; the caller's stream
waits for the peers' stream before the last own rows (in the backward pass: before the
first own rows), so that they are computed while the last exchange is in flight rather
than alongside the peers' rows. With ``own_split=1`` the peers' stages are issued first on
the host, so that the autograd engine, which runs later-made nodes first, starts the
backward on the own rows. On the CPU (one thread) the stages run in order in the forward
pass and in reverse in the backward pass. ``fn``'s parameters are used once per stage;
their gradients are summed by autograd (the MoE layer's own experts sum them inside their
GEMMs instead: :class:`moecomm.moe.experts.WeightGradSum`).

Transport
---------
On NCCL and MPI with the flat algorithm (and ``validate=False``) a stage's rows leave from
where they lie in ``input`` and land where they belong in the output (per-peer
displacements; NCCL grouped send/recv, MPI ``Ialltoallv``; on a communicator with peer
memory, ``init(p2p_bytes=)``, the GPUs' copy engines, which leave the SMs to ``fn``):
nothing is packed or unpacked, and ``fn`` gets each stage's rows in a buffer of their own
(the own rows of ``own_first`` are a view of ``input``). Otherwise (``algorithm="2dh"``
or ``"auto"``, the torch backend, ``validate=True``) each stage is gathered into a
contiguous buffer and goes through ``comm.all_to_all_v`` (with its checks and algorithm),
and the results are scattered back into place.

Autograd
--------
The pipeline is four small autograd functions per stage around ``fn``'s own graph, so
``fn``'s parameters get their gradients through the ordinary engine (``backward`` and
``torch.autograd.grad`` alike). The engine runs later-created nodes first, so the backward
pass visits the stages last to first: the output gradient of every stage is scattered
first (last stage first), and each stage's input gradient is sent back as soon as ``fn``'s
backward for that stage has produced it.

Cost
----
Each stage costs the host a fixed time (two exchanges and ``fn``'s kernel launches
forward, the same backward; about 1 ms for a two-matmul expert on the 2 x H200 machine
measured), so chunking pays only when each stage's GPU work is larger than that. Small
layers are faster at ``degree=1`` (exactly the non-overlapped computation). Captured into a
CUDA graph (splits on the host, ``recv_splits`` given; see the README's "CUDA graphs") a
replay costs the host almost nothing, and the stage count is limited by the GPU only: on
2 x H200 with copy engines, 4 stages took 0.85x the time of degree 1 (where eagerly 4
stages were slower than 1; ``bench/results/h200x2/overlap_graph_ce.json``), and own rows
split around 2 peer stages (``own_first=True``) 0.77-0.78x captured, 0.78-0.81x eagerly
(``overlap_split_ce*.json``).

Streams (CUDA, NCCL backend)
----------------------------
Every exchange runs on the backend's own communication stream, ordered after the caller's
current stream at the moment it is issued; ``fn`` runs on the caller's current stream,
which waits (``wait_event``, no host synchronisation) on the event of the exchange that
brought its rows. The global current stream is never switched for the caller's code, but
for ``fn`` on the peers' rows of an ``own_first`` call (the communicator's stream for them,
ordered after the caller's and joined back into it before the call returns).
Buffers handed to the communication stream are protected by ``record_stream`` (the
backend's ``alltoallv`` does it), so the caching allocator never reuses a buffer a stream
still reads. When
the splits are host ints (or ``recv_splits`` is given) nothing in the pipeline blocks the
host; a device tensor of ``send_splits`` is read once (one synchronisation), and without
``recv_splits`` the counts are exchanged once up front (one blocking exchange).

CPU (MPI backend)
-----------------
The exchanges are nonblocking ``MPI_Ialltoallv``: all scatters are issued before ``fn``
runs on the first chunk, and each gather is issued before ``fn`` runs on the next chunk.
MPI moves data while the host polls (the communicator's waits poll continuously) and, for
messages under its eager limit, at once; for progress while ``fn`` itself computes, run
MPICH with ``MPIR_CVAR_ASYNC_PROGRESS=1``.

Failures
--------
If ``fn`` (or a check of its result) raises on a rank, that rank aborts the communicator
(it would otherwise be out of step with its peers: later collectives would match the wrong
exchange) and re-raises the exception; afterwards every call on that communicator raises
:class:`moecomm.CommunicatorClosedError`. Its peers are then waiting for chunks that never
come: their wait raises ``TimeoutError`` once the communicator's ``timeout`` has passed
(on the GPU, the NCCL watchdog aborts the communicator), and their communicator is aborted
too. Nothing hangs beyond the timeout. The same holds when ``fn``'s backward raises,
except that the raising rank's communicator is not aborted by moecomm (the autograd engine
raises past it): abort it (``comm.abort()``) before using it again.

Requirements shared with every collective: all ranks call with the same ``degree``,
``algorithm`` and row shape/dtype, and ``input.requires_grad`` agrees across ranks (the
backward pass is collective too).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from ._device_tables import int64_table
from .backends.base import DoneRequest, Request
from .communicator import SUPPORTED_DTYPES, Work
from .errors import CommunicatorClosedError
from .splits import Splits, check_own_block, check_split_total, normalize_splits

__all__ = ["scatter_compute_gather", "Chunk", "GroupOrder", "auto_pieces", "auto_stages", "MAX_DEGREE",
           "AUTO_RULES"]

MAX_DEGREE = 16
"""The largest ``degree`` (chunks per peer) accepted."""

AUTO_RULES: dict[str, tuple[int, int]] = {
    # transport: (at most this many stages, bytes per rank for each stage)
    "nccl": (4, 256 << 20),
    "nccl-copy-engines": (2, 128 << 20),
    "mpi": (2, 64 << 20),
    "torch": (2, 64 << 20),
    # while a CUDA graph is captured: replays cost the host nothing per stage
    "nccl/graph": (2, 128 << 20),
    "nccl-copy-engines/graph": (4, 64 << 20),
}
"""``degree="auto"`` without a topology profile: per transport (the backend's name, or
``"nccl-copy-engines"`` on a communicator with peer memory, ``init(p2p_bytes=)``),
``(max_stages, bytes_per_stage)``.

A pair's block of ``b`` bytes is cut into ``clamp(b * size // bytes_per_stage, 1,
max_stages)`` pieces (``b * size``: what a rank would exchange if every pair looked like
this one). Every stage costs the host a fixed time to issue (two exchanges and ``fn``
forward, the same again backward: about 1 ms on the 2 x H200 machine measured, where
degree 1 was fastest at 128 MiB per rank), so only exchanges large enough for each stage's
GPU work to hide that cost are chunked. With the copy engines (which leave the SMs to
``fn``), 2 stages beat 1 at 256 MiB per rank on that machine (0.89x, three runs), and 3 or
more lost to the host's cost per stage. While a CUDA graph is captured, the ``"/graph"``
entries apply: replays do not pay the host's cost per stage, and on that machine (256 MiB
per rank, three runs each) 4 stages were best with the copy engines (0.854-0.859x of degree
1; 2 stages 0.89-0.90x) and 2 or 3 over NCCL (0.94-0.95x; 4 stages 0.99-1.0x). A topology
profile with measured degrees (``python -m topology tune --degrees ...``) replaces this rule.
"""


def _rule(comm: Any) -> tuple[int, int]:
    key = "nccl-copy-engines" if getattr(comm, "_p2p", None) is not None else comm.backend
    capturing = getattr(comm, "_capturing", None)
    if capturing is not None and capturing() and key + "/graph" in AUTO_RULES:
        return AUTO_RULES[key + "/graph"]
    return AUTO_RULES.get(key, (1, 1))

DIRECT = True
"""Use the direct transport (displacements, no packing) where the backend allows it; set
False to send every stage through ``all_to_all_v`` instead (a fallback switch)."""

Fn = Callable[[torch.Tensor, "Chunk"], torch.Tensor]


# -- degree -----------------------------------------------------------------------------------


def _profile_of(comm: Any) -> Any:
    """The communicator's topology profile (:mod:`moecomm.profile`), if it was given one."""
    prof = getattr(comm, "profile", None)
    if prof is None:
        prof = getattr(getattr(comm, "_hier", None), "profile", None)  # set by moecomm.init(profile=...)
    return prof if prof is not None and hasattr(prof, "entry_for") and hasattr(prof, "entries") else None


def auto_stages(comm: Any) -> int:
    """How many stages ``degree="auto"`` may use on ``comm`` (the same on every rank).

    From the communicator's topology profile (``moecomm.init(profile=...)``) when it has one with
    measured degrees (their maximum), else from :data:`AUTO_RULES`; 1 on a single rank.
    """
    if comm.size == 1:
        return 1
    prof = _profile_of(comm)
    if prof is not None:
        degrees = [e.degree for e in prof.entries if e.degree]
        if degrees:
            return max(1, min(MAX_DEGREE, max(degrees)))
    return _rule(comm)[0]


def auto_pieces(comm: Any, pair_rows: Sequence[int], row_bytes: int) -> list[int]:
    """How many pieces ``degree="auto"`` cuts each pair's block into (``pair_rows[p]`` rows).

    A function of the pair's own size, so that both ends of a pair agree without talking:
    with a profile, the degree of the entry nearest to ``rows * row_bytes * size`` bytes
    per rank (what a rank would send if every pair looked like this one); else
    ``clamp(rows * row_bytes * size // bytes_per_stage, 1, max_stages)`` from
    :data:`AUTO_RULES`. Never more pieces than rows.
    """
    stages = auto_stages(comm)
    prof = _profile_of(comm)
    out = []
    for n in pair_rows:
        b = int(n) * row_bytes
        if stages == 1 or n <= 1:
            k = 1
        elif prof is not None and any(e.degree for e in prof.entries):
            k = prof.entry_for(b * comm.size).degree or 1
        else:
            per_stage = _rule(comm)[1]
            k = b * comm.size // max(per_stage, 1)
        out.append(int(max(1, min(k, stages, n if n > 0 else 1))))
    return out


def _check_degree(degree: Any) -> Union[int, str]:
    if isinstance(degree, str):
        if degree != "auto":
            raise ValueError(f"degree must be an int in [1, {MAX_DEGREE}] or 'auto', got {degree!r}")
        return degree
    if isinstance(degree, bool) or not isinstance(degree, numbers.Integral) or not 1 <= int(degree) <= MAX_DEGREE:
        raise ValueError(f"degree must be an int in [1, {MAX_DEGREE}] or 'auto', got {degree!r}")
    return int(degree)


# -- the chunk plan ---------------------------------------------------------------------------


def _bounds(counts: np.ndarray, pieces: np.ndarray, stages: int, first: Optional[np.ndarray] = None) -> np.ndarray:
    """``[stages + 1, W]``: where stage ``c``'s piece of each pair starts inside the pair's
    block; pair ``p``'s pieces travel in stages ``first[p]`` (default 0) to ``first[p] +
    pieces[p] - 1``."""
    c = np.arange(stages + 1, dtype=np.int64)[:, None]
    if first is not None:
        c = np.clip(c - first[None, :], 0, None)
    return (np.minimum(c, pieces[None, :]) * counts[None, :]) // pieces[None, :]


def _block_rows(offsets: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(offsets + starts, offsets + starts + lengths)`` over blocks."""
    lengths = lengths.ravel()
    begin = (offsets + starts).ravel()
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    out_start = np.cumsum(lengths) - lengths
    return np.repeat(begin - out_start, lengths) + np.arange(total, dtype=np.int64)


class _Plan:
    """Host-side chunking of one call: who sends how many rows in each stage."""

    def __init__(self, send: list[int], recv: list[int], send_pieces: list[int], recv_pieces: list[int],
                 peer_stages: int, device: torch.device, own: Optional[int] = None, own_split: float = 1.0) -> None:
        """``peer_stages``: the stages the pairs' pieces travel in. ``own``: this rank, when its
        own rows form stages of their own (no exchange): stage 0 with the first
        ``round(own_split * rows)`` of them, and with ``own_split < 1`` one more stage, the
        last, with the rest (the same on every rank: so is :attr:`stages`)."""
        self.own_last = own is not None and own_split < 1.0
        stages = peer_stages + (own is not None) + self.own_last
        self.stages = stages
        self.device = device
        self.send = send
        self.recv = recv
        self.own = own
        self.own_stages = () if own is None else (0, stages - 1) if self.own_last else (0,)
        W = len(send)
        s = np.asarray(send, dtype=np.int64)
        r = np.asarray(recv, dtype=np.int64)
        send_p = np.asarray(send_pieces, dtype=np.int64)
        recv_p = np.asarray(recv_pieces, dtype=np.int64)
        first = None  # the stage of each pair's first piece: 0, or 1 for the peers after the own stage
        if own is not None:
            first = np.ones(W, dtype=np.int64)
            first[own] = 0
            send_p[own] = recv_p[own] = 1
        self.send_bounds = _bounds(s, send_p, stages, first)  # [S+1, W]
        self.recv_bounds = _bounds(r, recv_p, stages, first)
        if self.own_last:  # the own pair: its first rows in stage 0, the rest in the last stage
            n = int(s[own])
            self.send_bounds[1:stages, own] = self.recv_bounds[1:stages, own] = min(n, max(0, round(own_split * n)))
        send_c = np.diff(self.send_bounds, axis=0)  # [S, W]
        recv_c = np.diff(self.recv_bounds, axis=0)
        self.send_counts = send_c.tolist()
        self.recv_counts = recv_c.tolist()
        self.send_offsets = np.cumsum(s) - s
        self.recv_offsets = np.cumsum(r) - r
        totals = send_c.sum(axis=1)
        self.stage_rows = np.concatenate([[0], np.cumsum(totals)]).tolist()  # into the chunk-major order
        self.identity = stages == 1
        self._perm: Optional[torch.Tensor] = None
        self._send_c = send_c
        # direct exchanges: stage c's rows for peer p start at row send_displs[c][p] of the
        # input (and land there in the output); they arrive grouped by source in a buffer of
        # its own, source p's at row chunk_displs[c][p]
        self.send_displs = (self.send_offsets[None, :] + self.send_bounds[:-1]).tolist()
        self.chunk_displs = (np.cumsum(recv_c, axis=1) - recv_c).tolist()
        self.recv_totals = recv_c.sum(axis=1).tolist()

    def is_local(self, c: int) -> bool:
        """Stage ``c`` holds only the rank's own rows: nothing to exchange."""
        return c in self.own_stages

    def own_rows(self, t: torch.Tensor, c: int) -> torch.Tensor:
        """Stage ``c``'s part of the rank's own block of ``t`` (laid out like the input): a
        view, no copy."""
        me = self.own
        return t.narrow(0, int(self.send_displs[c][me]), int(self.send_bounds[c + 1, me] - self.send_bounds[c, me]))

    def perm(self) -> torch.Tensor:
        """Input row of each row in stage-major order (stage 0's rows for every peer first)."""
        if self._perm is None:
            idx = _block_rows(self.send_offsets[None, :], self.send_bounds[:-1], self._send_c)
            self._perm = int64_table(idx, self.device)
        return self._perm

    def pack(self, x: torch.Tensor, c: int) -> torch.Tensor:
        """Stage ``c``'s rows of ``x`` (input order), grouped by destination."""
        if self.identity:
            return x
        lo, hi = self.stage_rows[c], self.stage_rows[c + 1]
        return x.index_select(0, self.perm()[lo:hi])

    def unpack(self, parts: list[torch.Tensor], row_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Put each stage's rows (grouped by destination) back at their input positions."""
        if self.identity:
            return parts[0]
        out = torch.empty((self.stage_rows[-1],) + tuple(row_shape), dtype=dtype, device=self.device)
        perm = self.perm()
        for c, part in enumerate(parts):
            lo, hi = self.stage_rows[c], self.stage_rows[c + 1]
            if hi > lo:
                out.index_copy_(0, perm[lo:hi], part)
        return out


# -- what fn is told --------------------------------------------------------------------------


class GroupOrder:
    """Rows of a chunk regrouped by group (local expert): ``rows[order]`` holds group 0's rows
    (from every source, in source order), then group 1's, ...; ``sizes[g]`` rows each.

    Undo with ``torch.empty_like(y).index_copy_(0, order, y)`` (or ``y[inverse]``)."""

    __slots__ = ("order", "sizes", "_inverse")

    def __init__(self, order: torch.Tensor, sizes: list[int]) -> None:
        self.order = order
        self.sizes = sizes
        self._inverse: Optional[torch.Tensor] = None

    @property
    def inverse(self) -> torch.Tensor:
        if self._inverse is None:
            inv = torch.empty_like(self.order)
            inv[self.order] = torch.arange(self.order.numel(), device=self.order.device)
            self._inverse = inv
        return self._inverse

    def __iter__(self):
        return iter((self.order, self.sizes))


class Chunk:
    """What ``fn`` is told about the rows of one stage.

    Attributes:
        index: the stage, ``0 <= index < degree``.
        degree: the number of stages of this call.
        source_splits: rows from each source rank in this chunk (``size`` ints); the chunk's
            rows are grouped by source, in rank order.
        source_offsets: where this chunk's rows from source ``p`` start inside everything
            ``p`` sends here (its block of the non-overlapped ``all_to_all_v`` output).
        recv_splits: the whole exchange's rows from each source (all stages together).
        device: where the rows live.
    """

    __slots__ = ("index", "degree", "source_splits", "source_offsets", "recv_splits", "device", "_cache")

    def __init__(self, index: int, degree: int, source_splits: list[int], source_offsets: list[int],
                 recv_splits: list[int], device: torch.device) -> None:
        self.index = index
        self.degree = degree
        self.source_splits = source_splits
        self.source_offsets = source_offsets
        self.recv_splits = recv_splits
        self.device = device
        self._cache: dict = {}

    @classmethod
    def full(cls, recv_splits: Sequence[int], device: Union[str, torch.device] = "cpu") -> "Chunk":
        """The chunk that stands for a whole non-overlapped exchange (to call ``fn`` on the
        output of a plain ``all_to_all_v``)."""
        recv = [int(v) for v in recv_splits]
        return cls(0, 1, recv, [0] * len(recv), recv, torch.device(device))

    @property
    def rows(self) -> int:
        return sum(self.source_splits)

    def __repr__(self) -> str:
        return f"<moecomm.overlap.Chunk {self.index}/{self.degree} source_splits={self.source_splits}>"

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        return int64_table(a, self.device)

    def source_ranks(self) -> torch.Tensor:
        """``[rows]`` int64 on :attr:`device`: the source rank of each row (cached)."""
        t = self._cache.get("src")
        if t is None:
            counts = np.asarray(self.source_splits, dtype=np.int64)
            t = self._to_device(np.repeat(np.arange(len(counts), dtype=np.int64), counts))
            self._cache["src"] = t
        return t

    def positions(self) -> torch.Tensor:
        """``[rows]`` int64 on :attr:`device`: each row's index in the non-overlapped
        ``all_to_all_v`` output (cached)."""
        t = self._cache.get("pos")
        if t is None:
            r = np.asarray(self.recv_splits, dtype=np.int64)
            offsets = np.cumsum(r) - r
            t = self._to_device(_block_rows(offsets, np.asarray(self.source_offsets, dtype=np.int64),
                                            np.asarray(self.source_splits, dtype=np.int64)))
            self._cache["pos"] = t
        return t

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The rows of ``full`` (laid out like the non-overlapped output) that belong to this chunk."""
        if self.degree == 1 and full.shape[0] == self.rows:
            return full
        return full.index_select(0, self.positions().to(full.device))

    def _group_table(self, counts: Any) -> np.ndarray:
        m = np.asarray(counts.tolist() if isinstance(counts, torch.Tensor) else counts, dtype=np.int64)
        if m.ndim != 2 or m.shape[0] != len(self.recv_splits):
            raise ValueError(f"counts must be [{len(self.recv_splits)} sources][groups], got shape {m.shape}")
        if (m < 0).any() or m.sum(axis=1).tolist() != list(self.recv_splits):
            raise ValueError(f"counts rows must be >= 0 and sum to recv_splits {self.recv_splits}, "
                             f"got sums {m.sum(axis=1).tolist()}")
        return m

    def group_splits(self, counts: Any) -> list[list[int]]:
        """Per source, per group: this chunk's row counts.

        ``counts[p][g]`` is how many of the rows from source ``p`` (all stages together)
        belong to group ``g`` (e.g. local expert ``g``), rows of a source being sorted by
        group, as MoE dispatch sends them. Host ints in, host ints out: no synchronisation.
        """
        m = self._group_table(counts)
        gb = np.concatenate([np.zeros((m.shape[0], 1), dtype=np.int64), np.cumsum(m, axis=1)], axis=1)
        lo = np.asarray(self.source_offsets, dtype=np.int64)[:, None]
        hi = lo + np.asarray(self.source_splits, dtype=np.int64)[:, None]
        part = np.clip(np.minimum(hi, gb[:, 1:]) - np.maximum(lo, gb[:, :-1]), 0, None)
        return part.tolist()

    def group_order(self, counts: Any) -> GroupOrder:
        """How to regroup this chunk's rows by group across sources (see :class:`GroupOrder`).

        ``counts`` as for :meth:`group_splits`. The index is built on the host and copied
        to the device without synchronisation.
        """
        part = np.asarray(self.group_splits(counts), dtype=np.int64)  # [W, G]
        w, g = part.shape
        starts = (np.cumsum(part.ravel()) - part.ravel()).reshape(w, g)  # p-major layout in the chunk
        order = _block_rows(np.zeros(1, dtype=np.int64), starts.T, part.T)
        return GroupOrder(self._to_device(order), part.sum(axis=0).tolist())


# -- the pipeline -----------------------------------------------------------------------------


class _Transport:
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

    def __init__(self, comm: Any, kw: dict) -> None:
        self.comm = comm
        b = getattr(comm, "_backend", None)
        self.backend = b
        self.mode = "generic"
        if (DIRECT and kw.get("algorithm", "flat") == "flat" and not comm.validate and b is not None
                and b.supports_displacements):
            self.mode = "direct"

    @property
    def direct(self) -> bool:
        return self.mode != "generic"

    def exchange(self, send: torch.Tensor, send_counts: list[int], send_displs: list[int], recv: torch.Tensor,
                 recv_counts: list[int], recv_displs: list[int]) -> Any:
        comm = self.comm
        if comm.closed:
            raise CommunicatorClosedError(f"moecomm: cannot run {self.OP}: the communicator is closed")
        b = self.backend
        row_bytes = math.prod(send.shape[1:]) * send.element_size()
        if row_bytes == 0:  # the same on every rank (row shapes agree): nothing moves anywhere
            request: Request = DoneRequest()
        elif comm._p2p is not None:  # copy engines through peer memory: every rank takes part, always
            request = comm._p2p.exchange(send, send_counts, send_displs, recv, recv_counts, recv_displs, row_bytes)
        elif b.stream_ordered and not (any(send_counts) or any(recv_counts)):
            b.check_health()  # point to point: a peer expects nothing from a rank that sends nothing
            request = DoneRequest()
        else:
            request = b.alltoallv(send, send_counts, recv, recv_counts, row_bytes, send_displs, recv_displs)
        return Work(comm, request, self.OP, (recv, None))


class _Run:
    """One call: the plan, fn, and the exchanges in flight (forward and backward)."""

    def __init__(self, comm: Any, plan: _Plan, fn: Fn, a2a_kwargs: dict, wire_dtype: Any = None) -> None:
        self.comm = comm
        self.plan = plan
        self.fn = fn
        self.kw = a2a_kwargs
        self.wire = wire_dtype  # the input's rows travel packed in this FP8 dtype (moecomm.wire)
        s = plan.stages
        self.scatter: list = [None] * s  # forward: input rows to the experts
        self.gather: list = [None] * s  # forward: fn's rows back
        self.grad_scatter: list = [None] * s  # backward: output gradient to the experts
        self.grad_gather: list = [None] * s  # backward: input gradient back
        self.out_shape: Optional[tuple] = None
        self.out_dtype: Optional[torch.dtype] = None
        self.in_shape: tuple = ()
        self.in_dtype: Optional[torch.dtype] = None
        self.transport = _Transport(comm, a2a_kwargs)
        self.out: Optional[torch.Tensor] = None  # direct: the output, filled stage by stage
        self.grad_in: Optional[torch.Tensor] = None  # direct: the input gradient, likewise
        # own_first on a GPU: fn runs on the peers' rows on the communicator's stream for them
        # (waiting for their exchanges there) while the caller's stream works on the own rows
        cuda = plan.device.type == "cuda"
        self.main = torch.cuda.current_stream(plan.device) if cuda else None
        self.side = comm._peer_rows_stream() if cuda and plan.own is not None else None
        self._side_joined = False

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
        """A whole output (or input gradient), allocated on the caller's stream."""
        with contextlib.nullcontext() if self.main is None else torch.cuda.stream(self.main):
            return torch.empty(shape, dtype=dtype, device=self.plan.device)

    def _local(self, rows: torch.Tensor) -> Any:
        return Work(self.comm, DoneRequest(), self.transport.OP, (rows, None))

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
                if w is not None and not w.is_completed():
                    self.comm._abandoned.append(w)
        self.comm.abort()

    # forward
    def issue_scatter(self, x: torch.Tensor) -> None:
        self.in_shape, self.in_dtype = tuple(x.shape[1:]), x.dtype
        if self.wire is not None:  # one fused pass: every row quantized and packed (own rows too)
            from .quant import pack_rows
            from .wire import WIRE_BLOCK

            x = pack_rows(x.detach(), self.wire, WIRE_BLOCK)
        p = self.plan
        for c in range(p.stages):
            self.scatter[c] = self._to_experts(x, c)

    def _to_experts(self, x: torch.Tensor, c: int) -> Any:
        """Stage ``c``'s rows of ``x`` (laid out like the input) to the experts' ranks."""
        p, t = self.plan, self.transport
        if p.is_local(c):
            return self._local(p.own_rows(x.detach(), c))
        if not t.direct:
            return self._a2a(p.pack(x, c), p.send_counts[c], p.recv_counts[c])
        buf = torch.empty((p.recv_totals[c],) + tuple(x.shape[1:]), dtype=x.dtype, device=p.device)
        return t.exchange(x, p.send_counts[c], p.send_displs[c], buf, p.recv_counts[c], p.chunk_displs[c])

    def _from_experts(self, y: torch.Tensor, c: int, dest: Optional[torch.Tensor]) -> tuple:
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
        return t.exchange(y, p.recv_counts[c], p.chunk_displs[c], dest, p.send_counts[c], p.send_displs[c]), dest

    def wait_scatter(self, c: int) -> torch.Tensor:
        rows, _ = self._wait(self.scatter[c])
        self.scatter[c] = None
        if self.wire is not None:
            from .quant import unpack_rows
            from .wire import WIRE_BLOCK

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
        self.gather[c], self.out = self._from_experts(y, c, self.out)

    def _drain(self, works: list, whole: Optional[torch.Tensor], row_shape: tuple, dtype: Any) -> torch.Tensor:
        """Wait for every stage's exchange in ``works``; the result: ``whole`` (direct: the
        exchanges landed in it), else the stages' rows put back in input order."""
        parts = []
        for c in range(self.plan.stages):
            rows, _ = self._wait(works[c])
            works[c] = None
            parts.append(rows)
        return whole if self.transport.direct else self.plan.unpack(parts, row_shape, dtype)

    def collect(self) -> torch.Tensor:
        out = self._drain(self.gather, self.out, self.out_shape, self.out_dtype)
        self.out = None
        return out

    # backward
    def issue_grad_scatter(self, grad: torch.Tensor) -> None:
        for c in reversed(range(self.plan.stages)):  # the autograd engine runs the last stage's backward first
            self.grad_scatter[c] = self._to_experts(grad, c)

    def wait_grad_scatter(self, c: int) -> torch.Tensor:
        g, _ = self._wait(self.grad_scatter[c])
        self.grad_scatter[c] = None
        return self._used_here(g)

    def issue_grad_gather(self, c: int, g: torch.Tensor) -> None:
        self.grad_gather[c], self.grad_in = self._from_experts(g.contiguous(), c, self.grad_in)

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


class _Scatter(torch.autograd.Function):
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


class _Arrive(torch.autograd.Function):
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


class _Depart(torch.autograd.Function):
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


class _Collect(torch.autograd.Function):
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


# -- the entry point --------------------------------------------------------------------------


def scatter_compute_gather(
    comm: Any,
    input: torch.Tensor,
    send_splits: Splits,
    fn: Fn,
    *,
    degree: Union[int, str] = 2,
    recv_splits: Optional[Splits] = None,
    algorithm: Optional[str] = None,
    own_first: bool = False,
    own_split: float = 0.3,
    wire_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``all_to_all_v -> fn -> all_to_all_v`` back, pipelined in ``degree`` stages.

    Args:
        comm: the :class:`moecomm.Communicator`.
        input: ``[N, *row_shape]`` on ``comm.device``; rows grouped by destination rank.
        send_splits: rows for each rank (``size`` ints, or a 1-D integer tensor).
        fn: ``fn(rows, chunk) -> out_rows``: ``rows`` is ``[chunk.rows, *row_shape]``
            grouped by source rank, ``chunk`` a :class:`Chunk`; returns
            ``[chunk.rows, *out_shape]`` (row ``i`` computed from row ``i``). Called once
            per stage, on the caller's current stream, possibly with zero rows.
        degree: chunks per peer, 1 to :data:`MAX_DEGREE`, or ``"auto"``
            (:func:`auto_pieces`). 1 is the non-overlapped computation.
        recv_splits: rows from each rank, if known (else exchanged once, up front).
        algorithm: passed to every ``all_to_all_v`` of the pipeline (e.g. ``"2dh"``); None:
            its default. ``"auto"`` is decided once per call, for the whole input.
        own_first: the rank's own rows form a stage of their own (stage 0), which ``fn``
            works on while the peers' rows (cut into ``degree`` stages) are in flight; they
            are neither exchanged nor copied on the way in (``fn`` gets a view of
            ``input``). The backward pass likewise starts on the own rows. See "Own rows
            first" above.
        own_split: with ``own_first``, the fraction (0 to 1) of the own rows computed
            first; the rest form a last stage, computed while the peers' results travel
            home (in the backward pass the other way round). 1: all of them first. The
            default, 0.3, was the best of 0.3, 0.5 and 1 on 2 x H200 (an expert FFN,
            ``bench/results/h200x2/overlap_split_ce*.json``).
        wire_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``: the input's rows travel
            quantized (as ``all_to_all_v(..., wire_dtype=)``; the own rows of ``own_first``
            are quantized too) and ``fn`` gets them dequantized to ``input.dtype``; results
            and gradients travel in their own dtype. The gradient with respect to ``input``
            is the straight-through one. ``input`` must be float32, bfloat16 or float16.

    Returns:
        ``[N, *out_shape]``: row ``i`` is ``fn``'s result for ``input`` row ``i``, exactly
        as without overlap. Differentiable in ``input`` and in whatever ``fn`` uses
        (parameters); the backward pass is pipelined the same way.
    """
    if comm.closed:
        raise CommunicatorClosedError("moecomm: cannot run scatter_compute_gather: the communicator is closed")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if input.dim() < 1:
        raise ValueError(f"input must have at least 1 dimension (rows along dim 0), got shape {tuple(input.shape)}")
    dev = comm.device
    if input.device.type != dev.type or (dev.type == "cuda" and input.device.index != dev.index):
        raise ValueError(f"input must be on {dev} (the communicator's device), got a tensor on {input.device}")
    if input.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"input has unsupported dtype {input.dtype}; supported: {sorted(map(str, SUPPORTED_DTYPES))}")
    degree = _check_degree(degree)
    if wire_dtype is not None:
        from .quant import INPUT_DTYPES, check_wire_dtype

        check_wire_dtype(wire_dtype)
        if input.dtype not in INPUT_DTYPES:
            raise TypeError(f"input must be float32, bfloat16 or float16 to be sent with wire_dtype={wire_dtype}, "
                            f"got {input.dtype}")
    if not isinstance(own_first, bool):
        raise TypeError(f"own_first must be a bool, got {own_first!r}")
    if isinstance(own_split, bool) or not isinstance(own_split, numbers.Real) or not 0.0 <= own_split <= 1.0:
        raise ValueError(f"own_split must be a number in [0, 1], got {own_split!r}")
    if algorithm == "auto":
        # Decided once for the whole call (one collective), not once per stage.
        from .hierarchical import choose_algorithm

        algorithm = choose_algorithm(comm, input)
    kw = {} if algorithm is None else {"algorithm": algorithm}
    w = comm.size
    send = normalize_splits(send_splits, "send_splits", w)
    check_split_total(send, input.shape[0], "send_splits", "input")
    if recv_splits is None:
        recv = comm._exchange_counts(send, "send_splits")[1]
    else:
        recv = normalize_splits(recv_splits, "recv_splits", w)
        check_own_block(send, recv, comm.rank)

    if degree == "auto":
        row_bytes = math.prod(input.shape[1:]) * input.element_size()
        stages = auto_stages(comm)
        send_pieces, recv_pieces = auto_pieces(comm, send, row_bytes), auto_pieces(comm, recv, row_bytes)
    else:
        stages = degree
        send_pieces = recv_pieces = [degree] * w
    own = comm.rank if own_first and w > 1 else None
    plan = _Plan(send, recv, send_pieces, recv_pieces, stages, dev, own, float(own_split))
    run = _Run(comm, plan, fn, kw, wire_dtype)

    x = input.contiguous()
    if wire_dtype is not None and comm.validate:
        from . import wire

        wire.cross_check(comm, x, wire_dtype, "scatter_compute_gather")
    tokens = _Scatter.apply(x, run)
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
                rows = _Arrive.apply(tokens[c], run, c)
                y = run.check_result(c, fn(rows, run.chunk(c)), rows.shape[0])
                departed[c] = _Depart.apply(y, run, c)
        run.join_side()
    except BaseException:
        run.abandon()
        raise
    return _Collect.apply(run, *departed)
