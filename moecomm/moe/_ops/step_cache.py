"""An explicit per-layer cache of the small constant tensors a step's glue needs (index
ranges, ones, the uniform layout's row-to-expert map), keyed by their shape, dtype and device,
so that an eager step does not launch a kernel to rebuild each of them every call."""

from __future__ import annotations

from typing import Callable, Hashable

import torch
from torch import Tensor

from .segments import uniform_row_expert

__all__ = ["StepConstants"]


class StepConstants:
    """Constant tensors by key; at most ``limit`` kept (all dropped when full: a layer sees
    few shapes). Every tensor handed out is read only: callers never write into it.

    Nothing is stored while a CUDA graph is being captured (a tensor made then holds its
    values only once the graph is replayed) or under ``torch.inference_mode`` (an inference
    tensor cannot be saved for a later backward); those calls get a fresh tensor. Dropping
    the tensors when full assumes no stream still reads them (the step that made the cache
    full runs after the steps that used them, on their streams or after them)."""

    __slots__ = ("_kept", "limit")

    def __init__(self, limit: int = 64) -> None:
        self._kept: dict = {}
        self.limit = limit

    def get(self, key: Hashable, make: Callable[[], Tensor], device: torch.device) -> Tensor:
        """The tensor kept under ``key`` (made on ``device`` by ``make()`` on first use).

        On a GPU the tensor is made on the current stream, and a stage of a pipelined call
        may use it on another: until the kernels that made it are known to be done, every
        use first makes its stream wait for them (an event; no host sync)."""
        entry = self._kept.get(key)
        if entry is not None:
            t, made = entry
            if made is None:
                return t
            if torch.cuda.is_current_stream_capturing():
                return make()  # the event belongs to no capture: do not wait on it in one
            if made.query():
                self._kept[key] = (t, None)
            else:
                torch.cuda.current_stream(device).wait_event(made)
            return t
        t = make()
        if torch.is_inference_mode_enabled():
            return t
        made = None
        if device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return t
            made = torch.cuda.Event()
            made.record(torch.cuda.current_stream(device))
        if len(self._kept) >= self.limit:
            self._kept.clear()
        self._kept[key] = (t, made)
        return t

    def arange(self, n: int, device: torch.device) -> Tensor:
        """``torch.arange(n)`` (int64)."""
        return self.get(("arange", n, device), lambda: torch.arange(n, device=device), device)

    def ones(self, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``torch.ones(n, dtype=dtype)``."""
        return self.get(("ones", n, dtype, device), lambda: torch.ones(n, dtype=dtype, device=device), device)

    def row_expert(self, blocks: int, num_local: int, capacity: int, device: torch.device) -> Tensor:
        """The uniform layout's local expert of every row (``_segments.uniform_row_expert``)."""
        return self.get(("row_expert", blocks, num_local, capacity, device),
                        lambda: uniform_row_expert(blocks, num_local, capacity, device), device)

    def clear(self) -> None:
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)
