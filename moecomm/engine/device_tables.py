"""Small int64 tables (row indices, block shifts) computed on the host, put on the device.

Outside CUDA graph capture a table goes over in one asynchronous copy from pinned memory.
Under capture that copy would become a graph node that reads the host buffer again at every
replay, long after the buffer was freed and reused. There the table is built on the device
from its runs instead (``arange`` for a run of consecutive values, ``fill`` for a run of one
value): each run's values are baked into the graph as kernel arguments.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["int64_table"]


def int64_table(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """``values`` (1-D, int64) as a tensor on ``device``; safe during CUDA graph capture."""
    a = np.ascontiguousarray(values, dtype=np.int64).reshape(-1)
    t = torch.from_numpy(a)
    if device.type != "cuda":
        return t
    if not torch.cuda.is_current_stream_capturing():
        return t.pin_memory().to(device, non_blocking=True)
    out = torch.empty(a.size, dtype=torch.int64, device=device)
    for start, stop, step in _runs(a):
        part = out[start:stop]
        if step:
            torch.arange(int(a[start]), int(a[start]) + (stop - start), dtype=torch.int64, device=device, out=part)
        else:
            part.fill_(int(a[start]))
    return out


def _runs(a: np.ndarray) -> list[tuple[int, int, int]]:
    """Split ``a`` into maximal runs of step 1 or step 0: ``(start, stop, step)``."""
    runs = []
    n = a.size
    i = 0
    while i < n:
        j = i + 1
        step = 1 if j < n and a[j] - a[i] == 1 else 0
        while j < n and a[j] - a[j - 1] == step:
            j += 1
        runs.append((i, j, step))
        i = j
    return runs
