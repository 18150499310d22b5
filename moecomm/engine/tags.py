"""What every host-backend exchange says about itself, in the envelope of its messages.

On MPI every row exchange (and every exchange of counts) goes as one point-to-point message
per peer, empty blocks included, whose MPI tag (29 bits, the smallest ``MPI_TAG_UB`` of
mpich) describes it, and whose received size is the exact number of bytes sent: nothing is
added to what travels. The receiver of each message compares the tag with what it expects
of that peer, so both ranks of a disagreeing pair find it where the rows land:

=========  ====  ==========================================================================
field      bits  what
=========  ====  ==========================================================================
seq        5     the engine's exchange number, mod 32 (exchanges never pair across calls)
label      4     what exchange this is (:data:`LABELS`: forward, backward, counts, a stage)
meta       8     crc of (dtype, row shape, wire dtype) mod 256
sent       6     what the sender sends the receiver: its count mod 64 (a list: crc mod 64)
expected   6     what the sender expects from the receiver, likewise
=========  ====  ==========================================================================

The byte count is checked exactly; counts of the same byte total (2DH's per-source counts)
by their 6-bit hashes, so a disagreement is missed only where every field collides.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import zlib
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional, Sequence

import torch

from .dtypes import SUPPORTED_DTYPES
from ..errors import CountMismatchError

__all__ = ["LABELS", "TagPlan", "labelled", "current", "using", "meta_code", "count_code", "META_FIELDS",
           "ExchangeMeta", "exchange_meta"]

LABELS = ("all_to_all_v", "all_to_all_v backward", "count exchange", "all_to_all_single", "all_to_all",
          "scatter_compute_gather scatter", "scatter_compute_gather gather",
          "scatter_compute_gather gradient scatter", "scatter_compute_gather gradient gather")
"""The exchanges a tag tells apart (its ``label`` field is the index here)."""

_SEQ, _LABEL, _META, _SENT, _EXP = 5, 4, 8, 6, 6


@dataclass(frozen=True)
class Context:
    label: str = "all_to_all_v"
    wire: Optional[torch.dtype] = None


class _ThreadContext(threading.local):
    ctx = Context()  # (a class default: a thread that set none reads it without a failed lookup)


_local = _ThreadContext()


def current() -> Context:
    """The label and wire dtype the exchanges issued now carry."""
    return _local.ctx


@contextlib.contextmanager
def using(ctx: Context) -> Iterator[None]:
    """Issue exchanges under ``ctx`` (a chain's phases issued later keep their call's)."""
    before = current()
    _local.ctx = ctx
    try:
        yield
    finally:
        _local.ctx = before


def labelled(label: Optional[str] = None, wire: Optional[torch.dtype] = None) -> "contextlib.AbstractContextManager":
    """The exchanges issued inside carry ``label`` (one of :data:`LABELS`; None: unchanged)
    and ``wire`` (None: unchanged)."""
    ctx = current()
    if label is not None and label not in LABELS:
        raise ValueError(f"label must be one of {LABELS}, got {label!r}")
    return using(Context(ctx.label if label is None else label, ctx.wire if wire is None else wire))


def meta_code(dtype: torch.dtype, row_shape: Sequence[int], wire: Optional[torch.dtype]) -> int:
    return zlib.crc32(f"{dtype}|{tuple(int(s) for s in row_shape)}|{wire}".encode()) & 0xFF


META_FIELDS = ("kind of exchange", "dtype", "row shape", "wire dtype")
"""What :func:`exchange_meta` describes, field by field."""


class ExchangeMeta(NamedTuple):
    """What an exchange is (:data:`META_FIELDS`): ``codes`` (non-negative 31-bit ints, equal on
    ranks that agree) and the same in ``words`` (for errors)."""

    codes: tuple[int, int, int, int]
    words: tuple[str, str, str, str]


def exchange_meta(dtype: torch.dtype, row_shape: Sequence[int]) -> ExchangeMeta:
    """The exchange issued now: its label (:data:`LABELS`), dtype, row shape and wire dtype.
    For backends that carry this description in their own agreement (the peer backend's
    records) rather than in message tags. ``row_shape``: a tuple (``torch.Size`` included) or
    any sequence of ints."""
    ctx = _local.ctx  # (current(), inlined: this runs on every exchange of the peer backend)
    return _described(ctx.label, ctx.wire, dtype, row_shape if isinstance(row_shape, tuple) else tuple(row_shape))


@functools.lru_cache(maxsize=256)  # an explicit cache: a training loop asks the same few each step
def _described(label: str, wire: Optional[torch.dtype], dtype: torch.dtype, row_shape: tuple) -> ExchangeMeta:
    shape = str(tuple(int(s) for s in row_shape))
    words = (label, str(dtype), shape, str(wire))
    return ExchangeMeta((LABELS.index(label), _crc(words[1]), _crc(shape), _crc(words[3])), words)


def _crc(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def count_code(counts: Sequence[int]) -> int:
    """One peer's counts as 6 bits: a single count mod 64, a list by its crc."""
    if len(counts) == 1:
        return int(counts[0]) & 0x3F
    return zlib.crc32(repr([int(c) for c in counts]).encode()) & 0x3F


def _pack(seq: int, label: int, meta: int, sent: int, expected: int) -> int:
    tag = seq & 0x1F
    tag |= label << _SEQ
    tag |= meta << (_SEQ + _LABEL)
    tag |= sent << (_SEQ + _LABEL + _META)
    tag |= expected << (_SEQ + _LABEL + _META + _SENT)
    return tag


def _unpack(tag: int) -> tuple[int, int, int, int, int]:
    seq = tag & 0x1F
    label = (tag >> _SEQ) & 0xF
    meta = (tag >> (_SEQ + _LABEL)) & 0xFF
    sent = (tag >> (_SEQ + _LABEL + _META)) & 0x3F
    expected = (tag >> (_SEQ + _LABEL + _META + _SENT)) & 0x3F
    return seq, label, meta, sent, expected


class TagPlan:
    """The tags of one exchange on one rank: ``send[p]``/``recv[p]`` counts (one or more per
    peer, ``unit`` each) of rows of ``row_bytes`` bytes, ``dtype`` rows of ``row_shape``."""

    def __init__(self, op: str, rank: int, seq: int, send: Sequence[Sequence[int]], recv: Sequence[Sequence[int]],
                 row_bytes: int, dtype: torch.dtype, row_shape: Sequence[int], unit: str = "rows",
                 label: Optional[str] = None) -> None:
        ctx = current()
        self.op, self.rank, self.seq = op, rank, seq
        self.send = [list(s) for s in send]
        self.recv = [list(r) for r in recv]
        self.row_bytes = row_bytes
        self.dtype, self.row_shape, self.wire = dtype, tuple(row_shape), ctx.wire
        self.unit = unit
        self.label = ctx.label if label is None else label
        self.meta = meta_code(dtype, row_shape, ctx.wire)
        code = LABELS.index(self.label)
        self.tags = [_pack(seq, code, self.meta, count_code(self.send[p]), count_code(self.recv[p]))
                     for p in range(len(self.send))]
        self.expect = [_pack(seq, code, self.meta, count_code(self.recv[p]), count_code(self.send[p]))
                       for p in range(len(self.send))]

    def issues(self, arrived: Sequence[tuple[int, Optional[int]]]) -> list[str]:
        """What disagrees, from what arrived from each peer: (its tag, its bytes, or None where
        it sent more than this rank expected)."""
        out: list[str] = []
        me = self.rank
        for p, (tag, nbytes) in enumerate(arrived):
            want = self.recv[p]
            exp_bytes = sum(want) * self.row_bytes
            if tag == self.expect[p] and nbytes == exp_bytes:
                continue
            seq, label, meta, sent, expected = _unpack(tag)
            mine = _unpack(self.expect[p])
            if label != mine[1] or seq != mine[0]:
                out.append(f"rank {p} is in another exchange ({LABELS[label] if label < len(LABELS) else label}, "
                           f"its exchange number {seq} mod 32) than rank {me} ({self.label}, number {mine[0]} mod 32)"
                           + _counts_hint(label, mine[1], p))
                continue
            if meta != mine[2]:
                out.append(f"rank {p} sends {self._what_differs(meta)} than rank {me}'s "
                           f"{self.dtype} rows of {self.row_shape}" + (f" as {self.wire}" if self.wire else ""))
                continue
            if nbytes is None:
                got = f"a count of {sent} mod 64" if len(want) == 1 else "more"
                out.append(f"rank {p} sends more {self.unit} ({got}) to rank {me}, which expects {_show(want)}")
            elif nbytes != exp_bytes or sent != mine[3]:
                got = _show([nbytes // self.row_bytes]) if self.row_bytes and len(want) == 1 else "other counts"
                out.append(f"rank {p} sends {got} {self.unit} to rank {me}, which expects {_show(want)}")
            if expected != mine[4]:
                out.append(f"rank {me} sends {_show(self.send[p])} {self.unit} to rank {p}, which expects "
                           f"{'another count' if len(self.send[p]) > 1 else f'a count of {expected} mod 64'}")
        return out

    def _what_differs(self, meta: int) -> str:
        for dt in sorted(SUPPORTED_DTYPES, key=str):
            if meta_code(dt, self.row_shape, self.wire) == meta:
                return f"another dtype ({dt})"
        for wire in (None,) + tuple(w for w in (getattr(torch, "float8_e4m3fn", None),
                                               getattr(torch, "float8_e5m2", None)) if w is not None):
            if meta_code(self.dtype, self.row_shape, wire) == meta:
                return f"another wire dtype ({wire})"
        return "another dtype, row shape or wire dtype"

    def error(self, issues: list[str]) -> CountMismatchError:
        shown = "; ".join(issues[:8]) + (f"; and {len(issues) - 8} more" if len(issues) > 8 else "")
        return CountMismatchError(f"moecomm: {self.op}: ranks disagree on what they exchange: {shown} (found where "
                                  f"the rows landed; they must not be used)")


def _counts_hint(theirs: int, mine: int, peer: int) -> str:
    counts = LABELS.index("count exchange")
    if theirs == counts:
        return f" (rank {peer} exchanges counts: it passed no recv_splits, or validate differs)"
    if mine == counts:
        return f" (rank {peer} sends rows: it passed recv_splits, or validate differs)"
    return ""


def _show(counts: Sequence[int]) -> str:
    return str(counts[0]) if len(counts) == 1 else str(list(counts))
