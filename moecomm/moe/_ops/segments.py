"""The row layout of an expert input (:class:`Segments`).

The rows an expert rank receives are *blocks* (one per source rank, or one in data-parallel
mode), each holding the local experts' rows one expert after the other; :class:`Segments`
describes that layout, so the experts run straight on the received buffer without
reordering it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .seg_gemm import WeightGradSum
    from .step_cache import StepConstants

__all__ = ["Segments", "uniform_row_expert"]


def uniform_row_expert(blocks: int, num_local: int, capacity: int, device: torch.device) -> Tensor:
    """``[blocks * num_local * capacity]`` int64 local expert of every row of the uniform layout
    (made on the device: an int ``repeat_interleave`` may size its output with a host sync).
    Contiguous: with one local expert the expanded view reshapes to a zero-stride view, which
    the native row kernels refuse."""
    rows = torch.arange(num_local, device=device).view(1, num_local, 1).expand(blocks, num_local, capacity)
    return rows.reshape(-1).contiguous()


@dataclass
class Segments:
    """Row layout of an expert input: ``num_blocks`` blocks, block ``b`` holding
    ``counts[b][e]`` rows of local expert ``e`` for ``e = 0..num_local-1``, in that order.

    ``counts`` may be None when ``counts_dev`` and ``block_totals`` (the rows of each block)
    are given: the layout's counts then stay on the device, and the grouped GEMMs run from
    them with no host synchronisation; a path that needs the counts on the host
    (:meth:`host_counts`) copies them once (one host sync)."""

    counts: Optional[list[list[int]]]
    num_local: int
    uniform: Optional[int] = None
    """Every count equals this (the padded capacity layout)."""
    counts_dev: Optional[Tensor] = None
    """The counts as an int64 ``[blocks, num_local]`` tensor on the rows' device, if at hand."""
    wgrad_sum: Optional["WeightGradSum"] = field(default=None, compare=False)
    """Shared by the stages of one pipelined call: see :class:`WeightGradSum`."""
    consts: Optional["StepConstants"] = field(default=None, compare=False, repr=False)
    """A layer's cache of constant tensors (the uniform layout's row map), if any."""
    block_totals: Optional[list[int]] = None
    """The rows of each block: needed (and only read) when ``counts`` is None."""
    rows: int = field(init=False)
    _row_expert: Optional[Tensor] = field(default=None, init=False, repr=False, compare=False)
    offsets_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """The grouped GEMMs' segment ends, per (block or None, device): see ``_seg_gemm._offsets``."""

    def __post_init__(self) -> None:
        # A negative count (from ranks out of step: a count exchange that met another
        # collective) would make rows smaller than the segments' extent, and the row map's
        # repeat_interleave(output_size=rows) write past its buffer.
        if self.counts is None:
            if self.counts_dev is None or self.block_totals is None:
                raise ValueError("Segments: counts=None needs counts_dev and block_totals")
            if self.counts_dev.dim() != 2 or tuple(self.counts_dev.shape) != (len(self.block_totals), self.num_local):
                raise ValueError(f"Segments: counts_dev must be [blocks={len(self.block_totals)}, "
                                 f"num_local={self.num_local}], got {tuple(self.counts_dev.shape)}")
            self.rows = sum(self.block_totals)
            return
        self._check_counts(self.counts)
        self.rows = sum(sum(b) for b in self.counts)

    @staticmethod
    def _check_counts(counts: list[list[int]]) -> None:
        for b, block in enumerate(counts):
            if block and min(block) < 0:
                raise ValueError(f"Segments: counts[{b}] = {list(block)} has a negative row count")

    @classmethod
    def on_device(cls, counts_dev: Tensor, block_totals: list[int], num_local: int,
                  wgrad_sum: Optional["WeightGradSum"] = None) -> "Segments":
        """A layout whose per-expert counts (``counts_dev``, int64 ``[blocks, num_local]``) stay
        on the device; ``block_totals``: each block's rows, known on the host."""
        return cls(None, num_local, counts_dev=counts_dev, wgrad_sum=wgrad_sum, block_totals=list(block_totals))

    @property
    def num_blocks(self) -> int:
        return len(self.counts) if self.counts is not None else len(self.block_totals)

    def host_counts(self) -> list[list[int]]:
        """``counts`` on the host: for a layout made :meth:`on_device`, copied from the device
        once (a host synchronisation) and checked as the constructor checks given counts."""
        if self.counts is None:
            counts = self.counts_dev.tolist()
            self._check_counts(counts)
            if [sum(b) for b in counts] != self.block_totals:
                raise ValueError(f"Segments: the device counts add up to {[sum(b) for b in counts]} rows per "
                                 f"block, not block_totals={self.block_totals}")
            self.counts = counts
        return self.counts

    @classmethod
    def uniform_blocks(cls, blocks: int, num_local: int, capacity: int,
                       wgrad_sum: Optional["WeightGradSum"] = None,
                       consts: Optional["StepConstants"] = None) -> "Segments":
        return cls([[capacity] * num_local for _ in range(blocks)], num_local, uniform=capacity,
                   wgrad_sum=wgrad_sum, consts=consts)

    def block_rows(self) -> list[int]:
        if self.counts is None:
            return list(self.block_totals)
        return [sum(b) for b in self.counts]

    def items(self):
        """``(expert, first_row, rows)`` of every non-empty segment, in row order."""
        start = 0
        for block in self.host_counts():
            for e, n in enumerate(block):
                if n:
                    yield e, start, n
                start += n

    def per_expert(self) -> list[int]:
        counts = self.host_counts()
        return [sum(b[e] for b in counts) for e in range(self.num_local)]

    def row_expert(self, device: torch.device) -> Tensor:
        """``[rows]`` int64 local expert of every row (on ``device``, no host sync; kept for
        the next call on the same device)."""
        cached = self._row_expert
        if cached is None or cached.device != device:
            cached = self._row_expert = self._make_row_expert(device)
        return cached

    def _make_row_expert(self, device: torch.device) -> Tensor:
        if self.uniform is not None:  # built on the device: no host copy (safe in CUDA graph capture)
            blocks, El, C = self.num_blocks, self.num_local, self.uniform
            if self.consts is None:
                return uniform_row_expert(blocks, El, C, device)
            return self.consts.row_expert(blocks, El, C, device)
        if self.counts_dev is not None:
            ids = torch.arange(self.num_local, device=device).repeat(self.counts_dev.shape[0])
            return torch.repeat_interleave(ids, self.counts_dev.reshape(-1), output_size=self.rows)
        counts = torch.tensor(self.counts, dtype=torch.int64).reshape(-1)
        ids = torch.arange(self.num_local, dtype=torch.int64).repeat(len(self.counts))
        flat = torch.repeat_interleave(ids, counts, output_size=self.rows)
        return flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat
