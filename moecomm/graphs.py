"""Capturing a step of collectives into a CUDA graph (torch's recipe, in one call).

A captured step replays its GPU work (exchanges, GEMMs, layout copies) with one host call;
see README's "CUDA graphs" for what capture needs of the collectives in it (counts known on
the host, every rank capturing the same collectives in the same order).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

__all__ = ["capture", "host_synchronizations"]


def capture(step: Callable[[], Any], device: Optional[Union[torch.device, str, int]] = None,
            warmup: int = 3) -> tuple["torch.cuda.CUDAGraph", Any]:
    """Capture ``step()`` into a CUDA graph, after ``warmup`` eager runs on a side stream.

    The warm-up runs let autograd and the caching allocator settle their state outside the
    capture (torch's rule: a first run inside a capture would allocate or initialise there).
    Each ``graph.replay()`` reruns the step's GPU work on the tensors it used when captured
    and refills the tensors it returned: write new inputs into the captured ones
    (``copy_``), replay, read the returned ones. The watchdog cannot see a replay: call
    ``comm.watch_stream()`` after ``graph.replay()`` so that a replay waiting on a peer that
    never comes aborts the communicator after its timeout. Destroy the graph before closing
    the communicator whose collectives it captured.

    Args:
        step: a function without arguments issuing the GPU work; every rank must capture
            the same collectives in the same order.
        device: the CUDA device the work runs on (default: the current one).
        warmup: eager runs before the capture (at least 1 for a step with autograd or
            new allocations; 0 only for a step already run eagerly in the same shapes).

    Returns:
        ``(graph, result)``: the ``torch.cuda.CUDAGraph`` and what the captured ``step()``
        returned.

    Raises:
        TypeError: ``step`` is not callable, or ``warmup`` is not an int.
        ValueError: ``warmup`` is negative, or ``device`` is not a CUDA device.
        RuntimeError: CUDA is not available; or, from the step, anything that cannot be
            captured (for example ``all_to_all_v`` without ``recv_splits``).
    """
    if not callable(step):
        raise TypeError(f"argument 'step' must be callable; got {type(step).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int):
        raise TypeError(f"argument 'warmup' must be an int; got {warmup!r}")
    if warmup < 0:
        raise ValueError(f"argument 'warmup' must be >= 0; got {warmup}")
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("capture needs a CUDA device; none is available")
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"argument 'device' must be a CUDA device; got {device}")
    if not torch.cuda.is_available():
        raise RuntimeError("capture needs a CUDA device; none is available")
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


def host_synchronizations(fn: Callable[[], Any]) -> list[str]:
    """Run ``fn()`` once under ``torch.cuda.set_sync_debug_mode("warn")`` and return every
    host synchronisation it made (``.item()``, ``.tolist()``, a copy from pageable memory, a
    stream synchronisation) as ``"file:line: message"``, in order.

    A step that synchronises cannot run ahead of the GPU (the GPU idles while the host issues
    what follows) and cannot be captured. torch's detection is a prototype and may miss some.

    Raises:
        RuntimeError: no CUDA device.
    """
    import warnings

    if not torch.cuda.is_available():
        raise RuntimeError("host_synchronizations needs a CUDA device")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's one-time notice that the debug mode is a prototype is not a synchronisation
    return [f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:120]}" for w in caught
            if "called a synchronizing" in str(w.message)]
