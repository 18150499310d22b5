"""The chunk plan of one ``scatter_compute_gather`` call: how many pieces each pair's rows
are cut into (``degree``, or ``"auto"`` from a topology profile or the built-in rule), and
which rows travel in which stage. Host-side only; see docs/overlap.md, "Chunking"."""

from __future__ import annotations

import numbers
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from ..engine.device_tables import int64_table

__all__ = ["MAX_DEGREE", "Plan", "auto_pieces", "auto_stages", "check_degree", "block_rows"]

MAX_DEGREE = 16
"""The largest ``degree`` (chunks per peer) accepted."""

_AUTO_RULES: Mapping[str, tuple[int, int]] = MappingProxyType({
    # transport: (at most this many stages, bytes per rank for each stage)
    "nccl": (4, 256 << 20),
    "nccl-copy-engines": (2, 128 << 20),
    "mpi": (2, 64 << 20),
    "torch": (2, 64 << 20),
    # while a CUDA graph is captured: replays cost the host nothing per stage
    "nccl/graph": (2, 128 << 20),
    "nccl-copy-engines/graph": (4, 64 << 20),
})
"""``degree="auto"`` without a topology profile: per transport (the backend's name, or
``"nccl-copy-engines"`` on a communicator with peer memory, ``init(p2p_bytes=)``),
``(max_stages, bytes_per_stage)``; read-only.

A pair's block of ``b`` bytes is cut into ``clamp(b * size // bytes_per_stage, 1,
max_stages)`` pieces (``b * size``: what a rank would exchange if every pair looked like
this one). Every stage costs the host a fixed time to issue (two exchanges and ``fn``
forward, the same again backward), so only exchanges large enough for each stage's GPU
work to hide that cost are chunked. While a CUDA graph is captured, the ``"/graph"``
entries apply: replays do not pay the host's cost per stage. The values are measured
(bench/results/README.md, "overlap"). A topology profile with measured degrees
(``python -m topology tune --degrees ...``, then ``init(profile=...)``) replaces this rule.
"""


def _rule(comm: Any) -> tuple[int, int]:
    engine = getattr(comm, "engine", None)
    key = "nccl-copy-engines" if getattr(engine, "peer", None) is not None else comm.backend
    capturing = getattr(engine, "capturing", None)
    if capturing is not None and capturing() and key + "/graph" in _AUTO_RULES:
        return _AUTO_RULES[key + "/graph"]
    return _AUTO_RULES.get(key, (1, 1))


# -- degree -----------------------------------------------------------------------------------


def _profile_of(comm: Any) -> Any:
    """The communicator's topology profile (:mod:`moecomm.profile`), if it was given one."""
    prof = getattr(comm, "profile", None)
    if prof is None:
        prof = getattr(getattr(comm, "topology", None), "profile", None)  # moecomm.init(profile=...)
    return prof if prof is not None and hasattr(prof, "entry_for") and hasattr(prof, "entries") else None


def auto_stages(comm: Any) -> int:
    """How many stages ``degree="auto"`` may use on ``comm`` (the same on every rank).

    From the communicator's topology profile (``moecomm.init(profile=...)``) when it has one with
    measured degrees (their maximum), else from :data:`_AUTO_RULES`; 1 on a single rank.
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
    :data:`_AUTO_RULES`. Never more pieces than rows.
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


def check_degree(degree: Any) -> Union[int, str]:
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


def block_rows(offsets: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(offsets + starts, offsets + starts + lengths)`` over blocks."""
    lengths = lengths.ravel()
    begin = (offsets + starts).ravel()
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    out_start = np.cumsum(lengths) - lengths
    return np.repeat(begin - out_start, lengths) + np.arange(total, dtype=np.int64)


class Plan:
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
            idx = block_rows(self.send_offsets[None, :], self.send_bounds[:-1], self._send_c)
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
