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
    """Row layout of an expert input: ``len(counts)`` blocks, block ``b`` holding
    ``counts[b][e]`` rows of local expert ``e`` for ``e = 0..num_local-1``, in that order."""

    counts: list[list[int]]
    num_local: int
    uniform: Optional[int] = None
    """Every count equals this (the padded capacity layout)."""
    counts_dev: Optional[Tensor] = None
    """The counts as an int64 ``[blocks, num_local]`` tensor on the rows' device, if at hand."""
    wgrad_sum: Optional["WeightGradSum"] = field(default=None, compare=False)
    """Shared by the stages of one pipelined call: see :class:`WeightGradSum`."""
    consts: Optional["StepConstants"] = field(default=None, compare=False, repr=False)
    """A layer's cache of constant tensors (the uniform layout's row map), if any."""
    rows: int = field(init=False)
    _row_expert: Optional[Tensor] = field(default=None, init=False, repr=False, compare=False)
    offsets_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    """The grouped GEMMs' segment ends, per (block or None, device): see ``_seg_gemm._offsets``."""

    def __post_init__(self) -> None:
        # A negative count (from ranks out of step: a count exchange that met another
        # collective) would make rows smaller than the segments' extent, and the row map's
        # repeat_interleave(output_size=rows) write past its buffer.
        for b, block in enumerate(self.counts):
            if block and min(block) < 0:
                raise ValueError(f"Segments: counts[{b}] = {list(block)} has a negative row count")
        self.rows = sum(sum(b) for b in self.counts)

    @classmethod
    def uniform_blocks(cls, blocks: int, num_local: int, capacity: int,
                       wgrad_sum: Optional["WeightGradSum"] = None,
                       consts: Optional["StepConstants"] = None) -> "Segments":
        return cls([[capacity] * num_local for _ in range(blocks)], num_local, uniform=capacity,
                   wgrad_sum=wgrad_sum, consts=consts)

    def block_rows(self) -> list[int]:
        return [sum(b) for b in self.counts]

    def items(self):
        """``(expert, first_row, rows)`` of every non-empty segment, in row order."""
        start = 0
        for block in self.counts:
            for e, n in enumerate(block):
                if n:
                    yield e, start, n
                start += n

    def per_expert(self) -> list[int]:
        return [sum(b[e] for b in self.counts) for e in range(self.num_local)]

    def row_expert(self, device: torch.device) -> Tensor:
        """``[rows]`` int64 local expert of every row (on ``device``, no host sync; kept for
        the next call on the same device)."""
        cached = self._row_expert
        if cached is None or cached.device != device:
            cached = self._row_expert = self._make_row_expert(device)
        return cached

    def _make_row_expert(self, device: torch.device) -> Tensor:
        if self.uniform is not None:  # built on the device: no host copy (safe in CUDA graph capture)
            blocks, El, C = len(self.counts), self.num_local, self.uniform
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
