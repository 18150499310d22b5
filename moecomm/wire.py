"""``all_to_all_v(..., wire_dtype=)``: rows travel quantized to FP8 with per-block scales.

Each row of the input is quantized and packed into one ``uint8`` row (its FP8 bytes and
its float32 block scales, padded to 16 bytes: :func:`moecomm.quant.pack_rows`, one fused
pass), the packed rows go through the ordinary exchange (same splits, any algorithm:
flat, 2DH, ``"auto"``, peer memory, with every check of a plain exchange), and each
received row is unpacked and dequantized to the input's dtype (one fused pass). The
result is :func:`moecomm.quant.quantize_rows` followed by
:func:`moecomm.quant.dequantize_rows`, bit for bit, whatever the path. Rows of ``D``
elements cost ``packed_row_bytes(D)`` bytes on the wire (``D + 4 * ceil(D / 128)``,
rounded up to 16) instead of ``D * element_size``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from . import hierarchical, quant
from .engine import tags as _tags
from .engine.engine import Engine
from .collectives.topology import Topology
from .errors import CountMismatchError
from .splits import Splits

__all__ = ["WIRE_BLOCK", "start_all_to_all_v", "start_packed_all_to_all_v", "exchange_rows", "reverse_rows", "wire_bytes",
           "check_input", "check_packed", "cross_check_packed"]

WIRE_BLOCK = quant.WIRE_BLOCK
"""Elements per scale block of a ``wire_dtype`` exchange (defined in :mod:`moecomm.quant`,
below the collectives that use it)."""

_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def check_input(engine: Engine, input: Any, wire_dtype: Any) -> torch.Tensor:
    """The local checks of a ``wire_dtype`` exchange (``TypeError``/``ValueError``)."""
    quant.check_wire_dtype(wire_dtype)
    x = engine.check_tensor(input, "input", min_dim=1)
    if x.dtype not in quant.INPUT_DTYPES:
        raise TypeError(f"input must be float32, bfloat16 or float16 to be sent with wire_dtype={wire_dtype}, "
                        f"got {x.dtype}")
    return x


def cross_check(engine: Engine, x: torch.Tensor, wire_dtype: torch.dtype, op: str) -> None:
    """``validate=True``: every rank raises together when any rank's rows are not all finite
    (``ValueError``) or the ranks disagree on the dtypes (``CountMismatchError``)."""
    nonfinite = x.numel() > 0 and not bool(torch.isfinite(x).all())
    _agree(engine, nonfinite, x.dtype, wire_dtype, op,
           f"input has non-finite values (inf or NaN), which wire_dtype={wire_dtype} cannot carry")


def _agree(engine: Engine, nonfinite: bool, dtype: torch.dtype, wire_dtype: torch.dtype, op: str,
           problem: str) -> None:
    """One agreement of every rank on (non-finite rows?, dtype, wire_dtype): all raise together."""
    table = engine.gather_ints([int(nonfinite), _CODES[dtype], _CODES[wire_dtype]], f"{op} (wire_dtype)")
    bad = [r for r, row in enumerate(table) if row[0]]
    if bad:
        raise ValueError(f"moecomm: {op} (validate=True): on rank(s) {bad}, {problem}")
    differ = [r for r, row in enumerate(table) if row[1:] != table[0][1:]]
    if differ:
        raise CountMismatchError(f"moecomm: {op} (validate=True): rank(s) {differ} passed another dtype or "
                                 f"wire_dtype than rank 0 (rank {engine.rank}: {dtype} as {wire_dtype})")


def check_packed(engine: Engine, packed: Any, row_shape: Any, dtype: Any, wire_dtype: Any) -> tuple[torch.Tensor, tuple]:
    """The local checks of an exchange of packed rows (``TypeError``/``ValueError``):
    ``(packed, row_shape as a tuple of ints)``."""
    quant.check_wire_dtype(wire_dtype)
    if dtype not in quant.INPUT_DTYPES:
        raise TypeError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16 (the rows' dtype once "
                        f"unpacked), got {dtype!r}")
    if isinstance(row_shape, int) or not isinstance(row_shape, (tuple, list, torch.Size)) or \
            not all(isinstance(n, int) and not isinstance(n, bool) for n in row_shape):
        raise TypeError(f"row_shape must be a tuple of ints (the shape of one unpacked row), got {row_shape!r}")
    row_shape = tuple(row_shape)
    if any(n < 0 for n in row_shape):
        raise ValueError(f"row_shape must not have negative sizes, got {row_shape}")
    x = engine.check_tensor(packed, "packed", min_dim=2)
    width = quant.packed_row_bytes(math.prod(row_shape), WIRE_BLOCK)
    if x.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8 (rows of quant.pack_rows / quant.gather_pack_rows), got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"packed must have shape [N, {width}] (quant.packed_row_bytes({math.prod(row_shape)}, "
                         f"{WIRE_BLOCK}) bytes per row of shape {row_shape}), got {tuple(x.shape)}")
    return x, row_shape


def cross_check_packed(engine: Engine, packed: torch.Tensor, row_elems: int, dtype: torch.dtype,
                       wire_dtype: torch.dtype, op: str) -> None:
    """``validate=True`` for packed rows: every rank raises together when any rank's rows hold
    a non-finite FP8 value or scale (``ValueError``: the rows they were packed from were not
    finite) or the ranks disagree on the dtypes (``CountMismatchError``)."""
    nonfinite = False
    if packed.shape[0] and row_elems:
        q = packed[:, :row_elems].contiguous().view(wire_dtype)
        off = -(-row_elems // 4) * 4
        scales = packed[:, off:off + 4 * quant.num_blocks(row_elems, WIRE_BLOCK)].contiguous().view(torch.float32)
        nonfinite = not bool(torch.isfinite(q.float()).all()) or not bool(torch.isfinite(scales).all())
    _agree(engine, nonfinite, dtype, wire_dtype, op,
           "packed rows hold non-finite values (inf or NaN): the rows they were packed from were not finite")


def start_all_to_all_v(
    engine: Engine,
    topology: Optional[Topology],
    input: torch.Tensor,
    send_splits: Splits,
    recv_splits: Optional[Splits],
    algorithm: str,
    wire_dtype: torch.dtype,
) -> tuple[torch.Tensor, list[int], list[int], Any, Any]:
    """Quantize, pack and issue the exchange: ``(output, send, recv, request, plan)``.

    ``output`` (``[sum(recv), *row_shape]`` in the input's dtype) is filled when
    ``request`` completes (its ``test()``/``join()`` dequantize into it); ``plan`` is the
    inner exchange's 2DH plan (None for a flat one), for a reversed backward.
    """
    op = "all_to_all_v"
    engine.check_open(op)
    x = check_input(engine, input, wire_dtype)
    if engine.validate:
        cross_check(engine, x, wire_dtype, op)
    packed = quant.pack_rows(x, wire_dtype, WIRE_BLOCK)
    return start_packed_all_to_all_v(engine, topology, packed, tuple(x.shape[1:]), x.dtype, send_splits, recv_splits,
                                     algorithm, wire_dtype)


def start_packed_all_to_all_v(
    engine: Engine,
    topology: Optional[Topology],
    packed: torch.Tensor,
    row_shape: tuple,
    dtype: torch.dtype,
    send_splits: Splits,
    recv_splits: Optional[Splits],
    algorithm: str,
    wire_dtype: torch.dtype,
) -> tuple[torch.Tensor, list[int], list[int], Any, Any]:
    """As :func:`start_all_to_all_v` for rows already packed (``[N, packed_row_bytes(D)]``
    uint8 from :func:`moecomm.quant.pack_rows` or :func:`moecomm.quant.gather_pack_rows`
    with block :data:`WIRE_BLOCK`; the caller's checks): the output is
    ``[sum(recv), *row_shape]`` in ``dtype``."""
    with _tags.labelled(wire=wire_dtype):  # the packed rows' tags name their FP8 dtype
        landing, send, recv, request = hierarchical.start_all_to_all_v(engine, topology, packed, send_splits,
                                                                       recv_splits, algorithm)
    out = torch.empty((sum(recv),) + tuple(row_shape), dtype=dtype, device=packed.device)

    def unpack() -> None:
        if out.numel():
            quant.unpack_rows(landing, row_shape, dtype, wire_dtype, WIRE_BLOCK, out=out)

    return out, send, recv, engine.then(request, unpack), getattr(request, "plan", None)


def wire_bytes(row_elems: int, rows: int) -> int:
    """Bytes ``rows`` rows of ``row_elems`` elements take on the wire in a ``wire_dtype`` exchange."""
    return rows * quant.packed_row_bytes(row_elems, WIRE_BLOCK)


def exchange_rows(engine: Engine, topology: Optional[Topology], x: torch.Tensor, send: list[int], recv: list[int], algorithm: str,
                  wire_dtype: torch.dtype) -> torch.Tensor:
    """A blocking ``wire_dtype`` exchange with both sides' counts known (autograd backward)."""
    out, _, _, request, _ = start_all_to_all_v(engine, topology, x, send, recv, algorithm, wire_dtype)
    engine.complete(request, "all_to_all_v", None)
    return out


def reverse_rows(engine: Engine, topology: Optional[Topology], plan: Any, g: torch.Tensor, wire_dtype: torch.dtype) -> torch.Tensor:
    """The backward of a 2DH exchange (``plan``) with the gradient rows sent in ``wire_dtype``."""
    x = check_input(engine, g.contiguous(), wire_dtype)
    if engine.validate:
        cross_check(engine, x, wire_dtype, "all_to_all_v (2dh backward)")
    row_shape = tuple(x.shape[1:])
    with _tags.labelled(wire=wire_dtype):
        landing = hierarchical.reverse_all_to_all_v(engine, topology, plan, quant.pack_rows(x, wire_dtype, WIRE_BLOCK))
    out = torch.empty((landing.shape[0],) + row_shape, dtype=x.dtype, device=x.device)
    if out.numel():
        quant.unpack_rows(landing, row_shape, x.dtype, wire_dtype, WIRE_BLOCK, out=out)
    return out

