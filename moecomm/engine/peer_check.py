"""The per-peer count check that travels with every variable-length exchange.

Before (or beside) the rows of an exchange, every rank sends each peer a short record: the
counts it sends that peer, the counts it expects from that peer (``-1`` where it does not
know them and learns them from this very record), and codes of its dtype and row shape.
Every rank sends and receives exactly one such record exchange per row exchange, in the same
order whether it passed ``recv_splits`` or not, so a rank can never read another's rows as
counts; and a peer that sends another count than this rank expects, or expects another
count than this rank sends, or moves another dtype or row shape, is named by a
:class:`moecomm.CountMismatchError` on both ranks of the pair.
"""

from __future__ import annotations

import functools
import zlib
from typing import Optional, Sequence

import torch

from ..errors import CountMismatchError

__all__ = ["PeerCheck", "UNKNOWN", "row_codes"]

UNKNOWN = -1
"""An expected count this rank does not know (it learns it from the record)."""


def row_codes(dtype: torch.dtype, row_shape: Sequence[int]) -> tuple[int, int]:
    """(dtype code, row-shape code): small non-negative ints, equal on ranks that agree."""
    return _row_codes(dtype, tuple(int(s) for s in row_shape))


@functools.lru_cache(maxsize=256)  # an explicit cache: every exchange asks, for a handful of row types
def _row_codes(dtype: torch.dtype, row_shape: tuple) -> tuple[int, int]:
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF, zlib.crc32(repr(row_shape).encode()) & 0x7FFFFFFF


class PeerCheck:
    """One exchange's records: ``sent[p]`` (k counts) to peer ``p``, ``expected[p]`` (k counts,
    or None: learnt from the peers), for ``dtype`` rows of ``row_shape``."""

    def __init__(self, op: str, rank: int, sent: Sequence[Sequence[int]], expected: Optional[Sequence[Sequence[int]]],
                 dtype: torch.dtype, row_shape: Sequence[int], unit: str = "rows") -> None:
        self.op = op
        self.rank = rank
        self.sent = [list(s) for s in sent]
        self.k = len(self.sent[0]) if self.sent else 0
        self.expected = None if expected is None else [list(e) for e in expected]
        self.dtype = dtype
        self.row_shape = tuple(row_shape)
        self.codes = row_codes(dtype, row_shape)
        self.unit = unit

    @property
    def per_peer(self) -> int:
        return 2 * self.k + 2

    def record(self) -> list[int]:
        """The ints this rank sends, peer by peer (``per_peer`` each)."""
        out: list[int] = []
        for p, s in enumerate(self.sent):
            out += s
            out += [UNKNOWN] * self.k if self.expected is None else self.expected[p]
            out += self.codes
        return out

    def record_tensor(self, counts: torch.Tensor) -> torch.Tensor:
        """:meth:`record` with ``k == 1`` built on ``counts``' device from a count tensor (no host sync)."""
        c = counts.to(torch.int64).reshape(-1, 1)
        out = torch.empty((c.shape[0], 4), dtype=torch.int64, device=c.device)
        out[:, :1] = c
        out[:, 1] = UNKNOWN
        out[:, 2] = self.codes[0]
        out[:, 3] = self.codes[1]
        return out.reshape(-1)

    def compare(self, received: Sequence[int]) -> tuple[list[list[int]], list[str], bool]:
        """What each peer sends this rank (k counts per peer), what disagrees, and whether the
        rows of this exchange may never complete: a side of a disagreeing pair that sends or
        expects no rows at all posts no message, so MPI would wait for it forever."""
        n = self.per_peer
        k = self.k
        theirs: list[list[int]] = []
        issues: list[str] = []
        stuck = False
        me = self.rank
        for p in range(len(self.sent)):
            r = list(received[p * n:(p + 1) * n])
            their_sent, their_expected, codes = r[:k], r[k:2 * k], tuple(r[2 * k:])
            theirs.append(their_sent)
            if p == me:
                continue
            if codes[0] != self.codes[0]:
                issues.append(f"rank {p} sends another dtype than rank {me}'s {self.dtype}")
            elif codes[1] != self.codes[1]:
                issues.append(f"rank {p} sends rows of another shape than rank {me}'s {self.row_shape}")
            if self.expected is not None and their_sent != self.expected[p]:
                issues.append(f"rank {p} sends {_show(their_sent)} {self.unit} to rank {me}, "
                              f"which expects {_show(self.expected[p])}")
                stuck = stuck or (sum(their_sent) == 0) != (sum(self.expected[p]) == 0)
            if their_expected != [UNKNOWN] * k and their_expected != self.sent[p]:
                issues.append(f"rank {me} sends {_show(self.sent[p])} {self.unit} to rank {p}, "
                              f"which expects {_show(their_expected)}")
                stuck = stuck or (sum(their_expected) == 0) != (sum(self.sent[p]) == 0)
        return theirs, issues, stuck

    def error(self, issues: list[str], moved: bool, aborted: bool = False) -> CountMismatchError:
        shown = "; ".join(issues[:8]) + (f"; and {len(issues) - 8} more" if len(issues) > 8 else "")
        tail = ("the rows were exchanged as each rank planned and must not be used" if moved
                else "no rows were exchanged")
        if aborted:
            tail += "; the communicator was aborted: the rows could not be exchanged safely (ranks waiting for them time out)"
        return CountMismatchError(f"moecomm: {self.op}: ranks disagree on what they exchange: {shown} ({tail})")


def _show(counts: list[int]) -> str:
    return str(counts[0]) if len(counts) == 1 else str(counts)
