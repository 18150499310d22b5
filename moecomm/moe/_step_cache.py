"""An explicit per-layer cache of the small constant tensors a step's glue needs (index
ranges, ones, the uniform layout's row-to-expert map), keyed by their shape, dtype and device,
so that an eager step does not launch a kernel to rebuild each of them every call."""

from __future__ import annotations

from typing import Callable, Hashable

import torch
from torch import Tensor

__all__ = ["StepConstants"]


class StepConstants:
    """Constant tensors by key; at most ``limit`` kept (all dropped when full: a layer sees
    few shapes). Every tensor handed out is read only: callers never write into it.

    Nothing is stored while a CUDA graph is being captured (a tensor made then holds its
    values only once the graph is replayed) or under ``torch.inference_mode`` (an inference
    tensor cannot be saved for a later backward); those calls get a fresh tensor."""

    __slots__ = ("_kept", "limit")

    def __init__(self, limit: int = 64) -> None:
        self._kept: dict = {}
        self.limit = limit

    def get(self, key: Hashable, make: Callable[[], Tensor], device: torch.device) -> Tensor:
        """The tensor kept under ``key`` (made on ``device`` by ``make()`` on first use)."""
        t = self._kept.get(key)
        if t is not None:
            return t
        t = make()
        if torch.is_inference_mode_enabled() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return t
        if len(self._kept) >= self.limit:
            self._kept.clear()
        self._kept[key] = t
        return t

    def arange(self, n: int, device: torch.device) -> Tensor:
        """``torch.arange(n)`` (int64)."""
        return self.get(("arange", n, device), lambda: torch.arange(n, device=device), device)

    def ones(self, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``torch.ones(n, dtype=dtype)``."""
        return self.get(("ones", n, dtype, device), lambda: torch.ones(n, dtype=dtype, device=device), device)

    def clear(self) -> None:
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)
