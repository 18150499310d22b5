"""CUDA graph capture of a benchmark step (``--cuda-graph`` in ``bench.overlap`` and ``bench.moe_layer``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["capture"]


def capture(step: Callable[[], Any], device: torch.device, warmup: int = 3) -> tuple["torch.cuda.CUDAGraph", Any]:
    """``step`` captured into a CUDA graph, after ``warmup`` runs on a side stream (torch's
    recipe: autograd and the caching allocator settle their state outside the capture).
    Returns the graph and what the captured ``step()`` returned: each ``replay()`` reruns the
    step's GPU work on the tensors it used when captured, and refills those it returned."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result
