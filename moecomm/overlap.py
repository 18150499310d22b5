"""Overlapped scatter/compute/gather: the MoE all-to-all pipelined with the experts' compute.

:func:`scatter_compute_gather` computes exactly what ``all_to_all_v -> fn -> all_to_all_v``
back computes, but cuts each pair's rows into pieces that travel in ``degree`` stages: ``fn``
runs on a stage as soon as it has arrived, while later stages are in flight, and its results
go home while ``fn`` works on the next; the backward pass is pipelined the same way. Why and
how (chunking, own rows first, transport, streams, autograd, failures): docs/overlap.md.

The parts: :mod:`moecomm.collectives.overlap_plan` (degrees and the chunk plan),
:mod:`moecomm.collectives.overlap_chunk` (what ``fn`` is told) and :mod:`moecomm.collectives.overlap_pipeline`
(the exchanges, streams and autograd functions).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Union

import torch

from . import hierarchical, wire
from .engine.dtypes import SUPPORTED_DTYPES
from .collectives.overlap_chunk import Chunk, GroupOrder
from .collectives.overlap_pipeline import Fn, Run, run_pipeline
from .collectives.overlap_plan import _AUTO_RULES, MAX_DEGREE, Plan, auto_pieces, auto_stages, check_degree  # noqa: F401
from .errors import CommunicatorClosedError
from .splits import Splits, check_own_block, check_split_total, normalize_splits

__all__ = ["scatter_compute_gather", "Chunk", "GroupOrder", "auto_pieces", "auto_stages", "MAX_DEGREE"]

_check_degree = check_degree  # (tests)


def scatter_compute_gather(
    comm: Any,
    input: torch.Tensor,
    send_splits: Splits,
    fn: Fn,
    *,
    degree: Union[int, str] = 2,
    recv_splits: Optional[Splits] = None,
    algorithm: Optional[str] = None,
    own_first: bool = False,
    own_split: float = 0.3,
    wire_dtype: Optional[torch.dtype] = None,
    packed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``all_to_all_v -> fn -> all_to_all_v`` back, pipelined in ``degree`` stages.

    Args:
        comm: the :class:`moecomm.Communicator`.
        input: ``[N, *row_shape]`` on ``comm.device``; rows grouped by destination rank.
        send_splits: rows for each rank (``size`` ints, or a 1-D integer tensor).
        fn: ``fn(rows, chunk) -> out_rows``: ``rows`` is ``[chunk.rows, *row_shape]``
            grouped by source rank, ``chunk`` a :class:`Chunk`; returns
            ``[chunk.rows, *out_shape]`` (row ``i`` computed from row ``i``). Called once
            per stage, on the caller's current stream, possibly with zero rows.
        degree: chunks per peer, 1 to :data:`MAX_DEGREE`, or ``"auto"``
            (:func:`auto_pieces`). 1 is the non-overlapped computation.
        recv_splits: rows from each rank, if known (else exchanged once, up front).
        algorithm: passed to every ``all_to_all_v`` of the pipeline (e.g. ``"2dh"``); None:
            its default. ``"auto"`` is decided once per call, for the whole input.
        own_first: the rank's own rows form a stage of their own (stage 0), which ``fn``
            works on while the peers' rows (cut into ``degree`` stages) are in flight; they
            are neither exchanged nor copied on the way in (``fn`` gets a view of
            ``input``). The backward pass likewise starts on the own rows. See "Own rows
            first" in docs/overlap.md.
        own_split: with ``own_first``, the fraction (0 to 1) of the own rows computed
            first; the rest form a last stage, computed while the peers' results travel
            home (in the backward pass the other way round). 1: all of them first. The
            default, 0.3, is the measured best (bench/results/README.md).
        wire_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``: the input's rows travel
            quantized (as ``all_to_all_v(..., wire_dtype=)``; the own rows of ``own_first``
            are quantized too) and ``fn`` gets them dequantized to ``input.dtype``; results
            and gradients travel in their own dtype. The gradient with respect to ``input``
            is the straight-through one. ``input`` must be float32, bfloat16 or float16.
        packed: with ``wire_dtype``, ``input``'s rows already quantized and packed
            (``[N, quant.packed_row_bytes(D)]`` uint8 from :func:`moecomm.quant.pack_rows` or
            :func:`moecomm.quant.gather_pack_rows`, block 128): they travel as they are, and
            ``input`` only gives the rows' shape and dtype and takes the gradient; its values
            are never read, so it may be a stand-in that holds none (a zero-stride
            ``expand``), as the MoE layer's fused dispatch passes.

    Returns:
        ``[N, *out_shape]``: row ``i`` is ``fn``'s result for ``input`` row ``i``, exactly
        as without overlap. Differentiable in ``input`` and in whatever ``fn`` uses
        (parameters); the backward pass is pipelined the same way.

    Raises:
        CommunicatorClosedError: the communicator is closed.
        TypeError, ValueError: bad ``fn``, ``input``, splits, ``degree``, ``own_first``,
            ``own_split`` or ``wire_dtype``, named, before anything is sent; ``fn`` returning
            a tensor of another row count, device, dtype or row shape (the communicator is
            then aborted, see docs/overlap.md, "Failures").
        CountMismatchError, TimeoutError: as ``Communicator.all_to_all_v``.
    """
    degree = _check_args(comm, input, fn, degree, own_first, own_split, wire_dtype)
    if packed is not None:
        packed = _check_packed(comm, input, packed, wire_dtype)
    dev = comm.device
    if algorithm == "auto":
        # Decided once for the whole call (one collective), not once per stage.
        algorithm = hierarchical.choose_algorithm(comm, input)
    kw = {} if algorithm is None else {"algorithm": algorithm}
    send, recv = _counts(comm, input, send_splits, recv_splits)
    stages, send_pieces, recv_pieces = _pieces(comm, degree, send, recv, input)
    own = comm.rank if own_first and comm.size > 1 else None
    plan = Plan(send, recv, send_pieces, recv_pieces, stages, dev, own, float(own_split))
    run = Run(comm, plan, fn, kw, wire_dtype, packed)

    x = input if packed is not None else input.contiguous()
    if packed is not None and comm.validate:
        wire.cross_check_packed(comm.engine, packed, math.prod(input.shape[1:]), input.dtype, wire_dtype,
                                "scatter_compute_gather")
    elif wire_dtype is not None and comm.validate:
        wire.cross_check(comm.engine, x, wire_dtype, "scatter_compute_gather")
    return run_pipeline(run, x, fn)


def _check_packed(comm: Any, input: torch.Tensor, packed: Any, wire_dtype: Any) -> torch.Tensor:
    """``packed`` checked against ``input`` (``TypeError``/``ValueError`` naming it)."""
    if wire_dtype is None:
        raise ValueError("packed needs wire_dtype: the FP8 dtype its rows were quantized to")
    packed, _ = wire.check_packed(comm.engine, packed, tuple(input.shape[1:]), input.dtype, wire_dtype)
    if packed.shape[0] != input.shape[0]:
        raise ValueError(f"packed must have one row per input row ({input.shape[0]}), got {packed.shape[0]}")
    return packed


def _counts(comm: Any, input: torch.Tensor, send_splits: Splits, recv_splits: Optional[Splits]
            ) -> tuple[list[int], list[int]]:
    """The rows for and from each rank, checked; ``recv_splits`` None: exchanged (blocking)."""
    send = normalize_splits(send_splits, "send_splits", comm.size)
    check_split_total(send, input.shape[0], "send_splits", "input")
    if recv_splits is None:
        return send, comm.engine.exchange_counts(send, "send_splits")[1]
    recv = normalize_splits(recv_splits, "recv_splits", comm.size)
    check_own_block(send, recv, comm.rank)
    return send, recv


def _check_args(comm: Any, input: Any, fn: Any, degree: Any, own_first: Any, own_split: Any,
                wire_dtype: Any) -> Union[int, str]:
    """The local checks of :func:`scatter_compute_gather`; returns the degree."""
    if comm.closed:
        raise CommunicatorClosedError("moecomm: cannot run scatter_compute_gather: the communicator is closed")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if input.dim() < 1:
        raise ValueError(f"input must have at least 1 dimension (rows along dim 0), got shape {tuple(input.shape)}")
    dev = comm.device
    if input.device.type != dev.type or (dev.type == "cuda" and input.device.index != dev.index):
        raise ValueError(f"input must be on {dev} (the communicator's device), got a tensor on {input.device}")
    if input.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"input has unsupported dtype {input.dtype}; supported: {sorted(map(str, SUPPORTED_DTYPES))}")
    degree = check_degree(degree)
    if wire_dtype is not None:
        from .quant import INPUT_DTYPES, check_wire_dtype

        check_wire_dtype(wire_dtype)
        if input.dtype not in INPUT_DTYPES:
            raise TypeError(f"input must be float32, bfloat16 or float16 to be sent with wire_dtype={wire_dtype}, "
                            f"got {input.dtype}")
    if not isinstance(own_first, bool):
        raise TypeError(f"own_first must be a bool, got {own_first!r}")
    if isinstance(own_split, bool) or not isinstance(own_split, numbers.Real) or not 0.0 <= own_split <= 1.0:
        raise ValueError(f"own_split must be a number in [0, 1], got {own_split!r}")
    return degree


def _pieces(comm: Any, degree: Union[int, str], send: list[int], recv: list[int],
            input: torch.Tensor) -> tuple[int, list[int], list[int]]:
    """(stages, pieces of each pair sent, pieces of each pair received) for ``degree``."""
    if degree == "auto":
        row_bytes = math.prod(input.shape[1:]) * input.element_size()
        return auto_stages(comm), auto_pieces(comm, send, row_bytes), auto_pieces(comm, recv, row_bytes)
    return degree, [degree] * comm.size, [degree] * comm.size
