"""A bounded pool of staging buffers, one free list per (device, stream) and size class.

Buffers are handed out as uint8 tensors. The pool remembers each handed-out block by the
address of its storage, so :meth:`StagingPool.give` files the pooled block back whatever
views (dtype views, reshapes, slices) the caller made of it. A buffer given back after work was enqueued on
stream ``S`` can be handed out again at once for more work on ``S``: stream order keeps the
two apart, exactly as torch's caching allocator reasons. Host buffers (for counts read by
the CPU) are pinned when the pool serves a CUDA device.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Hashable

import torch

__all__ = ["StagingPool", "PoolStats"]

_MIN_BLOCK = 512


@dataclass(frozen=True)
class PoolStats:
    """Counters of a :class:`StagingPool`; sizes in bytes."""

    hits: int
    misses: int
    cached_bytes: int
    in_use_bytes: int
    capacity_bytes: int


def _size_class(nbytes: int) -> int:
    return max(_MIN_BLOCK, 1 << (max(nbytes, 1) - 1).bit_length())


class StagingPool:
    """Reusable staging memory, at most ``capacity_bytes`` cached (requests beyond it still succeed)."""

    def __init__(self, capacity_bytes: int) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise TypeError(f"capacity_bytes must be an int (bytes), got {capacity_bytes!r}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._free: dict[tuple, list[torch.Tensor]] = {}
        # Blocks handed out, by their storage's address: (block, free-list key, size class).
        self._out: dict[int, tuple[torch.Tensor, tuple, int]] = {}
        self._lock = threading.Lock()
        self._hits = self._misses = self._cached = self._in_use = 0

    def take(self, nbytes: int, device: torch.device, stream_key: Hashable = None, *, pinned: bool = False) -> torch.Tensor:
        """A uint8 tensor of exactly ``nbytes`` bytes (a view of a pooled block)."""
        size = _size_class(nbytes)
        key = (str(device), stream_key, pinned, size)
        with self._lock:
            blocks = self._free.get(key)
            if blocks:
                block = blocks.pop()
                self._cached -= size
                self._hits += 1
            else:
                block = None
                self._misses += 1
            self._in_use += size
        if block is None:
            try:
                block = torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pinned)
            except BaseException:
                with self._lock:
                    self._in_use -= size
                raise
        with self._lock:
            self._out[block.untyped_storage().data_ptr()] = (block, key, size)
        return block[:nbytes]

    def give(self, buffer: torch.Tensor, device: torch.device, stream_key: Hashable = None, *, pinned: bool = False) -> None:
        """Return a buffer from :meth:`take`, or any view of it (another dtype or shape).

        The block goes back to the free list it was taken for (``device``, ``stream_key``
        and ``pinned`` must be the ones passed to :meth:`take`).

        Raises:
            ValueError: ``buffer`` is not a view of a block handed out by this pool (never
                taken, or given back already), or the arguments name another free list.
        """
        ptr = buffer.untyped_storage().data_ptr()
        with self._lock:
            entry = self._out.pop(ptr, None)
            if entry is None:
                raise ValueError("buffer: not a block handed out by this StagingPool (or given back already)")
            block, key, size = entry
            if key[:3] != (str(device), stream_key, pinned):
                self._out[ptr] = entry
                raise ValueError(f"buffer was taken for (device, stream_key, pinned) = {key[:3]}, "
                                 f"given back for {(str(device), stream_key, pinned)}")
            self._in_use -= size
            if self._cached + size > self.capacity_bytes:
                return
            self._free.setdefault(key, []).append(block)
            self._cached += size

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._cached = 0

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(self._hits, self._misses, self._cached, self._in_use, self.capacity_bytes)
