"""What ``fn`` is told about the rows of one stage of ``scatter_compute_gather``: a
:class:`Chunk` (counts, offsets, positions, per-expert grouping)."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from ..engine.device_tables import int64_table
from .overlap_plan import block_rows

__all__ = ["Chunk", "GroupOrder"]


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
            t = self._to_device(block_rows(offsets, np.asarray(self.source_offsets, dtype=np.int64),
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
        order = block_rows(np.zeros(1, dtype=np.int64), starts.T, part.T)
        return GroupOrder(self._to_device(order), part.sum(axis=0).tolist())
